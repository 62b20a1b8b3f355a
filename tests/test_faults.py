"""No fault can wedge the controller, and a restarted worker holds nothing of earlier sessions (issue 12).

* A worker killed after a status task finished but before the controller collected its result: the session
  fails naming the rank, and the next session in the process works, on the same and on a new ``Client`` (the
  controller never waits in Dask's one callback thread, which a user's callback may also keep busy).
* After each kind of restart (a nanny restart of a killed worker at the same address, ``Client.restart_workers``,
  ``Client.restart``) no worker holds a session or its threads, and the error names the rank and worker.
* ``mesh.exit()`` with several unfetched remote failures reports all of them.

Workers are ``dask worker`` processes where one is killed or restarted.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from distributed import Client

import dask_monarch as dm
from dask_monarch.cluster import cluster_workers
from conftest import _cli_cluster, _free_port, wait_until
from processes import sigstop

TIMEOUT = 120



def _state_probe():
    """For ``Client.run`` (travels by value: ``dask worker`` processes cannot import this module): the sessions
    a worker holds and its dask_monarch threads."""

    def state(dask_worker):
        import threading

        plugin = dask_worker.plugins.get("dask-monarch")
        return {
            "sessions": sorted(plugin.sessions) if plugin is not None else [],
            "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("monarch-")),
        }

    return state


def holds_nothing(client) -> bool:
    return all(not s["sessions"] and not s["threads"] for s in client.run(_state_probe()).values())


def works(client) -> None:
    with dm.attach(client, dims={"dp": 2}, comm_timeout=60) as mesh:
        assert dm.inspect(dm.remote(torch.add)(mesh.rank("dp"), 1).reduce("dp", "sum")).item() == 3


@pytest.fixture(scope="module")
def cli_cluster(tmp_path_factory):
    """One ``dask scheduler`` and two ``dask worker`` processes (with nannies) shared by this module's tests."""
    for address, _ in _cli_cluster(tmp_path_factory.mktemp("cli")):
        yield address


@pytest.fixture(scope="module")
def fixed_port_cli_cluster(tmp_path_factory):
    """Like ``cli_cluster``, with a fixed port per worker: a restarted worker comes back at its address."""
    ports = [("--worker-port", str(_free_port())) for _ in range(2)]
    yield from _cli_cluster(tmp_path_factory.mktemp("cli-fixed"), ports)


@pytest.fixture
def client_of(request):
    clients = []

    def make(address):
        client = Client(address, set_as_default=False)
        client.wait_for_workers(2, timeout=60)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def test_a_result_lost_before_the_controller_collected_it_fails_only_that_session(cli_cluster, client_of):
    """The status task of rank 1 finishes, then its worker is killed before the controller has gathered the
    result (forced: the session's answer handler waits for the kill). Dask reschedules the lost key onto the
    dead, pinned worker, so gathering it would wait forever; the session fails naming rank 1 instead, through
    the lost result itself (liveness checks are held off), and later sessions get answers. Meanwhile an ordinary
    user callback keeps Dask's shared callback thread busy: the controller does not depend on it."""
    client = client_of(cli_cluster)
    # liveness checks far away: only the lost result can report the death within the bound below
    # through tasks alone: with an answer channel the answers come on it and no task result is needed
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=60, heartbeat_timeout=600, liveness_interval=600,
                     answer_channel=False)
    session = mesh._session
    x = dm.remote(torch.add)(mesh.rank("dp"), 1)
    assert dm.fetch_shard(x, dp=1).result(timeout=TIMEOUT).item() == 2
    busy = client.submit(time.sleep, 0.1, pure=False)
    release_user_callback = threading.Event()
    busy.add_done_callback(lambda f: release_user_callback.wait(60))
    victim = mesh.workers[1]
    killed = threading.Event()
    real = session._on_sync_done

    def after_the_kill(fut):
        if fut.key.split("-")[3] == "1" and not killed.is_set():  # rank 1's answers: collected after its death
            assert killed.wait(60)
        real(fut)

    session._on_sync_done = after_the_kill
    try:
        future = dm.fetch_shard(x, dp=1)
        assert wait_until(lambda: all(f.status == "finished" for f in future.futures), 60)
        victim_pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(victim_pid, signal.SIGKILL)
        assert wait_until(lambda: victim not in cluster_workers(client), 60)
        killed.set()
        start = time.monotonic()
        with pytest.raises(dm.SessionError, match=rf"answers of rank 1 \({victim}, [^)]*\) were lost"):
            future.result(timeout=TIMEOUT)
        assert time.monotonic() - start < 30
        mesh.exit()  # reported: quiet
    finally:
        killed.set()
        release_user_callback.set()
    client.wait_for_workers(2, timeout=60)  # the nanny restarted the killed worker
    works(client)
    works(client_of(cli_cluster))
    assert wait_until(lambda: holds_nothing(client), 30), client.run(_state_probe())


def test_answers_do_not_wait_for_a_busy_dask_callback_thread(cli_cluster, client_of):
    """A user's callback holds Dask's one callback thread (``Future.add_done_callback``) for minutes: a session's
    answers still come (they never pass through that thread)."""
    client = client_of(cli_cluster)
    release = threading.Event()
    started = threading.Event()
    busy = client.submit(time.sleep, 0.1, pure=False)
    busy.add_done_callback(lambda f: (started.set(), release.wait(300)))
    try:
        assert started.wait(30)
        with dm.attach(client, dims={"dp": 2}, comm_timeout=60) as mesh:
            total = dm.remote(torch.add)(mesh.rank("dp"), 1).reduce("dp", "sum")
            assert dm.fetch_shard(total).result(timeout=60).item() == 3
    finally:
        release.set()


def slow_on_rank_1(x, rank):
    if int(rank) == 1:
        time.sleep(20)
    return x + 1


@pytest.mark.parametrize("restart", ["restart_workers", "restart"])
def test_after_a_restart_no_worker_holds_the_session(fixed_port_cli_cluster, client_of, restart):
    """``Client.restart_workers`` of one rank's worker while the other waits for it in an all-reduce, or
    ``Client.restart`` of the cluster: the session fails, its error led by the rank and worker that restarted
    (not by the socket the survivor lost: liveness checks are held off, so the survivor's report is what
    fails it), and afterwards neither the restarted workers (back at the same address: fixed ports) nor the
    survivor hold anything of it, even though the controller's Exit went to the new processes."""
    address, _ = fixed_port_cli_cluster
    client = client_of(address)
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=60, heartbeat_timeout=600, liveness_interval=600)
    x = dm.remote(torch.add)(mesh.rank("dp"), 1)
    assert dm.inspect(x.reduce("dp", "sum")).item() == 3
    y = dm.remote(slow_on_rank_1, propagate=lambda x, rank: torch.empty_like(x))(x, mesh.rank("dp"))
    future = dm.fetch_shard(y.reduce("dp", "sum"))
    time.sleep(2)  # rank 0 waits in the all-reduce for rank 1
    victim = mesh.workers[1]
    if restart == "restart_workers":
        restarting = threading.Thread(target=client.restart_workers, args=([victim],), kwargs={"timeout": 60})
        expected = rf"^session \w+: worker\(s\) (shutting down|left the cluster)[^:]*: rank 1 \({victim}\);"
    else:
        restarting = threading.Thread(target=client.restart, kwargs={"timeout": 60})
        # every worker restarts: the tasks' cancellation, or the scheduler's view of the workers shutting down
        # (when the host relay's sockets close first), leads the error
        expected = r"cancelled \(the cluster was restarted|^session \w+: worker\(s\) (shutting down|left the cluster)"
    restarting.start()
    with pytest.raises(dm.SessionError, match=expected):
        future.result(timeout=TIMEOUT)
    restarting.join(90)
    mesh.exit()
    client.wait_for_workers(2, timeout=60)
    assert sorted(cluster_workers(client)) == sorted(mesh.workers.values())  # same addresses
    assert wait_until(lambda: holds_nothing(client), 30), client.run(_state_probe())
    works(client)
    assert wait_until(lambda: holds_nothing(client), 30), client.run(_state_probe())


def test_exit_with_several_unfetched_failures_names_them_all(client2):
    mesh = dm.attach(client2, dims={"dp": 2}, comm_timeout=60)
    bad = dm.remote("i.dont.exist", propagate=lambda: torch.empty(()))
    with mesh.activate():
        bad()
        bad()
        bad()
    with pytest.raises(dm.RemoteException) as info:
        mesh.exit()
    error = info.value
    assert len(error.others) == 2
    seqs = [error.seq] + [e.seq for e in error.others]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    text = str(error)
    assert "and 2 other remote failures nobody fetched" in text
    for e in error.others:
        assert f"seq {e.seq}" in text


def test_from_dask_waiting_on_a_killed_worker_raises_the_session_error(cli_cluster, client_of):
    """A partition computed on rank 1's worker, which is SIGKILLed meanwhile: from_dask's wait wakes with the
    session's error naming rank 1, not an empty TimeoutError after its whole timeout."""
    import dask.array as da

    def _slow_block(block, block_info=None):  # nested: pickled by value (the CLI workers cannot import this module)
        if block_info[None]["chunk-location"][0] == 1:  # rank 1's rows: still computing when its worker is killed
            time.sleep(120)
        return block

    client = client_of(cli_cluster)
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=60, liveness_interval=0.5)
    victim = mesh.workers[1]
    victim_pid = client.run(os.getpid, workers=[victim])[victim]
    threading.Timer(2.0, os.kill, (victim_pid, signal.SIGKILL)).start()
    data = da.arange(8.0, chunks=4).map_blocks(_slow_block, dtype=float)
    with pytest.raises(dm.SessionError, match=rf"rank 1 \({victim}"):
        dm.from_dask(data, mesh, timeout=60)
    try:
        mesh.exit()
    except Exception:
        pass
    client.wait_for_workers(2, timeout=60)


MIB = 2**20


def _transferring(client, session_id: str, address: str) -> bool:
    """Whether a thread of the session on the worker at ``address`` waits in a ``to_mesh`` transfer now (its
    stack passes through ``send_tensor._transfer``)."""
    tag = session_id[:8]

    def probe():  # travels by value: the CLI workers cannot import this module
        import sys
        import threading

        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if not names.get(ident, "").startswith(f"monarch-{tag}"):
                continue
            while frame is not None:
                if frame.f_code.co_name == "_transfer" and frame.f_code.co_filename.endswith("send_tensor.py"):
                    return True
                frame = frame.f_back
        return False

    return client.run(probe, workers=[address])[address]


def _session_threads(client, session_id: str, address: str) -> list:
    tag = session_id[:8]
    names = client.run(lambda: [t.name for t in threading.enumerate()], workers=[address])[address]
    return [n for n in names if n.startswith("monarch-") and tag in n]


@pytest.mark.parametrize("survivor_sends", [True, False, True, False], ids=["send", "recv", "send-again", "recv-again"])
def test_a_to_mesh_under_way_when_its_peer_is_killed_is_abandoned_at_once(cli_cluster, client_of, survivor_sends):
    """A ``to_mesh`` of 128 MiB caught mid-transfer when its peer's ``dask worker`` process is SIGKILLed (issue 26
    item 3): the survivor's send (its peer stopped while receiving, then killed) or receive (its peer stopped while
    sending, then killed) is one gloo does not fail when the pair closes, so it waited for ``comm_timeout``; it is
    abandoned when the session ends: the survivor's session threads are gone within seconds of the error, not
    comm_timeout's 240. Repeated, each rank in turn (the nanny restarts the victim)."""
    client = client_of(cli_cluster)
    client.wait_for_workers(2, timeout=60)
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=240)
    sid = mesh._session.id
    slices = [mesh.slice(dp=slice(0, 1)), mesh.slice(dp=slice(1, 2))]
    sender = 0 if survivor_sends else 1  # rank 0 survives in both cases
    receiver = 1 - sender
    with slices[sender].activate():
        warm = torch.ones(4)
    assert dm.inspect(warm.to_mesh(slices[receiver])).tolist() == [1.0] * 4  # the communicator exists
    pids = {r: client.run(os.getpid, workers=[mesh.workers[r]])[mesh.workers[r]] for r in (0, 1)}
    survivor, victim = mesh.workers[0], mesh.workers[1]
    with slices[sender].activate():
        big = dm.remote(lambda: (time.sleep(3), torch.ones(32 * MIB))[1], propagate=lambda: torch.empty(32 * MIB))()
    future = dm.fetch_shard(big.to_mesh(slices[receiver])[:1])
    assert wait_until(lambda: _transferring(client, sid, mesh.workers[receiver]), 30)  # its receive is posted
    sigstop(pids[receiver])  # the sender's write fills the socket's buffers and waits there
    try:
        assert wait_until(lambda: _transferring(client, sid, mesh.workers[sender]), 30)
        time.sleep(0.5)
        if survivor_sends:
            os.kill(pids[1], signal.SIGKILL)  # the receiver, mid-receive
        else:
            sigstop(pids[1])  # the sender, mid-send
            os.kill(pids[0], signal.SIGCONT)  # the receiver reads what was sent, then waits for the rest
            time.sleep(0.5)
            os.kill(pids[1], signal.SIGKILL)
    finally:
        os.kill(pids[0], signal.SIGCONT)
    with pytest.raises(dm.SessionError, match=rf"rank 1 \({victim}"):
        future.result(timeout=120)
    failed_at = time.monotonic()
    assert wait_until(lambda: not _session_threads(client, sid, survivor), 30), _session_threads(client, sid, survivor)
    assert time.monotonic() - failed_at < 10  # seconds (the probe's own time included), not comm_timeout's 240
    mesh.exit()  # already reported: quiet
    client.wait_for_workers(2, timeout=60)  # the nanny restarted the killed worker
    works(client)


def test_abort_work_ends_a_gloo_send_or_receive_wait_and_nothing_else():
    """``worker/gloo.abort_work`` (what ``Comms`` calls for a session's pending transfers): a gloo receive and a
    send that no peer answers return False from ``wait()`` right after it, instead of at the group's 60 s timeout;
    any other object (a collective's work, a tensor, None) is left alone. Two ranks in this process, no cluster."""
    from dask_monarch.worker.gloo import abort_work
    from gloo_abort import two_gloo_ranks

    first, second = two_gloo_ranks()
    receive = first.recv([torch.empty(4)], 1, 7)  # rank 1 never sends
    send = first.send([torch.ones(4)], 1, 8)  # rank 1 never receives
    for work in (receive, send):
        waiter = threading.Timer(0.2, abort_work, (work,))
        waiter.start()
        start = time.monotonic()
        assert work.wait() is False
        assert time.monotonic() - start < 10
        waiter.join()
    collective = [first.allreduce([torch.ones(2)]), second.allreduce([torch.ones(2)])]
    assert [abort_work(w) for w in collective] == [False, False]
    assert [w.wait() for w in collective] == [True, True]
    assert abort_work(torch.ones(1)) is False and abort_work(None) is False


def test_finding_pybind11s_abi_takes_no_reference_from_the_interpreters_dict():
    """``gloo._abi_ids`` (what ``abort_work`` uses once per process) reads the interpreter's state dict, a borrowed
    reference: it once released it as if it owned it, which freed the dict (its count went 1 -> 0) while the
    interpreter held it, and processes that had aborted a gloo transfer crashed with SIGSEGV at exit."""
    from dask_monarch.worker import gloo
    from gloo_abort import interpreter_state_dict

    before = interpreter_state_dict()
    assert before[0] >= 1
    for _ in range(3):
        assert gloo._abi_ids()  # this torch build's pybind11 is found
    assert interpreter_state_dict() == before


# test_abort_work_ends_a_gloo_send_or_receive_wait_and_nothing_else's body as a program: two gloo ranks in one
# process, a receive nobody answers aborted; then the program ends normally
_ABORT_PROGRAM = """
import threading
import torch
from dask_monarch.worker.gloo import abort_work
from gloo_abort import interpreter_state_dict, two_gloo_ranks  # tests/gloo_abort.py (the program runs there)

before = interpreter_state_dict()
groups = two_gloo_ranks()
receive = groups[0].recv([torch.empty(4)], 1, 7)  # rank 1 never sends
aborter = threading.Timer(0.2, abort_work, (receive,))
aborter.start()
assert receive.wait() is False
aborter.join()
after = interpreter_state_dict()
print("interpreter dict kept" if after == before else f"interpreter dict changed: {before} -> {after}")
"""


def test_a_program_that_aborted_a_gloo_transfer_exits_0():
    """A program that aborts a gloo receive (``abort_work``, as a worker does when a session stops under a
    transfer) ends with exit code 0 and nothing on stderr, 3 runs out of 3, and the interpreter's state dict is
    as before the abort at the end, count and keys (pybind11's internals): the abort freed it once (its memory then
    held another dict), and such exits crashed with SIGSEGV in the collector's last run (2 of 5 runs of a test
    file set)."""
    import subprocess
    import sys

    for run in range(3):
        proc = subprocess.run([sys.executable, "-c", _ABORT_PROGRAM], capture_output=True, text=True, timeout=120,
                              cwd=os.path.dirname(__file__))
        assert (proc.returncode, proc.stderr) == (0, ""), (run, proc.returncode, proc.stderr[-3000:])
        assert proc.stdout.strip() == "interpreter dict kept", (run, proc.stdout)


def test_iter_from_dask_waiting_on_a_killed_worker_raises_the_session_error(cli_cluster, client_of):
    """As for from_dask (issue 26 item 1): the second group's partition on rank 1's worker is still computing when
    that worker is SIGKILLed (3 s in; the first group is read meanwhile, and the second read ahead); iterating
    wakes with the session's error naming rank 1 within seconds, not a TimeoutError after the groups' timeout."""
    import dask.array as da

    def _slow_block(block, block_info=None):  # nested: pickled by value (the CLI workers cannot import this module)
        if block_info[None]["chunk-location"][0] == 3:  # group 1, rank 1's rows
            time.sleep(120)
        return block

    client = client_of(cli_cluster)
    client.wait_for_workers(2, timeout=60)
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=60, liveness_interval=0.5)
    victim = mesh.workers[1]
    victim_pid = client.run(os.getpid, workers=[victim])[victim]
    data = da.arange(8.0, chunks=2).map_blocks(_slow_block, dtype=float)
    killed = []
    kill = threading.Timer(3.0, lambda: (os.kill(victim_pid, signal.SIGKILL), killed.append(time.monotonic())))
    kill.start()
    with pytest.raises(dm.SessionError, match=rf"rank 1 \({victim}"):
        for _ in dm.iter_from_dask(data, mesh, partitions=1, ahead=1, timeout=120):
            pass
    kill.join()
    assert killed and time.monotonic() - killed[0] < 60  # seconds, not the 120 s timeout
    try:
        mesh.exit()
    except Exception:
        pass
    client.wait_for_workers(2, timeout=60)
