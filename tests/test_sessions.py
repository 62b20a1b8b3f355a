"""Sessions on a shared cluster: message order over many out-of-order Dask tasks (spec/dask-notes.md §0,
§6 #16), isolation between two controllers, and attaching to a cluster started with the ``dask scheduler`` /
``dask worker`` command lines."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import dask
import pytest
import torch

import dask_monarch as dm
from conftest import wait_until
from dask_monarch.protocol import ArgsKwargs, CallFunction, FunctionPath
from dask_monarch.controller.session import DEFAULT_STREAM

TIMEOUT = 60


def test_ten_thousand_messages_apply_in_order(client1):
    """10,000 order-sensitive in-place ops, sent as fast as possible in many small batches (so Dask runs the
    pinned tasks out of order), are applied exactly in the order sent."""
    mesh = dm.attach(client1, dims={"workers": 1}, comm_timeout=60, max_batch=64)
    try:
        with mesh.activate():
            h = dm.remote(torch.zeros)(1, dtype=torch.int64)
        session = mesh._session
        mul = FunctionPath("torch.ops.aten.mul_.Scalar")
        add = FunctionPath("torch.ops.aten.add_.Scalar")
        expected = torch.zeros(1, dtype=torch.int64)
        for i in range(10_000):
            if i % 2 == 0:
                fn, arg = mul, 31
                expected.mul_(31)
            else:
                fn, arg = add, i
                expected.add_(i)
            session.send(
                CallFunction(session.new_seq(), [None], [h.ref], fn, ArgsKwargs((h, arg), {}), DEFAULT_STREAM, [])
            )
        assert session._batch_seq[0] > 100  # many tasks, so Dask had the chance to reorder them
        assert torch.equal(dm.fetch_shard(h).result(timeout=TIMEOUT), expected)
    finally:
        mesh.exit()


def fill(value):
    return torch.full((4,), float(value))


def test_two_sessions_are_isolated(client2):
    a = dm.attach(client2, dims={"workers": 2}, comm_timeout=60)
    b = dm.attach(client2, dims={"workers": 2}, comm_timeout=60)
    try:
        with a.activate():
            xa = dm.remote(fill)(1)
        with b.activate():
            xb = dm.remote(fill)(2)
        assert xa.ref == xb.ref  # the same ref id in both sessions names different values
        assert torch.equal(dm.inspect(xa), torch.full((4,), 1.0))
        assert torch.equal(dm.inspect(xb, workers=1), torch.full((4,), 2.0))
        # a fatal error in session b does not touch session a
        b._session.send(CallFunction(b._session.new_seq(), [None], [], FunctionPath("__test_panic"),
                                     ArgsKwargs(), DEFAULT_STREAM, []))
        with pytest.raises(dm.SessionError, match="__test_panic"):
            dm.fetch_shard(xb).result(timeout=TIMEOUT)
        sa = xa.reduce("workers", "sum")
        assert torch.equal(dm.fetch_shard(sa, workers=1).result(timeout=TIMEOUT), torch.full((4,), 2.0))
    finally:
        a.exit()
        b.exit()  # the failure was already raised by the fetch: exit only cleans up


def test_attach_sees_every_worker_while_the_client_refreshes_its_cached_identity(client2):
    # the Client's periodic identity update (totals only) can overwrite client.scheduler_info()'s fresh answer
    # before it returns: a 4-worker attach once failed with "the cluster has no workers" right after
    # wait_for_workers(4). A 2 ms update interval makes that race frequent (about 1 call in 20 here).
    from distributed import Client

    from dask_monarch.cluster import cluster_workers

    with dask.config.set({"distributed.client.scheduler-info-interval": "2ms"}):
        with Client(client2.scheduler.address, set_as_default=False) as client:
            counts = [len(cluster_workers(client)) for _ in range(300)]
            assert counts == [2] * 300
            for _ in range(3):
                mesh = dm.attach(client, dims={"workers": 2}, comm_timeout=60)
                try:
                    assert sorted(mesh.workers.values()) == sorted(cluster_workers(client))
                finally:
                    mesh.exit()


def test_a_session_whose_client_was_closed_fails_naming_the_client(client2):
    from distributed import Client

    client = Client(client2.scheduler.address, set_as_default=False)
    mesh = dm.attach(client, dims={"workers": 2}, comm_timeout=60)
    with mesh.activate():
        x = torch.ones(2) * 3
    assert dm.inspect(x).tolist() == [3.0, 3.0]
    client.close()
    with pytest.raises(dm.SessionError, match=rf"{client.id}\)? (was closed|disconnected)"):
        with mesh.activate():
            y = x + 1
        dm.inspect(y)
    mesh.exit()  # already reported: quiet
    with dm.attach(client2, dims={"workers": 2}, comm_timeout=60) as again:  # the workers are fine
        assert dm.inspect(dm.remote(torch.add)(again.rank("workers"), 1), workers=1).item() == 2


def test_two_sessions_from_two_threads(client2):
    results = {}

    def run(value):
        with dm.attach(client2, dims={"workers": 2}, comm_timeout=60) as mesh:
            with mesh.activate():
                x = dm.remote(fill)(value)
            results[value] = dm.fetch_shard(x.reduce("workers", "sum"), workers=1).result(timeout=TIMEOUT)

    threads = [threading.Thread(target=run, args=(v,)) for v in (3, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert torch.equal(results[3], torch.full((4,), 6.0))
    assert torch.equal(results[5], torch.full((4,), 10.0))


def test_attach_to_command_line_cluster(cli_cluster):
    with dm.attach(cli_cluster, dims={"dp": 2}, comm_timeout=60, timeout=90) as mesh:
        assert sorted(mesh.workers.values()) == list(mesh.workers.values())  # ranks sorted by host, then port
        x = dm.remote(torch.add)(mesh.rank("dp"), 1)
        s = x.reduce("dp", "sum")
        assert dm.fetch_shard(s, dp=1).result(timeout=TIMEOUT).item() == 3  # (0 + 1) + (1 + 1)


def test_attach_to_a_cold_command_line_cluster_installs_both_plugins_and_times_each_step(cli_cluster):
    """attach registers the worker plugin and the scheduler plugin at once (the workers' imports overlap the
    scheduler's): both are installed on fresh ``dask worker`` processes, and ``Session.attach_phases`` gives each
    step's seconds, in order."""
    from distributed import Client

    from dask_monarch.scheduler.plugin import PLUGIN_NAME as SCHEDULER_PLUGIN
    from dask_monarch.worker.plugin import PLUGIN_NAME as WORKER_PLUGIN

    with Client(cli_cluster, set_as_default=False) as client:
        with dm.attach(client, dims={"dp": 2}, comm_timeout=60, timeout=90) as mesh:
            phases = mesh._session.attach_phases
            assert list(phases)[:3] == ["cluster", "plugins", "workers"]
            assert {"session open", "pin workers", "session state", "channels"} <= set(phases)
            assert all(isinstance(v, float) and v >= 0 for v in phases.values()), phases
            assert SCHEDULER_PLUGIN in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))
            installed = client.run(lambda dask_worker: WORKER_PLUGIN in dask_worker.plugins)
            assert sorted(installed) == sorted(mesh.workers.values()) and all(installed.values()), installed
            assert dm.fetch_shard(mesh.rank("dp") + 1, dp=1).result(timeout=TIMEOUT).item() == 2


def make_filled(n, value):
    return torch.full((n,), float(value))


def test_answers_of_a_rank_apply_in_order_when_their_tasks_finish_out_of_order(client1):
    """Two fetches in flight: Dask may hand the controller the second status task's answers (Status past both
    fetches) before the first's (the first fetch's FetchResult), e.g. when several threads fetch at once. The
    first fetch must still get its value, not 'answered Status but no FetchResult' (spec §3: a future resolves
    once every rank's answers up to its Status are in). Through tasks alone (answer_channel=False)."""
    mesh = dm.attach(client1, dims={"workers": 1}, comm_timeout=60, answer_channel=False)
    try:
        session = mesh._session
        with mesh.activate():
            a = dm.remote(make_filled)(3, 1)
            b = dm.remote(make_filled)(4, 2)
        real = session._on_sync_done
        held = []

        def first_one_late(fut):
            if not held and not getattr(first_one_late, "done", False):
                held.append(fut)  # the first status task's answers are delivered after the second's
                return
            first_one_late.done = True
            real(fut)
            while held:
                real(held.pop())

        session._on_sync_done = first_one_late
        fa = dm.fetch_shard(a)
        deadline = time.monotonic() + TIMEOUT
        while not held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held, "the first status task did not finish"
        fb = dm.fetch_shard(b)
        assert torch.equal(fb.result(timeout=TIMEOUT), torch.full((4,), 2.0))
        assert torch.equal(fa.result(timeout=TIMEOUT), torch.full((3,), 1.0))
    finally:
        mesh.exit()


def test_five_threads_attach_compute_and_exit_while_others_fail(client2):
    """Five controllers on one cluster, in threads, two rounds each: a fatal error in one session and a value
    error in another change nothing for the others, and every session is gone from the workers afterwards."""
    results, errors = {}, []

    def run(i):
        try:
            for k in range(2):
                with dm.attach(client2, dims={"workers": 2}, comm_timeout=60) as mesh:
                    with mesh.activate():
                        x = dm.remote(fill)(i)
                    if i == 0 and k == 1:  # a fatal error: this session ends, its exit reports nothing new
                        s = mesh._session
                        s.send(CallFunction(s.new_seq(), [None], [], FunctionPath("__test_panic"), ArgsKwargs(),
                                            DEFAULT_STREAM, []))
                        with pytest.raises(dm.SessionError, match="__test_panic"):
                            dm.fetch_shard(x).result(timeout=TIMEOUT)
                        continue
                    if i == 1 and k == 0:  # a value error: the session goes on
                        bad = dm.remote("no_such_module.f", propagate=lambda x: torch.empty(4))(x)
                        with pytest.raises(dm.RemoteException, match="failed to resolve function"):
                            dm.fetch_shard(bad).result(timeout=TIMEOUT)
                    total = dm.fetch_shard(x.reduce("workers", "sum"), workers=1).result(timeout=TIMEOUT)
                    results[(i, k)] = total
        except BaseException as e:  # reported below, with the thread
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert {key: value[0].item() for key, value in results.items()} == {
        (i, k): 2.0 * i for i in range(5) for k in range(2) if (i, k) != (0, 1)
    }
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        held = client2.run(lambda dask_worker: sorted(dask_worker.plugins["dask-monarch"].sessions))
        if not any(held.values()):
            break
        time.sleep(0.2)
    assert not any(held.values()), held


def test_exit_from_several_threads_at_once_is_quiet(client2):
    """An atexit hook and a with-block, say, both calling mesh.exit(): one exit drains and ends the session,
    the others wait for it; nobody gets an error."""
    for _ in range(3):
        mesh = dm.attach(client2, dims={"workers": 2}, comm_timeout=60)
        with mesh.activate():
            x = dm.remote(fill)(1)
        assert torch.equal(dm.inspect(x), torch.full((4,), 1.0))
        outcomes = []

        def exit_mesh():
            try:
                mesh.exit()
                outcomes.append("ok")
            except BaseException as e:  # reported by the assertion below
                outcomes.append(repr(e))

        threads = [threading.Thread(target=exit_mesh) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert outcomes == ["ok"] * 3


def test_tensors_and_meshes_used_after_exit_raise_session_closed(client1):
    mesh = dm.attach(client1, dims={"workers": 1}, comm_timeout=60)
    with mesh.activate():
        x = dm.remote(fill)(1)
    sub = mesh.slice(workers=0)
    mesh.exit()
    for use in (
        lambda: dm.fetch_shard(x),
        lambda: dm.remote(torch.add)(x, 1),
        lambda: x.reduce("workers"),
        lambda: mesh.rank("workers"),
        lambda: dm.remote(fill)(sub),
    ):
        with pytest.raises(dm.SessionError, match=r"is closed \(mesh.exit\(\) was called\)"):
            use()
    mesh.exit()  # a second exit is a no-op


def test_a_session_s_end_drops_its_event_handler_and_nothing_keeps_the_session_alive(client1):
    """``Client.unsubscribe_topic`` keeps the handler in the Client (distributed 2026.8.0): each session's
    debugger handler kept the whole session (channels, answers, history, cached plans) for the Client's life,
    about 0.4 MB of controller memory per session. After ``mesh.exit()`` no handler of the Client reaches it, and
    no thread of the session runs on (its answers thread, waking from a gather, held it for up to 0.5 s)."""
    before = set(client1._event_handlers)
    mesh = dm.attach(client1, dims={"workers": 1}, comm_timeout=60)
    session = mesh._session
    topic = session.debugger.topic
    assert client1._event_handlers[topic] == session.debugger._on_event
    with mesh.activate():
        x = torch.ones(3) + mesh.rank("workers")
        assert dm.fetch_shard(x, workers=0).result(timeout=TIMEOUT).tolist() == [1.0, 1.0, 1.0]
    mesh.exit()
    ended = {t: h for t, h in client1._event_handlers.items() if t not in before}
    assert topic in ended  # a no-op, for an event still in flight (Dask's _handle_event unsubscribes once more)
    assert all(getattr(h, "__self__", None) is None for h in ended.values()), ended  # no bound method of the session
    gone = weakref.ref(session)
    assert not any(t.name.startswith(f"monarch-{session.tag}-") for t in threading.enumerate())
    del mesh, session, x, ended
    gc.collect()
    assert gone() is None, [type(r).__qualname__ for r in gc.get_referrers(gone())]


def test_interpreter_settings_are_held_while_sessions_run_and_restored_after(client2):
    """While sessions run, the worker plugin raises gen-0 of Python's GC threshold to ``monarch.gc-threshold``
    (20,000) and lowers the GIL switch interval to ``monarch.switch-interval`` (0.5 ms), and puts Python's values
    back when the last session ends (``interpreter.py``); the controller holds the switch interval too."""
    import gc
    import sys

    def settings():
        return gc.get_threshold()[0], sys.getswitchinterval()

    def wait_for(expected):
        deadline = time.monotonic() + 30
        while set(client2.run(settings).values()) != {expected} and time.monotonic() < deadline:
            time.sleep(0.1)
        return set(client2.run(settings).values())

    pythons = (700, 0.005)
    assert wait_for(pythons) == {pythons}  # Python's defaults, once earlier tests' sessions have ended there
    first = dm.attach(client2, dims={"dp": 2}, comm_timeout=60)
    second = dm.attach(client2, dims={"dp": 2}, comm_timeout=60)
    for mesh in (first, second):
        with mesh.activate():
            assert dm.inspect(torch.ones(1) + mesh.rank("dp")).tolist() == [1.0]  # the session runs on the workers
    ours = (20_000, 0.0005)
    assert set(client2.run(settings).values()) == {ours}
    assert sys.getswitchinterval() == 0.0005  # in this controller process too
    first.exit()
    assert set(client2.run(settings).values()) == {ours}  # a session still runs
    second.exit()
    assert wait_for(pythons) == {pythons}


def test_bad_interpreter_config_on_a_worker_fails_the_session_naming_it_and_changes_nothing(client1):
    """A worker whose Dask config ``monarch.gc-threshold`` is not a number: the session fails with an error naming
    the setting, and the worker keeps Python's interpreter settings and no thread of the session."""
    import sys

    def set_config(value, dask_worker):
        dask.config.set({"monarch.gc-threshold": value})

    def state(session_id, dask_worker):
        import gc

        names = [t.name for t in threading.enumerate() if t.name.startswith(f"monarch-{session_id[:8]}-")]
        return gc.get_threshold()[0], sys.getswitchinterval(), tuple(names)

    deadline = time.monotonic() + 30
    while set(client1.run(state, "-").values()) != {(700, 0.005, ())} and time.monotonic() < deadline:
        time.sleep(0.1)  # earlier tests' sessions end on the worker
    client1.run(set_config, "20k")
    try:
        mesh = dm.attach(client1, dims={"workers": 1}, comm_timeout=60)
        with pytest.raises(dm.SessionError, match=r"monarch\.gc-threshold.*'20k'"):
            with mesh.activate():
                dm.inspect(torch.ones(1))
        mesh.exit()  # the failure was raised already
        assert set(client1.run(state, mesh._session.id).values()) == {(700, 0.005, ())}
    finally:
        client1.run(set_config, None)
    with dm.attach(client1, dims={"workers": 1}, comm_timeout=60) as mesh:  # the worker still serves
        with mesh.activate():
            assert dm.inspect(torch.ones(1) + 1).tolist() == [2.0]


def _no_session_holds_the_settings(timeout: float = 30.0) -> None:
    """Wait, at most ``timeout`` seconds, until no session in this process holds the interpreter settings
    (``interpreter._holders``): an earlier test's session gives them back in ``Session.stop``, which may still be
    running when that test has returned. Fails naming the sessions that still hold them."""
    import gc

    from dask_monarch import interpreter
    from dask_monarch.controller.session import Session

    if wait_until(lambda: not any(interpreter._holders.values()), timeout, 0.05):
        return
    holders = [s for s in gc.get_objects() if isinstance(s, Session) and not s._released]
    pytest.fail(f"the interpreter settings are still held after {timeout:g} s ({interpreter._holders}) by: "
                + "; ".join(f"session {s.tag} (closed={s.closed}, failure={s.failure!r})" for s in holders))


def test_interpreter_hold_and_release_count_holders():
    import gc
    import sys

    from dask_monarch import interpreter

    _no_session_holds_the_settings()
    before = (sys.getswitchinterval(), gc.get_threshold())
    interpreter.hold(gc_threshold=True)
    interpreter.hold()
    assert sys.getswitchinterval() == interpreter.SWITCH_INTERVAL
    assert gc.get_threshold()[0] == interpreter.GC_THRESHOLD
    interpreter.release(gc_threshold=True)  # the GC threshold had one holder; the switch interval still has one
    assert gc.get_threshold() == before[1]
    assert sys.getswitchinterval() == interpreter.SWITCH_INTERVAL
    interpreter.release()
    assert (sys.getswitchinterval(), gc.get_threshold()) == before
    with dask.config.set({"monarch.switch-interval": 0}):  # 0 leaves Python's value alone
        interpreter.hold()
        assert sys.getswitchinterval() == before[0]
        interpreter.release()


def _controller_gc_holders() -> int:
    from dask_monarch import interpreter

    return interpreter._holders["gc"]


def test_the_controller_holds_the_gc_threshold_while_a_session_runs_and_restores_it_at_its_end(client1):
    """Gen-0 of the controller's GC threshold is Dask config ``monarch.gc-threshold`` (20,000) while a session runs
    (each op makes a few tracked objects: at Python's 700 a gen-0 collection ran every few dozen ops), and Python's
    value again once it ends (``Session.stop``; ``interpreter.py``)."""
    import gc

    from dask_monarch import interpreter

    _no_session_holds_the_settings()
    before = gc.get_threshold()
    with dm.attach(client1, dims={"workers": 1}, comm_timeout=60) as mesh:
        assert gc.get_threshold() == (interpreter.GC_THRESHOLD, *before[1:])
        with mesh.activate():
            assert dm.inspect(torch.ones(2) + 1).tolist() == [2.0, 2.0]
    assert gc.get_threshold() == before and _controller_gc_holders() == 0


def test_the_gc_threshold_is_restored_when_the_session_fails(client1):
    """A session that fails (here: its worker's Dask config ``monarch.gc-threshold`` is not a number, so the session
    fails there) gives the controller's GC threshold back at its end all the same."""
    import gc

    from dask_monarch import interpreter

    def set_config(value, dask_worker):
        dask.config.set({"monarch.gc-threshold": value})

    _no_session_holds_the_settings()
    before = gc.get_threshold()
    client1.run(set_config, "20k")
    try:
        mesh = dm.attach(client1, dims={"workers": 1}, comm_timeout=60)
        assert gc.get_threshold()[0] == interpreter.GC_THRESHOLD
        with pytest.raises(dm.SessionError, match=r"monarch\.gc-threshold"):
            with mesh.activate():
                dm.inspect(torch.ones(1))
        mesh.exit()
    finally:
        client1.run(set_config, None)
    assert gc.get_threshold() == before and _controller_gc_holders() == 0


def test_a_bad_controller_gc_threshold_fails_attach_naming_it_and_changes_nothing(client1):
    """The controller's Dask config ``monarch.gc-threshold`` not a number: ``attach`` raises ``ValueError`` naming the
    key and the value, and the controller's GC threshold and switch interval stay Python's."""
    import gc
    import sys

    _no_session_holds_the_settings()
    before = (gc.get_threshold(), sys.getswitchinterval())
    with dask.config.set({"monarch.gc-threshold": "lots"}):
        with pytest.raises(ValueError, match=r"monarch\.gc-threshold.*'lots'"):
            dm.attach(client1, dims={"workers": 1}, comm_timeout=60)
    assert (gc.get_threshold(), sys.getswitchinterval()) == before and _controller_gc_holders() == 0
    with dm.attach(client1, dims={"workers": 1}, comm_timeout=60) as mesh:  # the next session runs
        with mesh.activate():
            assert dm.inspect(torch.ones(1) + 1).tolist() == [2.0]


def _all_reduce(x, pg):
    import torch.distributed as dist

    y = x.clone()
    dist.all_reduce(y, group=pg)
    return y


def test_two_sessions_make_use_and_drop_process_groups_on_the_same_workers(client2):
    """Two sessions on the same two workers each make a process group, all-reduce through it and drop it at once,
    many times over and at the same time: every all-reduce of each session counts both of its ranks, none fails
    (one session's groups, their rendezvous keys, gloo ports and releases never touch the other's). A rank handed
    ``NON_GROUP_MEMBER`` for a group it is in (the race ``test_process_group.py``'s
    ``test_a_call_looking_its_group_up_during_the_groups_delete_always_finds_it`` pins down) would show here as a
    value missing its peer's part or as "Connection closed by peer" on the peer."""
    rounds = 20
    results, errors = {}, []

    def run(base):
        try:
            with dm.attach(client2, dims={"workers": 2}, comm_timeout=60) as mesh:
                with mesh.activate():
                    x = dm.remote(fill)(mesh.rank("workers") + base)
                    outs = []
                    for _ in range(rounds):
                        pg = mesh.process_group("workers")
                        outs.append(dm.remote(_all_reduce)(x, pg))
                        mesh._session.flush()  # the call in one batch, its group's DeleteRefs in the next
                        del pg
                        gc.collect()  # the group's handle dies now (a cycle may hold it)
                        mesh._session.flush()
                results[base] = [dm.fetch_shard(o, workers=i % 2).result(timeout=TIMEOUT) for i, o in enumerate(outs)]
        except Exception as e:  # reported by the test's thread below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(base,)) for base in (10, 100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not errors, errors
    for base in (10, 100):
        assert [float(r[0]) for r in results[base]] == [2.0 * base + 1] * rounds, (base, results[base])
