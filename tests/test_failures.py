"""Failures never turn into hangs (DESIGN.md "Decisions"; spec/dask-notes.md §5.4, §6 #1, #4): a killed worker
fails the session within seconds naming the rank, the surviving workers keep serving, and a controller that
disappears without ``mesh.exit()`` leaves nothing running on the workers."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from distributed import Client, LocalCluster

import dask_monarch as dm
from conftest import wait_until
from dask_monarch.worker.plugin import sync_batch
from processes import sigstop


def slow_add(x):
    time.sleep(3)
    return x + 1


def pid():
    return os.getpid()


def sessions_on_workers(client, workers=None):
    return client.run(lambda dask_worker: sorted(dask_worker.plugins["dask-monarch"].sessions), workers=workers)


def session_threads(client, session_id, workers=None):
    """Per worker: the names of the session's threads still alive there."""

    def probe():
        import threading

        return sorted(t.name for t in threading.enumerate() if t.name.startswith(f"monarch-{session_id[:8]}-"))

    return client.run(probe, workers=workers)



@pytest.fixture
def fresh_client2():
    """A cluster of two workers of the test's own (it kills, stops or restarts one)."""
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0", silence_logs=50) as cluster:
        with Client(cluster) as client:
            yield client


@pytest.fixture(scope="module")
def vanishing_client2():
    """A cluster of two workers shared by the tests whose controller (a subprocess) vanishes: no worker is harmed,
    and each test checks that no session is left on the workers and the scheduler."""
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0", silence_logs=50) as cluster:
        with Client(cluster, set_as_default=False) as client:
            yield client


def test_killed_worker_fails_the_session_and_the_rest_keeps_serving(fresh_client2):
    client = fresh_client2
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=60)
    x = dm.remote(torch.add)(mesh.rank("dp"), 1)
    assert dm.inspect(x.reduce("dp", "sum")).item() == 3  # the communicator exists before the kill
    total = dm.remote(slow_add)(x).reduce("dp", "sum")
    future = dm.fetch_shard(total)
    victim = mesh.workers[1]
    os.kill(client.run(pid)[victim], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(dm.SessionError, match=r"rank 1 \(" + victim):
        future.result(timeout=120)
    assert time.monotonic() - start < 30  # a bound far below the 60 s collective timeout
    mesh.exit()  # already reported: exit cleans up without raising
    client.wait_for_workers(2, timeout=60)  # the nanny restarted the killed worker
    with dm.attach(client, dims={"dp": 2}, comm_timeout=60) as mesh2:
        assert dm.inspect(dm.remote(torch.add)(mesh2.rank("dp"), 1).reduce("dp", "sum")).item() == 3
    deadline = time.monotonic() + 30
    while any(sessions_on_workers(client).values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(sessions_on_workers(client).values())


def test_controller_that_disappears_leaves_no_session(vanishing_client2):
    client = vanishing_client2
    address = client.scheduler.address
    script = textwrap.dedent(f"""
        import os, torch, dask_monarch as dm
        mesh = dm.attach({address!r}, dims={{"dp": 2}}, comm_timeout=60)
        x = dm.remote(torch.add)(mesh.rank("dp"), 1)
        print(dm.inspect(x.reduce("dp", "sum")).item(), flush=True)
        os._exit(0)  # no mesh.exit(): the controller just vanishes
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "3", out.stderr
    deadline = time.monotonic() + 30
    while any(sessions_on_workers(client).values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(sessions_on_workers(client).values())
    sessions = client.sync(client.scheduler.monarch_sessions)
    assert sessions == {}


def test_fetch_timeout_with_a_stopped_worker_is_honoured_and_names_the_worker(fresh_client2):
    """A SIGSTOPped worker is still in the cluster (its heartbeats just stop) and answers nothing. The fetch's
    TimeoutError comes after about its timeout, naming the rank that did not answer, instead of waiting on that
    worker to describe its state."""
    client = fresh_client2
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=60)
    x = dm.remote(torch.add)(mesh.rank("dp"), 1)
    assert dm.fetch_shard(x, dp=1).result(timeout=60).item() == 2
    victim = mesh.workers[1]
    victim_pid = client.run(pid)[victim]
    sigstop(victim_pid)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            dm.fetch_shard(x).result(timeout=3)
        assert time.monotonic() - start < 20
        text = str(info.value)
        assert f"rank 1 ({victim})" in text
        assert "did not answer within" in text
    finally:
        os.kill(victim_pid, signal.SIGCONT)
    mesh.exit()


def test_stopped_worker_during_a_reduce_fails_the_session_naming_it(fresh_client2):
    """spec/dask-notes.md §6 #9: stall one rank (SIGSTOP) during an all-reduce; the controller reports which rank
    is missing within a bound far below both the collective timeout and Dask's worker-ttl (5 minutes), and the
    surviving rank stops waiting in the collective at once instead of at comm_timeout."""
    client = fresh_client2
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=240, heartbeat_timeout=5)
    session_id = mesh.session_id
    x = dm.remote(torch.add)(mesh.rank("dp"), 1)
    assert dm.inspect(x.reduce("dp", "sum")).item() == 3  # the communicators exist: the stop hits a collective
    survivor, victim = mesh.workers[0], mesh.workers[1]
    victim_pid = client.run(pid)[victim]
    total = dm.remote(slow_add)(x).reduce("dp", "sum")
    future = dm.fetch_shard(total)
    time.sleep(1)  # both ranks are in slow_add; rank 0 goes on into the all-reduce
    sigstop(victim_pid)
    try:
        start = time.monotonic()
        with pytest.raises(dm.SessionError, match=rf"rank 1 \({victim}\) has sent no heartbeat") as info:
            future.result(timeout=200)
        assert time.monotonic() - start < 90, info.value
        mesh.exit()  # already reported: exit cleans up without raising
        # the survivor was blocked in the all-reduce with the stopped rank: it lets go now, not at comm_timeout
        assert wait_until(lambda: not session_threads(client, session_id, [survivor])[survivor], 60), \
            session_threads(client, session_id, [survivor])
        assert sessions_on_workers(client, [survivor])[survivor] == []
    finally:
        os.kill(victim_pid, signal.SIGCONT)
    # once resumed, the stopped worker ends the session too, and the cluster serves a new session
    assert wait_until(lambda: not any(session_threads(client, session_id).values()), 60)
    with dm.attach(client, dims={"dp": 2}, comm_timeout=60) as mesh2:
        assert dm.inspect(dm.remote(torch.add)(mesh2.rank("dp"), 1).reduce("dp", "sum")).item() == 3


def test_work_queued_behind_a_running_call_is_dropped_when_the_controller_vanishes(vanishing_client2, tmp_path):
    """A controller killed mid-run: the call running on the workers finishes (a Python thread cannot be
    interrupted), but nothing queued behind it runs any more, and the session is freed."""
    client = vanishing_client2
    marker = tmp_path / "ran"
    script = textwrap.dedent(f"""
        import os, time, torch, dask_monarch as dm

        def slow(r):
            time.sleep(4)
            return torch.ones(2)

        def leave_mark(x, r):
            open({str(marker)!r} + str(int(r)), "w").close()
            return x

        mesh = dm.attach({client.scheduler.address!r}, dims={{"dp": 2}}, comm_timeout=60)
        r = mesh.rank("dp")
        print(dm.inspect(r), flush=True)
        y = dm.remote(slow, propagate=lambda r: torch.empty(2))(r)
        y = dm.remote(leave_mark, propagate=lambda x, r: torch.empty(2))(y, r)
        mesh._session.flush()
        time.sleep(2)  # both ranks are inside slow()
        print("sent", flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["tensor(0)", "sent"], out.stderr
    assert wait_until(lambda: not any(sessions_on_workers(client).values()), 30)
    time.sleep(4)  # slow() has returned on both ranks by now (it was entered more than 2 s before the exit)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert client.sync(client.scheduler.monarch_sessions) == {}


@pytest.mark.parametrize("channel", [False, True], ids=["tasks", "answer-channel"])
def test_exit_returns_when_the_scheduler_stops_answering(cli_cluster_procs, channel):
    """A stopped (SIGSTOP) scheduler: through tasks alone, the waiting fetch fails within a bound
    (heartbeat_timeout, as for a silent worker) naming the scheduler; with answer channels the fetch needs no
    scheduler and gets its value. Either way mesh.exit() then returns instead of waiting forever to unregister the
    session."""
    address, procs = cli_cluster_procs
    mesh = dm.attach(address, dims={"dp": 2}, comm_timeout=60, timeout=90, heartbeat_timeout=5,
                     answer_channel=channel)
    x = dm.remote(torch.add)(mesh.rank("dp"), 1)
    assert dm.fetch_shard(x, dp=1).result(timeout=60).item() == 2
    scheduler = procs[0]
    sigstop(scheduler.pid)
    try:
        start = time.monotonic()
        if channel:
            assert dm.fetch_shard(x, dp=1).result(timeout=120).item() == 2
        else:
            with pytest.raises(dm.SessionError, match="the Dask scheduler is unreachable"):
                dm.fetch_shard(x).result(timeout=120)
        try:
            mesh.exit(timeout=10)
        except dm.SessionError as e:  # the exit's own liveness check may find the scheduler silent first
            assert "the Dask scheduler is unreachable" in str(e)
        assert time.monotonic() - start < 60
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)


def test_restarting_the_cluster_fails_the_session_saying_so(fresh_client2):
    client = fresh_client2
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=60)
    x = dm.remote(slow_add)(dm.remote(torch.add)(mesh.rank("dp"), 1))
    future = dm.fetch_shard(x)
    time.sleep(1)
    client.restart(timeout=60)
    # whichever comes first: the fetch's task cancelled by the restart, or a worker's report (on its answer
    # socket) that it is shutting down
    with pytest.raises(dm.SessionError,
                       match=r"cancelled \(the cluster was restarted|shutting down \(closed, restarted or retired\)"):
        future.result(timeout=60)
    mesh.exit()


def test_a_failed_session_does_not_announce_a_fallback_for_its_lost_channels(fresh_client2, caplog):
    """After ``Client.restart`` failed the session, the answer channels and sockets that close afterwards are not
    reported as "its answers come back on ... from now on" (WARNING on stderr): nothing comes back for a failed
    session (seen after the error in a restart mid-fetch: four such lines, issue 26's fault round)."""
    client = fresh_client2
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=60)
    x = dm.remote(slow_add)(dm.remote(torch.add)(mesh.rank("dp"), 1))
    future = dm.fetch_shard(x)
    time.sleep(1)
    caplog.set_level("WARNING", logger="dask_monarch.controller")
    client.restart(timeout=60)
    with pytest.raises(dm.SessionError):
        future.result(timeout=60)
    time.sleep(3)  # the channels of both ranks close by now (the workers restarted)
    mesh.exit()
    messages = [(r.created, r.getMessage()) for r in caplog.records]
    failed_at = min(t for t, m in messages if m.startswith(f"session {mesh.session_id}: "))  # the session's error
    late = [m for t, m in messages if "from now on" in m and t >= failed_at]
    assert late == []


def test_exit_with_a_stopped_worker_raises_naming_it(fresh_client2):
    """mesh.exit() waits for every rank to drain; a rank that never answers is reported by exit itself."""
    client = fresh_client2
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=60, heartbeat_timeout=5)
    x = dm.remote(torch.add)(mesh.rank("dp"), 1)
    assert dm.fetch_shard(x, dp=1).result(timeout=60).item() == 2
    victim = mesh.workers[1]
    victim_pid = client.run(pid)[victim]
    sigstop(victim_pid)
    try:
        start = time.monotonic()
        with pytest.raises(dm.SessionError, match=rf"rank 1 \({victim}\) has sent no heartbeat"):
            mesh.exit(timeout=120)
        assert time.monotonic() - start < 60
        mesh.exit()  # reported once: a second exit is quiet
    finally:
        os.kill(victim_pid, signal.SIGCONT)


def test_worker_restarted_at_the_same_address_fails_the_session_naming_it(fixed_port_cli_cluster):
    """With fixed worker ports the nanny brings a killed worker back at the same address: the scheduler lists it
    again, but the session's state there is gone, and the fetch's status task (rerun there) would wait forever
    for batches that went to the dead process: the new process refuses the old session's tasks and holds
    nothing of it."""
    address, procs = fixed_port_cli_cluster
    client = Client(address, set_as_default=False)
    try:
        client.wait_for_workers(2, timeout=60)
        mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=60, heartbeat_timeout=10)
        x = dm.remote(torch.add)(mesh.rank("dp"), 1)
        assert dm.fetch_shard(x, dp=1).result(timeout=60).item() == 2
        future = dm.fetch_shard(dm.remote(slow_add)(x), dp=1)
        time.sleep(1)
        victim = mesh.workers[1]
        os.kill(client.run(os.getpid)[victim], signal.SIGKILL)  # (this module is not importable there)
        start = time.monotonic()
        with pytest.raises(dm.SessionError, match=rf"rank 1 \({victim}\) (was restarted|left the cluster)"):
            future.result(timeout=120)
        assert time.monotonic() - start < 60
        client.wait_for_workers(2, timeout=60)
        # a task of the old session that reaches the new process there is refused: it holds nothing of it
        answer = client.submit(sync_batch, mesh._session.params[1], 10_000, [], 0, workers=[victim], pure=False)
        chunk, messages = pickle.loads(answer.result(timeout=60)[0])
        assert chunk is None and "was restarted after session" in messages[0].error.backtrace
        mesh.exit()
        assert wait_until(lambda: not any(session_threads(client, mesh.session_id).values())
                          and not any(sessions_on_workers(client).values()), 30)
        with dm.attach(client, dims={"dp": 2}, comm_timeout=60) as mesh2:
            assert dm.inspect(dm.remote(torch.add)(mesh2.rank("dp"), 1).reduce("dp", "sum")).item() == 3
    finally:
        client.close()


SCHEDULER_KILLED = """
import sys, time
import torch
import dask_monarch as dm
from distributed import Client

client = Client({address!r}, set_as_default=False) if {own_client} else None
mesh = dm.attach(client or {address!r}, dims={{"dp": 2}}, comm_timeout=60)
x = dm.remote(torch.add)(mesh.rank("dp"), 1)
assert dm.fetch_shard(x, dp=1).result(timeout=60).item() == 2
slow = dm.remote(lambda t: (time.sleep(60), t)[1], propagate=lambda t: torch.empty_like(t))(x)
future = dm.fetch_shard(slow, dp=1)
print("ready", flush=True)
sys.stdin.readline()  # the scheduler was killed
start = time.monotonic()
try:
    future.result(timeout=120)
except dm.SessionError as e:
    print("error", round(time.monotonic() - start, 2), str(e).replace("\\n", " "), flush=True)
start = time.monotonic()
try:
    mesh.exit()
except dm.SessionError:
    pass
if client is not None:
    client.close()
print("closed", round(time.monotonic() - start, 2), flush=True)
"""


@pytest.mark.parametrize("own_client", [True, False], ids=["program-client", "attach-by-address"])
def test_a_killed_scheduler_fails_the_session_within_seconds_saying_so(cli_cluster_procs, own_client):
    """SIGKILL of the ``dask scheduler`` process while a fetch waits (issue 26 item 8): the controller's own
    connection to the scheduler closes at once, and that fails the session within seconds (not at
    heartbeat_timeout's 30 s, nor as a rank's lost socket), saying the scheduler is gone; mesh.exit() and closing
    the Client (the program's, or the one attach made) return at once, and nothing of Dask's Client logs an ERROR
    or a traceback on stderr by the program's exit. The controller is a program of its own (its stderr is read)."""
    address, procs = cli_cluster_procs
    script = textwrap.dedent(SCHEDULER_KILLED.format(address=address, own_client=own_client))
    controller = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
    try:
        assert controller.stdout.readline().strip() == "ready"
        procs[0].kill()  # SIGKILL
        procs[0].wait(30)
        controller.stdin.write("killed\n")
        controller.stdin.flush()
        out, err = controller.communicate(timeout=180)
    finally:
        controller.kill()
    lines = out.splitlines()
    assert controller.returncode == 0 and len(lines) == 2, (out, err[-3000:])
    _, took, error = lines[0].split(" ", 2)
    assert float(took) < 10, lines
    assert error.startswith("session ") and "the Dask scheduler is gone" in error.split(": ", 1)[1][:60], error
    assert lines[1].startswith("closed") and float(lines[1].split()[1]) < 10, lines
    assert "Traceback" not in err and "distributed.client - ERROR" not in err, err[-3000:]
