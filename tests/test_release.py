"""A session's end gives back at once what it held on every worker, without Python's cyclic garbage collector
(DESIGN.md "Decisions": a session's end releases its memory, threads, sockets and process groups at once),
whether it ends by ``exit()``, by its controller's death or by a failure; and with a stopped peer the survivors'
process groups are aborted, so teardown never waits on it (issue 12). Workers are ``dask worker`` processes.

The figures of docs/benchmarks.md ("Reliability") come from these cases, run as scripts (bench/reliability.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from distributed import Client

import dask_monarch as dm
from conftest import _cli_cluster, wait_until
from processes import sigstop

MIB = 2**20
PER_RANK = 100 * MIB  # each session's tensor, per rank (its reduce's result is as large again)
RSS_MARGIN = 64 * MIB  # well below one session's 200 MiB per rank
THREAD_MARGIN = 2
FD_MARGIN = 4


def _usage_probe():
    """A function for ``Client.run`` that reports a worker's resources (defined here, so that it travels by value:
    the ``dask worker`` processes cannot import this test module)."""

    def usage(dask_worker):
        import gc
        import threading

        import psutil
        from torch.distributed import distributed_c10d as c10d

        me = psutil.Process()
        plugin = dask_worker.plugins.get("dask-monarch")
        alive = sum(1 for o in gc.get_objects() if type(o).__name__ in ("TensorWorker", "StreamWorker", "Comms"))
        return {
            "rss": me.memory_info().rss,
            "threads": me.num_threads(),
            "fds": me.num_fds(),
            "sessions": len(plugin.sessions) if plugin is not None else 0,
            "monarch_threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("monarch-")),
            "alive": alive,
            # process groups of sessions still registered with torch.distributed (to_mesh, process_group)
            "torch_groups": sum(1 for name in c10d._world.pg_names.values() if name.startswith("monarch/")),
        }

    return usage


def _set_gc_probe(enabled: bool):
    def set_gc(dask_worker):
        import gc

        gc.enable() if enabled else gc.disable()
        return gc.isenabled()

    return set_gc


def usage(client) -> dict:
    return client.run(_usage_probe())



def settled(client) -> dict:
    """The workers' usage once no session is left on them, nor any of its objects (bounded)."""
    state = {}

    def idle():  # the last task of a session (its exit) may still hold the tensor worker for a moment
        state.update(usage(client))
        return all(u["sessions"] == 0 and not u["monarch_threads"] and u["alive"] == 0 for u in state.values())

    assert wait_until(idle, 60), {a: {k: u[k] for k in ("sessions", "monarch_threads", "alive", "threads", "fds")}
                                  for a, u in state.items()}
    return state


def assert_back_to(baseline: dict, now: dict, what: str) -> None:
    for address, base in baseline.items():
        u = now[address]
        assert u["rss"] - base["rss"] < RSS_MARGIN, (what, address, base, u)
        assert u["threads"] - base["threads"] <= THREAD_MARGIN, (what, address, base, u)
        assert u["fds"] - base["fds"] <= FD_MARGIN, (what, address, base, u)
        assert u["alive"] == 0, (what, address, u["alive"], u)  # no tensor worker, stream or comms object left
        assert u["torch_groups"] == 0, (what, address, u["torch_groups"], u)


def one_session(client) -> None:
    with dm.attach(client, dims={"dp": 2}, comm_timeout=60) as mesh:
        with mesh.activate():
            x = torch.ones(PER_RANK // 4)  # float32
            total = x.reduce("dp", "sum")
            assert dm.inspect(total[:2]).tolist() == [2.0, 2.0]


@pytest.fixture(scope="module")
def cli_cluster(tmp_path_factory):
    """One ``dask scheduler`` and two ``dask worker`` processes for this module (no test kills a worker)."""
    for address, _ in _cli_cluster(tmp_path_factory.mktemp("cli")):
        yield address


@pytest.fixture
def cli_client(cli_cluster):
    client = Client(cli_cluster, set_as_default=False)
    client.wait_for_workers(2, timeout=60)
    client.run(_set_gc_probe(False))  # nothing below may rely on the cyclic collector
    try:
        yield client
    finally:
        try:
            client.run(_set_gc_probe(True))
        finally:
            client.close()


def _tcp_sockets(process) -> int:
    return len(process.net_connections(kind="tcp") if hasattr(process, "net_connections")
               else process.connections(kind="tcp"))


def test_thirty_sessions_leave_worker_memory_threads_and_fds_at_the_baseline(cli_client):
    """... and on the controller: its threads of those sessions (flusher, answers, answer sockets' readers), its
    file descriptors and TCP sockets (the answer sockets, ``controller/sockets.py``) are back at the baseline."""
    import psutil

    client = cli_client
    me = psutil.Process()
    controller_threads = {t.name for t in threading.enumerate()}
    one_session(client)
    baseline = settled(client)
    controller_fds, controller_sockets = me.num_fds(), _tcp_sockets(me)
    for _ in range(29):
        one_session(client)
    assert_back_to(baseline, settled(client), "after 30 sessions")
    assert wait_until(lambda: not [t for t in threading.enumerate()
                                   if t.name.startswith("monarch-") and t.name not in controller_threads], 30)
    assert me.num_fds() - controller_fds <= FD_MARGIN, (controller_fds, me.num_fds())
    assert _tcp_sockets(me) - controller_sockets <= FD_MARGIN, (controller_sockets, _tcp_sockets(me))


CONTROLLER = """
import os, signal, sys, time, torch, dask_monarch as dm
mesh = dm.attach({address!r}, dims={{"dp": 2}}, comm_timeout=60)
with mesh.activate():
    x = torch.ones({elements})
    total = x.reduce("dp", "sum")
    assert dm.inspect(total[:2]).tolist() == [2.0, 2.0]
    y = x * 2  # queued behind the fetch: the controller dies with work in flight
print("ready", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_controller_killed_mid_session_leaves_nothing_on_the_workers(cli_client, cli_cluster):
    client = cli_client
    script = textwrap.dedent(CONTROLLER.format(address=cli_cluster, elements=PER_RANK // 4))

    def killed_controller():
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
        assert out.returncode == -signal.SIGKILL and out.stdout.split() == ["ready"], out.stderr[-3000:]

    killed_controller()
    baseline = settled(client)
    for _ in range(3):
        killed_controller()
    assert_back_to(baseline, settled(client), "after 4 controllers were killed")
    assert client.sync(client.scheduler.monarch_sessions) == {}


BUSY_CONTROLLER = """
import os, signal, time, torch, dask_monarch as dm
mesh = dm.attach({address!r}, dims={{"dp": 2}}, comm_timeout=60)
with mesh.activate():
    x = torch.ones({elements})
    assert dm.inspect(x[:2]).tolist() == [1.0, 1.0]
    small = torch.ones(4)
    busy = dm.remote(lambda t: (time.sleep({seconds}), t + 1)[1], propagate=lambda t: torch.empty_like(t))(small)
time.sleep(1.0)  # the batch with the sleeping call reaches the workers
print("ready", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_controller_killed_while_a_rank_runs_a_function_frees_the_rank_tensors_at_once(cli_client, cli_cluster):
    """The session's tensors are let go when the session ends on the worker (its controller died), not when a user
    function still running there returns: only what that function holds stays until then."""
    client = cli_client
    baseline = settled(client)
    seconds = 45
    script = textwrap.dedent(BUSY_CONTROLLER.format(address=cli_cluster, elements=PER_RANK // 4, seconds=seconds))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert out.returncode == -signal.SIGKILL and out.stdout.split() == ["ready"], out.stderr[-3000:]
    killed = time.monotonic()
    state = {}

    def freed():
        state.update(usage(client))
        return all(u["rss"] - baseline[a]["rss"] < RSS_MARGIN for a, u in state.items())

    assert wait_until(freed, 40), {a: (u["rss"] - baseline[a]["rss"]) // MIB for a, u in state.items()}
    still_running = [u["monarch_threads"] for u in state.values()]
    assert time.monotonic() - killed < seconds - 5, "the check ran after the function returned: it proves nothing"
    assert all(any("stream" in name for name in names) for names in still_running), still_running
    settled(client)  # the function returns and the stream's thread ends (bounded)


def test_with_a_stopped_peer_the_survivor_aborts_its_groups_and_frees_them_at_once(cli_client):
    """A rank stopped (SIGSTOP) while its peer waits in an all-reduce with it: the session fails at the heartbeat
    bound naming it, and the survivor's process groups are aborted, so within seconds its session threads have
    ended and its gloo threads and sockets are gone, although the collective's timeout (comm_timeout) is
    minutes away and the stopped peer never answers."""
    client = cli_client
    before = usage(client)
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=240, heartbeat_timeout=5)
    x = dm.remote(torch.add)(mesh.rank("dp"), 1)
    assert dm.inspect(x.reduce("dp", "sum")).item() == 3  # the process groups exist
    survivor, victim = mesh.workers[0], mesh.workers[1]
    victim_pid = client.run(os.getpid, workers=[victim])[victim]
    total = dm.remote(lambda t: (time.sleep(2), t + 1)[1], propagate=lambda t: torch.empty_like(t))(x).reduce("dp", "sum")
    future = dm.fetch_shard(total)
    time.sleep(1)  # both ranks are sleeping; rank 0 then enters the all-reduce alone
    sigstop(victim_pid)
    try:
        with pytest.raises(dm.SessionError, match=rf"rank 1 \({victim}\)"):
            future.result(timeout=200)
        failed_at = time.monotonic()
        mesh.exit()  # already reported: quiet

        def survivor_free():
            u = client.run(_usage_probe(), workers=[survivor])[survivor]
            return (u["sessions"] == 0 and not u["monarch_threads"] and u["alive"] == 0
                    and u["threads"] - before[survivor]["threads"] <= THREAD_MARGIN
                    and u["fds"] - before[survivor]["fds"] <= FD_MARGIN)

        assert wait_until(survivor_free, 60), client.run(_usage_probe(), workers=[survivor])
        assert time.monotonic() - failed_at < 30  # seconds, not comm_timeout's 240
    finally:
        os.kill(victim_pid, signal.SIGCONT)
    settled(client)
    with dm.attach(client, dims={"dp": 2}, comm_timeout=60) as mesh2:
        assert dm.inspect(dm.remote(torch.add)(mesh2.rank("dp"), 1).reduce("dp", "sum")).item() == 3


def _all_reduce(x, pg):
    import torch.distributed as dist

    y = x.clone()
    dist.all_reduce(y, group=pg)
    return y


def session_with_sends_and_groups(client) -> None:
    """``to_mesh`` between the ranks (onto another stream: a handoff) and a process group for a remote function."""
    with dm.attach(client, dims={"dp": 2}, comm_timeout=60) as mesh:
        other = dm.Stream("other")
        first, second = mesh.slice(dp=slice(0, 1)), mesh.slice(dp=slice(1, 2))
        with first.activate():
            x = torch.ones(PER_RANK // 4)
        y = x.to_mesh(second, stream=other)
        pg = mesh.process_group("dp")
        with mesh.activate():
            total = dm.remote(_all_reduce)(torch.ones(4), pg)
        with second.activate(), other.activate():
            assert dm.inspect(y[:2]).tolist() == [1.0, 1.0]
        assert dm.inspect(total).tolist() == [2.0] * 4


def test_sessions_with_to_mesh_and_process_groups_leave_nothing_behind(cli_client):
    client = cli_client
    session_with_sends_and_groups(client)
    baseline = settled(client)
    for _ in range(4):
        session_with_sends_and_groups(client)
    assert_back_to(baseline, settled(client), "after 5 sessions with to_mesh and process groups")


def test_with_a_stopped_sender_the_receiver_aborts_its_groups_and_frees_them_at_once(cli_client):
    """A ``to_mesh`` whose sender is stopped (SIGSTOP) before it sends: the session fails at the heartbeat bound
    naming it, and the receiver, waiting in its receive, has its groups aborted and is free within seconds."""
    client = cli_client
    before = usage(client)
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=240, heartbeat_timeout=5)
    receiver, sender = mesh.workers[0], mesh.workers[1]
    first, second = mesh.slice(dp=slice(0, 1)), mesh.slice(dp=slice(1, 2))
    with second.activate():
        warm = torch.ones(4)
    assert dm.inspect(warm.to_mesh(first)).tolist() == [1.0] * 4  # the communicator exists
    sender_pid = client.run(os.getpid, workers=[sender])[sender]
    with second.activate():
        late = dm.remote(lambda: (time.sleep(2), torch.ones(4))[1], propagate=lambda: torch.empty(4))()
    future = dm.fetch_shard(late.to_mesh(first))
    time.sleep(1)  # the sender sleeps; the receiver waits in its receive
    sigstop(sender_pid)
    try:
        with pytest.raises(dm.SessionError, match=rf"rank 1 \({sender}\)"):
            future.result(timeout=200)
        failed_at = time.monotonic()
        mesh.exit()

        def receiver_free():
            u = client.run(_usage_probe(), workers=[receiver])[receiver]
            return (u["sessions"] == 0 and not u["monarch_threads"] and u["alive"] == 0 and u["torch_groups"] == 0
                    and u["threads"] - before[receiver]["threads"] <= THREAD_MARGIN
                    and u["fds"] - before[receiver]["fds"] <= FD_MARGIN)

        assert wait_until(receiver_free, 60), (before[receiver], client.run(_usage_probe(), workers=[receiver]))
        assert time.monotonic() - failed_at < 30  # seconds, not comm_timeout's 240
    finally:
        os.kill(sender_pid, signal.SIGCONT)
    settled(client)
