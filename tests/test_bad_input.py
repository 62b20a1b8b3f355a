"""Bad input gives a clear error naming the problem and leaves the Dask worker serving (spec §2 failure classes,
§3; DESIGN.md "Decisions": fatal errors fail the *session*, the Dask worker process survives).

Fatal (class F) errors fail the session with ``SessionError``; value (class V) errors raise ``RemoteException``
from the fetch of a dependent value while the session keeps working. After each failure a new session on the
same cluster must still compute a correct value, in the same worker process.
"""

from __future__ import annotations

import operator
import os
import time

import pytest
import torch

import dask_monarch as dm
from rawmsg import ctl_messages, get_refs
from dask_monarch.protocol import (
    ArgsKwargs,
    CallFunction,
    CreateDeviceMesh,
    CreateStream,
    Factory,
    FunctionPath,
    GetRefUnitTestsOnly,
    PipeRecv,
    ProtocolError,
    Reduce,
    Reduction,
    RemoteFunctionFailed,
    Slice,
    StreamCreationMode,
    StreamRef,
)

TIMEOUT = 60
ST0 = StreamRef(0)


def make_values(n):
    return torch.arange(n, dtype=torch.float32) * 2


def one_tensor():
    return torch.ones(3)


def two_fakes():
    return torch.empty(3), torch.empty(3)


@pytest.fixture
def worker_pids(client1):
    """The worker processes before the test; checked afterwards to be the same, still serving."""
    before = client1.run(os.getpid)
    yield before
    assert client1.run(os.getpid) == before


def session_state_on_workers(client, session_id: str) -> dict:
    """Per worker: has the session ended there (with which failure text), does the worker plugin still hold it,
    and how many of its threads are alive."""

    def probe(dask_worker):
        import threading

        plugin = dask_worker.plugins["dask-monarch"]
        threads = [t for t in threading.enumerate() if t.name.startswith(f"monarch-{session_id[:8]}-")]
        return {
            "ended": session_id in plugin.closed,
            "failure": plugin.closed.get(session_id),
            "held": session_id in plugin.sessions,
            "threads": len(threads),
        }

    return client.run(probe)


def assert_session_released(client, session_id: str) -> dict:
    """Wait (bounded) until every worker has ended the session and freed it; return the workers' states."""

    def released(state):
        return state["ended"] and not state["held"] and state["threads"] == 0

    deadline = time.monotonic() + TIMEOUT
    states = session_state_on_workers(client, session_id)
    while not all(map(released, states.values())) and time.monotonic() < deadline:
        time.sleep(0.1)
        states = session_state_on_workers(client, session_id)
    assert all(map(released, states.values())), states
    return states


def assert_cluster_serves(client):
    """Ordinary Dask work and a new dask_monarch session on the same cluster still give correct values."""
    assert client.submit(operator.add, 1, 2, pure=False).result(timeout=TIMEOUT) == 3
    with dm.attach(client, dims={"workers": 1}, comm_timeout=60) as mesh:
        with mesh.activate():
            t = dm.remote(make_values)(4)
        assert torch.equal(dm.fetch_shard(t).result(timeout=TIMEOUT), make_values(4))


def fails_fatally(mesh, *messages) -> dm.SessionError:
    """Send ``messages`` raw to every rank and return the ``SessionError`` the next wait raises."""
    session = mesh._session
    for message in messages:
        session.send(message)
    with pytest.raises(dm.SessionError) as info:
        session.sync("after bad input").result(timeout=TIMEOUT)
    # the session is over: later use raises the same error instead of hanging, and the worker freed it
    with pytest.raises(dm.SessionError):
        session.send(GetRefUnitTestsOnly(session.new_ref(), ST0))
    assert_session_released(session.client, session.id)
    return info.value


def call_on(stream: StreamRef, seq: int) -> CallFunction:
    return CallFunction(seq, [None], [], FunctionPath("torch.ops.aten.ones.default"), ArgsKwargs(([1],)), stream, [])


# ------------------------------------------------------------------------------------------------ fatal
def test_unknown_stream_fails_the_session(mesh1, client1, worker_pids):
    error = fails_fatally(mesh1, call_on(StreamRef(99), mesh1._session.new_seq()))
    assert "unknown stream 99" in str(error)
    assert "rank 0" in str(error)
    assert_cluster_serves(client1)


def test_fatal_error_frees_the_session_and_leaves_other_sessions_alone(mesh1, client1, worker_pids):
    with dm.attach(client1, dims={"workers": 1}, comm_timeout=60) as other:
        with other.activate():
            kept = dm.remote(make_values)(5)
        assert torch.equal(dm.fetch_shard(kept).result(timeout=TIMEOUT), make_values(5))
        session = mesh1._session
        session.send(CreateStream(StreamRef(1), StreamCreationMode.CreateNewStream))
        session.send(call_on(StreamRef(99), session.new_seq()))
        session.flush()  # delivered without a status request: the worker fails and releases the session alone
        (state,) = assert_session_released(client1, session.id).values()
        assert "unknown stream 99" in state["failure"]
        # asked afterwards, the worker still names the problem
        with pytest.raises(dm.SessionError, match="unknown stream 99"):
            session.sync("after the session stopped on the worker").result(timeout=TIMEOUT)
        # the other session on the same worker still holds its value
        assert torch.equal(dm.fetch_shard(kept).result(timeout=TIMEOUT), make_values(5))


def test_message_with_a_bad_field_fails_the_session_naming_the_field(mesh1, client1, worker_pids):
    msg = CreateStream(StreamRef(7), StreamCreationMode.CreateNewStream)
    msg.id = 7  # mutated after construction: only the worker's check sees it
    error = fails_fatally(mesh1, msg)
    assert "malformed message: CreateStream.id: expected a StreamRef, got 7 (int)" in str(error)
    assert_cluster_serves(client1)


def test_call_function_with_a_bad_field_fails_the_session_naming_the_field(mesh1, client1, worker_pids):
    msg = call_on(ST0, mesh1._session.new_seq())
    msg.results = ["r1"]  # mutated after construction; it travels in stream 0's segment (protocol/batch.py)
    error = fails_fatally(mesh1, msg)
    assert "malformed message: CallFunction.results[0]: expected a Ref or None, got 'r1' (str)" in str(error)
    assert_cluster_serves(client1)


@pytest.mark.parametrize("bad_stream", [0, None], ids=["int", "None"])
def test_call_function_with_a_bad_stream_fails_the_session_naming_the_field(mesh1, client1, worker_pids, bad_stream):
    # the controller picks a stream's segment by the message's stream (protocol/batch.py): a bad one must reach the
    # worker's check like any other bad field, not break the controller's flush and lose the buffered messages
    msg = call_on(ST0, mesh1._session.new_seq())
    msg.stream = bad_stream  # mutated after construction
    error = fails_fatally(mesh1, msg)
    text = f"malformed message: CallFunction.stream: expected a StreamRef, got {bad_stream!r} ({type(bad_stream).__name__})"
    assert text in str(error)
    assert_cluster_serves(client1)


def test_message_built_without_its_constructor_fails_the_session(mesh1, client1, worker_pids):
    error = fails_fatally(mesh1, object.__new__(GetRefUnitTestsOnly))
    assert "GetRefUnitTestsOnly.value: missing" in str(error)
    assert_cluster_serves(client1)


def test_constructing_a_malformed_message_raises_before_sending():
    with pytest.raises(ProtocolError, match=r"CallFunction\.stream: expected a StreamRef, got 0 \(int\)"):
        CallFunction(0, [None], [], FunctionPath("torch.ops.aten.ones.default"), ArgsKwargs(), 0, [])


def test_raw_reduce_over_an_unknown_dim_fails_the_session_naming_the_dim(mesh1, client1, worker_pids):
    session = mesh1._session
    mesh_ref, tensor, result = session.new_ref(), session.new_ref(), session.new_ref()
    error = fails_fatally(
        mesh1,
        CreateDeviceMesh(mesh_ref, ["workers"], Slice(0, [1], [1])),
        CallFunction(session.new_seq(), [tensor], [], FunctionPath("torch.ops.aten.ones.default"),
                     ArgsKwargs(([3],)), ST0, []),
        Reduce(result, tensor, Factory((3,), torch.float32), mesh_ref, ST0, ["nope"], Reduction.Sum, False, False,
               None),
    )
    assert "unknown mesh dimension 'nope'" in str(error)
    assert_cluster_serves(client1)


def test_second_write_to_a_result_ref_fails_the_session(mesh1, client1, worker_pids):
    # spec §2 panics; DESIGN.md "Decisions": a clear protocol error for the session, the worker keeps running
    session = mesh1._session
    ref = session.new_ref()
    first = CallFunction(session.new_seq(), [ref], [], FunctionPath("torch.ops.aten.ones.default"), ArgsKwargs(([1],)),
                         ST0, [])
    second = CallFunction(session.new_seq(), [ref], [], FunctionPath("torch.ops.aten.zeros.default"),
                          ArgsKwargs(([1],)), ST0, [])
    error = fails_fatally(mesh1, first, second)
    assert f"Duplicate write to reference {ref}" in str(error)
    assert_cluster_serves(client1)


def test_pipe_recv_of_an_unknown_pipe_is_a_value_error(mesh1):
    # PipeRecv is implemented (issue 15): a ref that holds no pipe fails that recv's results, not the session
    session = mesh1._session
    results = [session.new_ref(), session.new_ref()]
    seq = session.new_seq()
    session.send(PipeRecv(seq, results, session.new_ref(), ST0))
    (answer,) = get_refs(session, (results[0], ST0))
    assert "pipe not found" in answer.error
    failed = [m for m in ctl_messages(session) if isinstance(m, RemoteFunctionFailed)]
    assert [m.seq for m in failed] == [seq]


# ---------------------------------------------------------------------------------------- controller checks
def test_reduce_over_an_unknown_dim_raises_before_sending(mesh1, monkeypatch):
    session = mesh1._session
    with mesh1.activate():
        x = dm.remote(make_values)(3)
    sent = []
    real_send = session.send
    monkeypatch.setattr(session, "send", lambda message, ranks=None: (sent.append(message), real_send(message, ranks)))
    with pytest.raises(KeyError, match="'nope' is not a dimension of the mesh"):
        x.reduce("nope")
    assert sent == []
    assert torch.equal(dm.fetch_shard(x).result(timeout=TIMEOUT), make_values(3))


def test_reduce_over_dims_that_are_not_names_raises_naming_them(mesh1):
    """``x.reduce(0)`` (a position, not a name) said only "'int' object is not iterable"."""
    with mesh1.activate():
        x = dm.remote(make_values)(3)
    with pytest.raises(TypeError, match=r"reduce: dims must be a dimension name or a tuple of names, got 0"):
        x.reduce(0)
    with pytest.raises(KeyError, match=r"reduce: 0 is not a dimension of the mesh"):
        x.reduce((0,))
    assert torch.equal(dm.fetch_shard(x).result(timeout=TIMEOUT), make_values(3))


# --------------------------------------------------------------------------------------------- value errors
def test_unknown_function_is_a_value_error(mesh1, client1, worker_pids):
    with mesh1.activate():
        x = dm.remote(make_values)(3)
    bad = dm.remote("i.dont.exist", propagate=lambda t: torch.empty(3))(x)
    with pytest.raises(dm.RemoteException, match="failed to resolve function") as info:
        dm.fetch_shard(bad).result(timeout=TIMEOUT)
    assert "i.dont.exist" in str(info.value)
    # x, an input that the failed call did not mutate, stays valid, and the session keeps working
    assert torch.equal(dm.fetch_shard(x).result(timeout=TIMEOUT), make_values(3))
    with mesh1.activate():
        y = dm.remote(make_values)(2)
    assert torch.equal(dm.fetch_shard(y).result(timeout=TIMEOUT), make_values(2))
    assert_cluster_serves(client1)


def test_wrong_number_of_results_is_a_value_error(mesh1, client1, worker_pids):
    with mesh1.activate():
        x = dm.remote(make_values)(3)
        a, b = dm.remote(one_tensor, propagate=two_fakes)()
    for result in (a, b):
        with pytest.raises(dm.RemoteException, match="unexpected number of returns from op, expected 2, got 1"):
            dm.fetch_shard(result).result(timeout=TIMEOUT)
    assert torch.equal(dm.fetch_shard(x).result(timeout=TIMEOUT), make_values(3))
    assert_cluster_serves(client1)


def test_wrong_number_of_results_names_a_cloudpickled_function(mesh1):
    """A lambda (sent by value) is named by its qualified name, not "<cloudpickled function, 691 bytes>"."""
    with mesh1.activate():
        r = dm.remote(lambda: (torch.ones(3), torch.ones(3)), propagate=lambda: torch.empty(3))()
    with pytest.raises(dm.RemoteException, match=r"expected 1, got 2 \(remote function [\w.]*test_wrong_number_of_"
                                                 r"results_names_a_cloudpickled_function\.<locals>\.<lambda>\)"):
        dm.fetch_shard(r).result(timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------ attach arguments
def scheduler_sessions(client) -> dict:
    return client.sync(client.scheduler.monarch_sessions) or {}  # None before dask_monarch's first attach


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(workers=[]), ValueError, "workers: give at least one"),
        (dict(workers="tcp://127.0.0.1:1"), TypeError, "workers must be a list"),
        (dict(workers=[1]), TypeError, "workers must be Dask worker addresses"),
        (dict(dims="dp"), TypeError, "dims must be a mapping"),
        (dict(dims=3), TypeError, "dims must be a mapping"),
        (dict(dims=("dp", "tp")), TypeError, "dims must be a mapping"),  # not {"d": "p", "t": "p"}
        (dict(dims=[("dp", 1), ("dp", 1)]), ValueError, "a dimension name appears twice"),
        (dict(dims={"dp": 1}, session_id="x"), TypeError, "unexpected keyword argument 'session_id'"),
        (dict(dims={"dp": 1}, comm_timeout=0), ValueError, "comm_timeout must be a positive number of seconds, got 0"),
        (dict(dims={"dp": 1}, comm_timeout=-5), ValueError, "comm_timeout must be a positive number"),
        (dict(dims={"dp": 1}, comm_timeout="60"), ValueError, "comm_timeout must be a positive number"),
        (dict(dims={"dp": 1}, timeout=None), ValueError, "timeout must be a positive number of seconds, got None"),
        (dict(dims={"dp": 1}, timeout=float("inf")), ValueError, "timeout must be a positive number"),
        (dict(dims={"dp": 1}, heartbeat_timeout=0), ValueError, "heartbeat_timeout must be a positive number"),
        (dict(dims={"dp": 1}, liveness_interval=-1), ValueError, "liveness_interval must be a positive number"),
        (dict(dims={"dp": 1}, flush_interval=-1), ValueError, "flush_interval must be a non-negative number"),
        (dict(dims={"dp": 1}, max_batch=0), ValueError, "max_batch must be a positive int, got 0"),
        (dict(dims={"dp": 1}, max_batch=2.5), ValueError, "max_batch must be a positive int"),
        (dict(dims={"dp": 1}, bogus=1), TypeError, "unexpected keyword argument 'bogus'"),
    ],
)
def test_attach_rejects_bad_arguments_naming_them(client1, kwargs, error, text):
    before = scheduler_sessions(client1)
    with pytest.raises(error, match=text):
        dm.attach(client1, **kwargs)
    assert scheduler_sessions(client1) == before  # nothing was started


def test_attach_takes_the_client_as_client_keyword_and_dims_as_pairs(client1):
    with dm.attach(client=client1, dims=[("dp", 1)], comm_timeout=60) as mesh:
        assert mesh.client is client1 and mesh.sizes == {"dp": 1}
        assert dm.inspect(dm.remote(torch.add)(mesh.rank("dp"), 1)).item() == 1
    before = scheduler_sessions(client1)
    with pytest.raises(TypeError, match="both cluster and client="):
        dm.attach(client1, client=client1, dims={"dp": 1})
    assert scheduler_sessions(client1) == before


def test_attach_with_more_ranks_than_workers_times_out_naming_the_dims(client1):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"dims \{'dp': 3\} need 3 workers, but the cluster has 1"):
        dm.attach(client1, dims={"dp": 3}, timeout=2)
    assert time.monotonic() - start < 30
    assert_cluster_serves(client1)


# ------------------------------------------------------------------------------------- tensors of two sessions
def add_vectors(a, b):
    return a + b


def test_tensors_of_another_session_are_rejected(client1):
    """Two sessions on the same workers have the same rank lists and reuse the same ref ids: a tensor of one
    must never be sent to the other, where its ref names a different value."""
    a = dm.attach(client1, dims={"workers": 1}, comm_timeout=60)
    b = dm.attach(client1, dims={"workers": 1}, comm_timeout=60)
    try:
        with a.activate():
            xa = dm.remote(make_values)(3)
            pad = dm.remote(make_values)(3)  # so that xb's ref id names a live tensor of session a
        with b.activate():
            xb = dm.remote(make_values)(3)
        assert xb.ref == pad.ref or xb.ref == xa.ref
        same_shape = dict(propagate=lambda x, y: torch.empty(3))
        with pytest.raises(TypeError, match="WRONG_MESH.*another session"):
            dm.remote(add_vectors, **same_shape)(xa, xb)
        with pytest.raises(TypeError, match="WRONG_MESH.*another session"):
            dm.remote(add_vectors, **same_shape)(xa, b)  # a mesh of session b as an argument
        with b.activate(), pytest.raises(TypeError, match="WRONG_MESH.*another session"):
            dm.remote(make_values)(a)  # session b is active, the mesh argument belongs to session a
        with pytest.raises(TypeError, match="WRONG_MESH.*another session"):
            dm.fetch_shard([xa, xb])
        with pytest.raises(TypeError, match="WRONG_MESH.*another session"):
            xa.reduce("workers", "sum", out=xb)
        # both sessions are untouched
        assert torch.equal(dm.fetch_shard(xa).result(timeout=TIMEOUT), make_values(3))
        assert torch.equal(dm.fetch_shard(xb).result(timeout=TIMEOUT), make_values(3))
    finally:
        a.exit()
        b.exit()


# ------------------------------------------------------------------------------- remote functions that raise
class CustomBaseException(BaseException):
    pass


def raise_keyboard_interrupt(x):
    raise KeyboardInterrupt("pressed in a remote function")


def raise_system_exit(x):
    raise SystemExit(3)


def raise_custom_base_exception(x):
    raise CustomBaseException("not an Exception subclass")


@pytest.mark.parametrize(
    "fn, text",
    [
        (raise_keyboard_interrupt, "KeyboardInterrupt: pressed in a remote function"),
        (raise_system_exit, "SystemExit: 3"),
        (raise_custom_base_exception, "CustomBaseException: not an Exception subclass"),
    ],
)
def test_remote_function_raising_a_base_exception_is_a_value_error(mesh1, client1, worker_pids, fn, text):
    """Like any Python error of a remote function (spec §2 CallFunction): the results carry it, the session and
    every other ref live on."""
    with mesh1.activate():
        x = dm.remote(make_values)(3)
    bad = dm.remote(fn, propagate=lambda x: torch.empty(3))(x)
    with pytest.raises(dm.RemoteException, match=text):
        dm.fetch_shard(bad).result(timeout=TIMEOUT)
    with pytest.raises(dm.RemoteException, match=text):  # a dependent carries the same error
        dm.fetch_shard(dm.remote(torch.clone)(bad)).result(timeout=TIMEOUT)
    assert torch.equal(dm.fetch_shard(x).result(timeout=TIMEOUT), make_values(3))


# ------------------------------------------------------------------------------------ arguments that don't travel
def add_one(x, extra):
    return x + 1


def _cannot_load(reason):
    raise ModuleNotFoundError(reason)


class NotOnTheWorkers:
    """Pickles fine on the controller, but cannot be unpickled on the workers (as an object of a module that only
    the controller has)."""

    def __reduce__(self):
        return (_cannot_load, ("No module named 'only_on_the_controller'",))


def test_unpicklable_argument_raises_at_the_call_naming_it(mesh1, client1, worker_pids):
    import threading

    with mesh1.activate():
        x = dm.remote(make_values)(3)
    with pytest.raises(TypeError, match=r"add_one: an argument of type lock cannot be pickled"):
        dm.remote(add_one, propagate=lambda x, e: torch.empty(3))(x, threading.Lock())
    with pytest.raises(TypeError, match=r"fetch_shard: an argument of type lock cannot be pickled"):
        dm.fetch_shard({"x": x, "lock": threading.Lock()})
    # nothing was sent: the session and x live on
    assert torch.equal(dm.fetch_shard(x).result(timeout=TIMEOUT), make_values(3))
    assert dm.fetch_shard({"x": x, "n": 5}).result(timeout=TIMEOUT)["n"] == 5


def test_argument_that_cannot_be_unpickled_on_the_worker_is_a_value_error(mesh1, client1, worker_pids):
    """Spec §2 CallFunction step 1: unpickling the arguments is part of the call, so its failure is the call's
    value error; the session and the other refs live on."""
    with mesh1.activate():
        x = dm.remote(make_values)(3)
    y = dm.remote(add_one, propagate=lambda x, e: torch.empty(3))(x, NotOnTheWorkers())
    with pytest.raises(dm.RemoteException, match="only_on_the_controller") as info:
        dm.fetch_shard(y).result(timeout=TIMEOUT)
    assert "NotOnTheWorkers" in str(info.value)
    assert torch.equal(dm.fetch_shard(x).result(timeout=TIMEOUT), make_values(3))
    assert torch.equal(dm.fetch_shard(dm.remote(add_one)(x, 7)).result(timeout=TIMEOUT), make_values(3) + 1)


# ----------------------------------------------------------------------------------------- fetch coordinates
def test_a_module_made_outside_activate_is_named_for_its_local_parameters(mesh1):
    """An ``nn.Linear`` made before ``activate()`` and called inside: the LOCAL_TENSOR error says that module
    parameters made outside are local tensors, not just "shape (2,)" (its bias), and how to fix it; the fix it
    gives works and keeps the module's values (issue 25 item 7)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x_local = torch.arange(4.0)
    expected = model(x_local).detach()
    ones = torch.ones(4)  # a plain local tensor
    with mesh1.activate():
        x = torch.arange(4.0)
        with pytest.raises(TypeError, match=r"^LOCAL_TENSOR: a local nn.Parameter \(shape \(2,\), dtype torch.float32\) is "
                                            r"mixed with remote tensors: module parameters created outside "
                                            r"mesh.activate\(\) are local tensors. Create the module under"):
            model(x)
        with pytest.raises(TypeError, match=r"^LOCAL_TENSOR: a local torch.Tensor is mixed with remote tensors"):
            x + ones  # keeps its message
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)  # the fix given
        assert all(isinstance(p, dm.Tensor) for p in model.parameters())
        y = model(x)
    assert torch.allclose(dm.inspect(y), expected)


def test_fetch_coordinates_must_be_ints_and_numpy_ints_are_ints(mesh1):
    import numpy as np

    with mesh1.activate():
        x = dm.remote(make_values)(3)
    assert torch.equal(dm.fetch_shard(x, workers=np.int64(0)).result(timeout=TIMEOUT), make_values(3))
    for bad in ("0", 0.0, True, None):
        with pytest.raises(TypeError, match=rf"fetch_shard: coordinate workers={bad!r} must be an int"):
            dm.fetch_shard(x, workers=bad)
    with pytest.raises(IndexError, match="fetch_shard: coordinate workers=1 out of range for size 1"):
        dm.fetch_shard(x, workers=1)
    with pytest.raises(TypeError, match=r"fetch_shard: shard must be a dict of dimension -> coordinate, got \[0\]"):
        dm.fetch_shard(x, [0])
    assert torch.equal(dm.fetch_shard(x).result(timeout=TIMEOUT), make_values(3))


def test_remote_rejects_what_it_cannot_call_when_it_is_made():
    with pytest.raises(TypeError, match="remote\\(\\) needs a callable or a dotted path, got int"):
        dm.remote(5)
    with pytest.raises(ValueError, match="remote function paths must be fully qualified, got 'nodot'"):
        dm.remote("nodot")


# --------------------------------------------------------------------------------- fetched values that don't travel
def return_a_lock(x):
    import threading

    return threading.Lock()


def return_an_object_only_the_workers_can_load(x):
    class OnlyOnTheWorkers:
        def __reduce__(self):
            return (_cannot_load, ("No module named 'only_on_the_workers'",))

    return OnlyOnTheWorkers()


@pytest.mark.parametrize(
    "fn, text",
    [
        (return_a_lock, r"the fetched value of type lock cannot be pickled"),
        (return_an_object_only_the_workers_can_load,
         r"the fetched value of type .*OnlyOnTheWorkers could not be unpickled on the controller: "
         r"ModuleNotFoundError: No module named 'only_on_the_workers'"),
    ],
)
def test_fetched_value_that_cannot_travel_fails_only_that_fetch(mesh1, client1, worker_pids, fn, text):
    with mesh1.activate():
        x = dm.remote(make_values)(3)
    y = dm.remote(fn, propagate=lambda x: torch.empty(3))(x)
    with pytest.raises(dm.RemoteException, match=text):
        dm.fetch_shard(y).result(timeout=TIMEOUT)
    assert torch.equal(dm.fetch_shard(x).result(timeout=TIMEOUT), make_values(3))


def test_attach_that_fails_late_leaves_nothing_behind(client1, monkeypatch):
    """attach() failing after the session was set up (here: building the mesh object) stops the session's
    flusher thread on the controller and ends the session on the workers and the scheduler."""
    import sys
    import threading

    attach_module = sys.modules["dask_monarch.controller.attach"]

    def broken_mesh(*args, **kwargs):
        raise RuntimeError("mesh construction failed")

    def flusher_threads():
        return {t.name for t in threading.enumerate()
                if t.name.startswith("monarch-") and t.name.endswith("-flush") and t.is_alive()}

    before, flushers_before = scheduler_sessions(client1), flusher_threads()
    monkeypatch.setattr(attach_module, "DeviceMesh", broken_mesh)
    with pytest.raises(RuntimeError, match="mesh construction failed"):
        dm.attach(client1, dims={"workers": 1}, comm_timeout=60)
    monkeypatch.undo()
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        flushers = sorted(flusher_threads() - flushers_before)
        held = client1.run(lambda dask_worker: sorted(dask_worker.plugins["dask-monarch"].sessions))
        if not flushers and not any(held.values()):
            break
        time.sleep(0.1)
    assert flushers == [] and not any(held.values()), (flushers, held)
    assert scheduler_sessions(client1) == before
