"""Actors with mesh tensors (issue 17; spec §2 ``SendResultOfActorCall``/``CallActorMethod``, §3, §9
test_tensor_engine.py): ``mesh.spawn`` makes one Dask actor per rank; endpoint calls run on each rank's stream in
order with the tensor messages around them, with each rank's local tensors. Real ``LocalCluster`` workers, gloo."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from distributed import Client, LocalCluster

import dask_monarch as dm

TIMEOUT = 120


@pytest.fixture
def mesh(client2):
    m = dm.attach(client2, dims={"dp": 2}, comm_timeout=60, record_answers=True)
    yield m
    if not m._session.closed:
        try:
            m.exit()
        except Exception:
            pass


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def actors_on_workers(client):
    return client.run(lambda dask_worker: sorted(dask_worker.state.actors))


# ------------------------------------------------------------------------------------------------- actor classes
class AddWithState:
    def __init__(self, state: torch.Tensor):
        self.state = state

    def forward(self, x):
        return x + self.state


class Counter:
    def __init__(self):
        self.c = 0

    def incr(self, x):
        self.c += 1
        return self.c - 1


class Linear:
    def __init__(self, n: int, m: int):
        self.weight = torch.zeros((n, m))

    def forward(self, x):
        return x @ self.weight

    @dm.endpoint(propagate="inspect")
    def update(self, w):
        self.weight += w


class Log:
    """Remembers the values it was given, and bumps tensors in place."""

    def __init__(self):
        self.seen = []

    def push(self, x):
        self.seen.append(float(x))

    def history(self):
        return self.seen

    @dm.endpoint(mutates=("x",))
    def bump(self, x):
        x.add_(100)

    @dm.endpoint(propagate=lambda x: torch.empty_like(x))
    def doubled(self, x):
        return 2 * x

    def where(self, mesh):
        return mesh.dims["dp"].rank


class Faulty:
    def boom(self, x):
        raise ValueError("boom from the actor")

    @dm.endpoint(propagate=lambda x: torch.empty_like(x), mutates=(0,))
    def boom_mutating(self, x):
        x.add_(1)
        raise ValueError("boom after writing")

    def fine(self):
        return "fine"

    def wait(self, seconds):
        import time

        time.sleep(seconds)
        return seconds


# -------------------------------------------------------------------------------- spec §9 test_tensor_engine.py
def test_tensor_engine(mesh):
    """§9 tensor_engine: values fetched from the mesh and a flattened mesh; a raising remote function raises
    ``RemoteException`` at the fetch."""
    with mesh.activate():
        r = dm.inspect(2 * torch.zeros(3, 4))
    flat = mesh.flatten("all")
    with flat.activate():
        f = dm.inspect(2 * torch.zeros(3, 4), all=1)
    assert torch.equal(r, torch.zeros(3, 4)) and torch.equal(f, torch.zeros(3, 4))

    @dm.remote(propagate=lambda x: x)
    def nope(x):
        raise ValueError("nope")

    with pytest.raises(dm.RemoteException, match="nope"):
        with mesh.activate():
            dm.inspect(nope(torch.zeros(3, 4)))


def global_rank(mesh):
    return torch.tensor(mesh.me)


def test_proc_mesh_tensor_engine(mesh):
    """§9 proc_mesh_tensor_engine (0, 10, 100). Monarch moves rank 1's value onto the one-rank sub-mesh with
    ``to_mesh`` (``SendTensor``, another issue); here the sub-mesh computes it from its own rank."""
    with mesh.activate():
        f = 10 * mesh.rank("dp")
        a = dm.inspect(f, dp=0)
        b = dm.inspect(f, dp=1)
    one = mesh.slice(dp=1)
    with one.activate():
        g = 10 * dm.remote(global_rank, propagate=lambda m: torch.empty((), dtype=torch.int64))(one)
        c = dm.inspect(g * 10)
    assert (a.item(), b.item(), c.item()) == (0, 10, 100)


def test_actor_with_tensors(mesh):
    """§9 actor_with_tensors: the method gets each rank's local tensor and its result comes back per rank."""
    adder = mesh.spawn(AddWithState, torch.ones(()))
    with mesh.activate():
        y = torch.ones(()) + mesh.rank("dp")
        assert [v.item() for v in adder.forward.call(y).result(timeout=TIMEOUT).values()] == [2.0, 3.0]
        assert adder.forward.call_one(y, dp=1).result(timeout=TIMEOUT).item() == 3.0


class Picky:
    def __init__(self, x):
        if float(x) > 0.5:
            raise ValueError(f"refusing {float(x)}")


def test_a_constructor_given_mesh_tensors_gets_each_ranks_local_tensor(mesh):
    """Monarch's test_actor_with_tensors, spawned under activate(): the constructor's argument is a mesh tensor, and
    each rank's actor keeps that rank's local tensor, as it was after what was sent before the spawn."""
    with mesh.activate():
        state = torch.zeros(()) + mesh.rank("dp")
        state.add_(1.0)  # sent before the spawn: each constructor sees it
        adder = mesh.spawn("adder", AddWithState, state)  # Monarch's spawn(name, class, *args)
        y = torch.ones(())
        assert [v.item() for v in adder.forward.call(y).get(timeout=TIMEOUT).values()] == [2.0, 3.0]
        state.add_(10.0)  # the actors hold the tensors they were given, updated in place like any alias
        assert adder.forward.call_one(y, dp=1).result(timeout=TIMEOUT).item() == 13.0
        with pytest.raises(RuntimeError, match=r"(?s)Picky\(...\) failed on rank 1 .*refusing 1.0"):
            mesh.spawn(Picky, mesh.rank("dp") * 1.0)


def test_actor_tensor_ordering(mesh):
    """§9 actor_tensor_ordering: calls with and without tensors reach the actor in the order they were made."""
    counter = mesh.spawn(Counter)
    with mesh.activate():
        results = []
        for _ in range(0, 10, 2):
            results.append(counter.incr.call(torch.ones(())))
            results.append(counter.incr.call(1))
        assert [list(r.result(timeout=TIMEOUT).values()) for r in results] == [[i, i] for i in range(10)]


def test_rref_actor(mesh):
    """§9 rref_actor (0, 48): results stay on the mesh as remote tensors of the propagated shapes."""
    linear = mesh.spawn(Linear, 3, 4)
    forward = dm.as_endpoint(linear.forward, propagate=lambda x: torch.empty(4, 4))
    with mesh.activate():
        y = torch.ones((4, 3))
        t = forward.rref(y)
        assert isinstance(t, dm.Tensor) and t.shape == (4, 4)
        assert dm.inspect(t.sum()).item() == 0
        assert linear.update.rref(torch.ones((3, 4))) is None
        t = forward.rref(y)
        assert dm.inspect(t.sum()).item() == 3 * 4 * 4


def test_a_slice_of_the_actors_runs_on_its_ranks_only(mesh):
    """Monarch's ``ActorMesh.slice`` (its docs/source/examples/getting_started.py:
    ``counters.slice(gpus=slice(0, 4)).increment.broadcast()``): a call through a slice reaches its ranks only, in
    order with the others; a one-actor slice answers ``call_one()`` without coordinates; ``stop()`` of a slice
    stops the spawn."""
    counter = mesh.spawn(Counter)
    one = counter.slice(dp=1)
    assert one.incr.call_one(0).result(timeout=TIMEOUT) == 0
    counter.slice(dp=slice(1, 2)).incr.broadcast(0)
    with mesh.activate():
        x = mesh.rank("dp") + torch.zeros(())
        assert list(counter.slice(dp=slice(0, 2)).incr.call(x).result(timeout=TIMEOUT).values()) == [0, 2]
        assert list(one.incr.call(x).result(timeout=TIMEOUT).values()) == [3]
    with pytest.raises(IndexError):
        counter.slice(dp=2)
    one.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        counter.incr.call(0)


# ------------------------------------------------------------------------------------------ ordering, mutation
def test_a_hundred_actor_calls_interleaved_with_tensor_ops_keep_their_order(mesh):
    """Each ``push`` sees the value the ops before it made and none made after; a declared in-place write by
    the actor (``mutates=``) is seen by the ops after it; rref results feed later ops."""
    log = mesh.spawn(Log)
    with mesh.activate():
        x = torch.zeros(()) + 1000 * mesh.rank("dp")
        for i in range(100):
            x.add_(1)
            log.push.broadcast(x)
        log.bump.broadcast(x)  # x += 100 on the worker, in place
        y = log.doubled.rref(x) + 1
        seen = list(log.history.call().result(timeout=TIMEOUT).values())
        assert seen == [[float(i) for i in range(1, 101)], [1000.0 + i for i in range(1, 101)]]
        assert dm.inspect(x, dp=1).item() == 1200.0
        assert dm.inspect(y, dp=1).item() == 2401.0
        assert list(log.where.call(mesh).result(timeout=TIMEOUT).values()) == [0, 1]


def test_the_dask_actor_stays_callable_directly(mesh):
    """The Dask ``Actor`` proxies of an ``ActorMesh`` call the same instances (on Dask's actor thread)."""
    counter = mesh.spawn(Counter)
    assert list(counter.incr.call(0).result(timeout=TIMEOUT).values()) == [0, 0]
    assert counter.actors[1].incr(0).result() == 1
    assert list(counter.incr.call(0).result(timeout=TIMEOUT).values()) == [1, 2]


# ------------------------------------------------------------------------------------------------------ errors
def test_an_actor_method_that_raises_is_one_root_failure_and_the_session_goes_on(mesh):
    faulty = mesh.spawn(Faulty)
    session = mesh._session
    with mesh.activate():
        with pytest.raises(dm.RemoteException, match="boom from the actor") as info:
            faulty.boom.call(torch.ones(())).result(timeout=TIMEOUT)
        seq = info.value.seq
        x = torch.ones(2)
        out = faulty.boom_mutating.rref(x)
        dependent = out * 2 + x  # depends on both the result and the mutated input: silent on the workers
        with pytest.raises(dm.RemoteException, match="boom after writing") as second:
            dm.inspect(dependent)
        with pytest.raises(dm.RemoteException, match="boom after writing"):
            dm.inspect(x)  # the mutated argument carries the failure too
        assert list(faulty.fine.call().result(timeout=TIMEOUT).values()) == ["fine", "fine"]
        fresh = torch.zeros(1)
        assert dm.inspect(fresh + 1).item() == 1.0
    failures = [(rank, m.seq) for rank, m in session.answers if type(m).__name__ == "RemoteFunctionFailed"]
    assert sorted(failures) == sorted([(0, seq), (1, seq), (0, second.value.seq), (1, second.value.seq)])


def test_bad_input_is_refused_at_the_call(mesh):
    with pytest.raises(TypeError, match="expected a class"):
        mesh.spawn(Counter())
    counter = mesh.spawn(Counter)
    with pytest.raises(AttributeError, match="no method 'nope'"):
        counter.nope
    with pytest.raises(TypeError, match="propagate"):
        counter.incr.rref(1)
    with pytest.raises(ValueError, match="give a coordinate for every dimension"):
        counter.incr.call_one(1)
    with pytest.raises(IndexError, match="out of range"):
        counter.incr.call_one(1, dp=2)
    with pytest.raises(TypeError, match="mutates must be"):
        dm.endpoint(mutates="x")
    with pytest.raises(TypeError, match="not a parameter"):
        dm.as_endpoint(counter.incr, mutates=("y",)).broadcast(1)
    assert counter.incr.choose(1).result(timeout=TIMEOUT) == 0
    assert counter.endpoint_of("incr").call_one(1, dp=1).result(timeout=TIMEOUT) == 0


def test_a_stopped_actor_mesh_and_an_ended_session_free_the_dask_actors(client2, mesh):
    counter = mesh.spawn(Counter)
    log = mesh.spawn(Log)
    assert all(len(keys) == 2 for keys in actors_on_workers(client2).values())
    counter.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        counter.incr.call(1)
    assert wait_until(lambda: all(len(keys) == 1 for keys in actors_on_workers(client2).values()), 30)
    assert list(log.history.call().result(timeout=TIMEOUT).values()) == [[], []]
    mesh.exit()
    assert wait_until(lambda: not any(actors_on_workers(client2).values()), 30)


def test_a_call_of_an_actor_missing_on_its_worker_fails_naming_it(client2, mesh):
    """An actor that Dask no longer holds (released behind the mesh's back) is a value error of the call."""
    counter = mesh.spawn(Counter)
    key = counter._base + "-1"
    client2.run(lambda dask_worker: dask_worker.state.actors.pop(key), workers=[mesh.workers[1]])
    with pytest.raises(dm.RemoteException, match=f"actor {key} is not on the Dask worker"):
        counter.incr.call(1).result(timeout=TIMEOUT)


def _pid():
    return os.getpid()


def test_an_actor_on_a_worker_that_dies_fails_the_session_naming_it():
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0", silence_logs=50) as cluster:
        with Client(cluster) as client:
            mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=60)
            faulty = mesh.spawn(Faulty)
            assert list(faulty.fine.call().result(timeout=TIMEOUT).values()) == ["fine", "fine"]
            pending = faulty.wait.call(30)
            victim = mesh.workers[1]
            os.kill(client.run(_pid)[victim], signal.SIGKILL)
            with pytest.raises(dm.SessionError, match=r"rank 1 \(" + victim):
                pending.result(timeout=TIMEOUT)
            with pytest.raises(dm.SessionError):
                faulty.fine.call()
            mesh.exit()  # already reported: exit cleans up without raising


def test_the_example_runs_and_its_policy_learns(client2, tmp_path):
    """``examples/actors_rl.py`` in a subprocess, as a user runs it, shortened, on this module's cluster (its
    embedded-cluster path is train_digits' and the docs' snippets')."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "actors_rl.py"
    proc = subprocess.run([sys.executable, str(example), "--steps", "30", "--scheduler", client2.scheduler.address], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"mean_reward=(-?\d+\.\d+) optimal=(-?\d+\.\d+) random=(-?\d+\.\d+)", last)
    assert match, proc.stdout
    reward, optimal, rand = map(float, match.groups())
    assert reward > rand + 0.8 * (optimal - rand), proc.stdout  # far closer to the best arms than to chance


def test_calls_that_wait_are_refused_inside_coalescing_and_rref_is_held_for_the_block(mesh):
    log = mesh.spawn(Log)
    with mesh.activate():
        x = torch.ones(())
        with dm.coalescing():
            with pytest.raises(RuntimeError):
                log.history.call()
            log.push.broadcast(x)
            y = log.doubled.rref(x)
        assert dm.inspect(y).item() == 2.0
        assert list(log.history.call().result(timeout=TIMEOUT).values()) == [[1.0], [1.0]]


class Broken:
    def __init__(self, why):
        raise ValueError(why)


def test_a_constructor_that_raises_fails_spawn_naming_the_rank(mesh):
    with pytest.raises(RuntimeError, match=r"Broken\(\.\.\.\) failed on rank [01] .*bad config") as info:
        mesh.spawn(Broken, "bad config")
    assert isinstance(info.value.__cause__, ValueError)


def test_an_actor_call_runs_on_the_active_stream_with_that_streams_tensors(mesh):
    side = dm.Stream("side")
    log = mesh.spawn(Log)
    with mesh.activate():
        x = torch.ones(())
        with side.activate():
            y = torch.full((), 5.0) + mesh.rank("dp")
            log.push.broadcast(y)
            z = log.doubled.rref(y)
            assert z.stream is side
            with pytest.raises(TypeError, match="WRONG_STREAM"):
                log.push.broadcast(x)
        with side.activate():  # ordered after the push on the same stream (calls on two streams are not ordered)
            assert list(log.history.call().result(timeout=TIMEOUT).values()) == [[5.0], [6.0]]
            assert dm.inspect(z, dp=1).item() == 12.0


class Keyed:
    def __init__(self, key, workers=None):
        self.key, self.workers = key, workers

    def get(self):
        return (self.key, self.workers)


def test_an_actor_method_traceback_names_the_users_file_and_line(mesh):
    """A class the workers cannot import (a local class here, like one of ``__main__``) travels by value, as remote
    functions do: a method's remote traceback names this file and the line of the ``raise``, not cloudpickle's
    ``<dynamic-code>``."""
    import inspect

    class Local:
        def fail(self):
            raise RuntimeError("raised in the actor's file")  # the line the remote traceback must name

    lines, first = inspect.getsourcelines(Local.fail)
    line = first + next(i for i, text in enumerate(lines) if text.strip().startswith("raise"))
    local = mesh.spawn(Local)
    with pytest.raises(dm.RemoteException) as info:
        local.fail.call().result(timeout=TIMEOUT)
    assert f'File "{__file__}", line {line}, in fail' in info.value.backtrace, info.value.backtrace
    assert "<dynamic-code>" not in info.value.backtrace


def test_constructor_keywords_named_like_client_submits_own_reach_the_constructor(mesh):
    """``key=`` and ``workers=`` are ``Client.submit``'s keywords too; spawn passes them to the class."""
    keyed = mesh.spawn(Keyed, key="mine", workers=3)
    assert list(keyed.get.call().result(timeout=TIMEOUT).values()) == [("mine", 3), ("mine", 3)]


def test_a_class_or_constructor_argument_that_cannot_be_pickled_fails_spawn_naming_it(mesh):
    """Instead of Dask's ``Could not serialize object of type LLGExpr`` (and its logged traceback), spawn raises
    ``TypeError`` naming the class, or the argument that cannot be pickled; nothing is submitted, the mesh goes on."""
    import threading

    class HoldsALock:
        lock = threading.Lock()

    with pytest.raises(TypeError, match=r"spawn: the class .*HoldsALock cannot be pickled .*_thread\.lock"):
        mesh.spawn(HoldsALock)
    with pytest.raises(TypeError, match=r"spawn: Keyed's constructor keyword 'workers' \(a lock\) cannot be pickled"):
        mesh.spawn(Keyed, "mine", workers=threading.Lock())
    with pytest.raises(TypeError, match=r"spawn: Keyed's constructor argument 0 \(a lock\) cannot be pickled"):
        mesh.spawn(Keyed, threading.Lock())
    after = mesh.spawn(Keyed, key="after").get.call().result(timeout=TIMEOUT)
    assert list(after.values()) == [("after", None), ("after", None)]
