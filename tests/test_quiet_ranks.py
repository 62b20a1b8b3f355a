"""Quiet ranks (``worker/relay.py``, issue 23 items 1 and 6): a host's relay answers a fetch's ``RequestStatus`` itself
for the ranks that get nothing else and have passed everything they were sent, and hands them the barrier later,
in order (``SocketInbox.noted``); a rank that is busy, or whose sockets the relay lost, is waited for as before
(spec §1 "Fetch", §3: a future resolves once every rank has passed its seq). All ranks of a LocalCluster share one
host, so one relay serves them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from distributed import Client, LocalCluster, wait

import dask_monarch as dm
from conftest import wait_until
from processes import sigstop
from dask_monarch.worker.plugin import PLUGIN_NAME
from dask_monarch.worker.proc_state import ProcState, identity
from dask_monarch.worker.quiet import QUIET_DELAY, QUIET_HEARD
from dask_monarch.worker.relay import HostRelay, _RelayOutbox

TIMEOUT = 60


def _state(session_id: str, dask_worker=None) -> dict | None:
    """On a worker: its rank's ``received``, ``completed_seq`` and the barriers its relay answered for it."""
    tw = dask_worker.plugins[PLUGIN_NAME].sessions.get(session_id)
    if tw is None:
        return None
    return {"rank": tw.rank, "received": tw.received, "status": tw.completed_seq,
            "noted": tw.socket_inbox.noted_count if tw.socket_inbox is not None else None}


def _states(client, mesh) -> dict:
    """``{rank: _state}`` of every rank of ``mesh``."""
    out = client.run(_state, mesh._session.id, workers=list(mesh._session.workers))
    return {s["rank"]: s for s in out.values()}


def _handed_over(client, mesh) -> dict:
    """``_states`` once every rank has passed the last barrier (those the relay answered are handed over within
    ``QUIET_DELAY``)."""
    assert wait_until(lambda: len({s["status"] for s in _states(client, mesh).values()}) == 1, 10, QUIET_DELAY)
    return _states(client, mesh)


def _sleep_on(x, rank, seconds):
    """``x``, after ``seconds`` on rank 2 (``rank`` is ``mesh.rank("dp")``), at once elsewhere."""
    if int(rank) == 2:
        time.sleep(seconds)
    return x


def test_consecutive_fetches_wake_the_fetched_rank_and_every_rank_gets_its_barriers_later(client4):
    with dm.attach(client4, dims={"dp": 4}, comm_timeout=60) as mesh:
        session = mesh._session
        assert session.channels.relays[0] is not None and session.channels.relays[0].ranks == [0, 1, 2, 3]
        with mesh.activate():
            x = mesh.rank("dp") * 10 + torch.arange(3.0)
        for _ in range(2):  # every rank had work (the ops, then their temporaries' DeleteRefs): every rank answers
            assert dm.inspect(x, dp=3).tolist() == [30.0, 31.0, 32.0]
        before = _handed_over(client4, mesh)
        n = 20
        for i in range(n):
            rank = i % 2  # ranks 0 and 1 in turn; ranks 2 and 3 only ever get the barrier
            assert dm.inspect(x, dp=rank).tolist() == [10.0 * rank + k for k in range(3)]
        future = dm.fetch_shard(x, dp=0)
        assert future.result(timeout=TIMEOUT).tolist() == [0.0, 1.0, 2.0]
        last = future.status_seq
        # the barriers answered by the relay reach their ranks within QUIET_DELAY, so the Dask task copies of those
        # batches (``sync_batch``, waiting for each rank's Status) finish as well
        wait(future.futures, timeout=TIMEOUT)
        assert [f.status for f in future.futures] == ["finished"] * 4
        after = _handed_over(client4, mesh)
        assert [after[rank]["status"] for rank in range(4)] == [last + 1] * 4
        fetched = {0: n // 2 + 1, 1: n // 2, 2: 0, 3: 0}  # the fetches at each rank: one SendValue each
        for rank in range(4):  # each rank got every message, the barriers included: one per fetch, and its SendValues
            assert after[rank]["received"] - before[rank]["received"] == n + 1 + fetched[rank]
            # the relay answered the barrier of the fetches at another rank (the rank had answered its last): of
            # every one, but for up to two that a loaded machine delayed past QUIET_HEARD (then the rank answers)
            quiet = n + 1 - fetched[rank]
            assert quiet - 2 <= after[rank]["noted"] - before[rank]["noted"] <= quiet


def test_a_fetch_waits_for_a_rank_that_is_still_busy(client4):
    with dm.attach(client4, dims={"dp": 4}, comm_timeout=60) as mesh:
        with mesh.activate():
            x = mesh.rank("dp") + torch.zeros(2)
        for _ in range(3):
            assert dm.inspect(x, dp=0).tolist() == [0.0, 0.0]  # every rank quiet now
        before = _handed_over(client4, mesh)
        with mesh.activate():
            y = dm.remote(_sleep_on, propagate=lambda x, r, s: x)(x, mesh.rank("dp"), 3.0)  # rank 2 busy for 3 s
        time.sleep(0.5)  # the flusher sends it on its own; then rank 2 alone is busy when the fetch comes
        start = time.monotonic()
        assert dm.inspect(x, dp=0).tolist() == [0.0, 0.0]
        waited = time.monotonic() - start
        assert waited > 1.5, f"the fetch returned after {waited:.2f} s while rank 2 was still running its call"
        assert dm.inspect(y, dp=2).tolist() == [2.0, 2.0]
        mid = _handed_over(client4, mesh)
        assert mid[2]["noted"] == before[2]["noted"]  # rank 2 answered both barriers itself
        for _ in range(3):
            assert dm.inspect(x, dp=0).tolist() == [0.0, 0.0]  # every rank idle again, and heard from
        after = _handed_over(client4, mesh)
        assert after[0]["noted"] == mid[0]["noted"] and all(after[r]["noted"] > mid[r]["noted"] for r in (1, 2, 3))


def _hold_on(x, rank, path):
    """``x``, once ``path`` exists (120 s at most) on rank 2, at once elsewhere."""
    if int(rank) == 2:
        deadline = time.monotonic() + 120
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
    return x


def test_a_fetch_that_runs_out_of_time_names_the_busy_rank_not_those_its_relay_holds_back(client4, tmp_path):
    """The relay sends its host's lowest Status, so ranks 0, 1 and 3 (idle) look as late as rank 2 (busy) to the
    controller; the TimeoutError names rank 2 alone, with what it is busy on, and lists the others as passed."""
    release = tmp_path / "release"
    with dm.attach(client4, dims={"dp": 4}) as mesh:
        try:
            with mesh.activate():
                x = mesh.rank("dp") + torch.zeros(2)
                dm.remote(_hold_on, propagate=lambda x, r, p: x)(x, mesh.rank("dp"), str(release))
            with pytest.raises(TimeoutError) as info:
                dm.fetch_shard(x, dp=0).result(timeout=5)
        finally:
            release.touch()
    headline = str(info.value).splitlines()[0]
    assert re.search(r"from rank 2 \(tcp://[^)]+\) on CallFunction seq \d+: \S*_hold_on \(main, busy", headline), headline
    assert "rank(s) 0, 1, 3 passed it" in headline, headline
    assert not re.search(r"rank [013] \(tcp", str(info.value)), str(info.value)


def test_a_quiet_rank_whose_worker_was_killed_is_not_answered_for():
    """SIGKILL a quiet rank's worker (not the relay's): its sockets to the relay close, so the relay no longer answers
    for it, and the next fetch fails within the heartbeat bound naming that worker instead of returning a value."""
    with LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address=":0", silence_logs=50) as cluster:
        with Client(cluster) as client:
            heartbeat = 20.0
            mesh = dm.attach(client, dims={"dp": 3}, comm_timeout=60, heartbeat_timeout=heartbeat)
            with mesh.activate():
                x = mesh.rank("dp") + torch.zeros(2)
            for _ in range(3):
                assert dm.inspect(x, dp=0).tolist() == [0.0, 0.0]  # ranks 1 and 2 quiet
            worker = mesh.workers[2]
            pid = client.run(os.getpid, workers=[worker])[worker]
            os.kill(pid, signal.SIGKILL)
            psutil.Process(pid).wait(TIMEOUT)
            time.sleep(0.5)  # the relay reads its sockets' end
            start = time.monotonic()
            with pytest.raises(dm.SessionError, match=worker):
                dm.fetch_shard(x, dp=0).result(timeout=120)
            assert time.monotonic() - start < heartbeat
            mesh.exit()


class _Link:
    """What ``HostRelay._answer_quiet`` reads of a link: a rank's (``ranks`` None) or a sub-relay's."""

    def __init__(self, rank, ranks=None, alive=True, heard: float = 0.0):
        self.rank, self.ranks, self.alive, self.ended = rank, ranks, alive, False
        self.done, self.lost_ranks = set(), set()
        self.heard = time.monotonic() - heard  # ``heard`` seconds ago
        self.procs = []  # no process to check (``proc_state.py``): running


def _relay(passed: dict, need: dict):
    """A ``HostRelay`` with only what ``_answer_quiet`` uses (no sockets)."""
    relay = HostRelay.__new__(HostRelay)
    relay._lock = threading.Lock()
    relay._passed, relay._need = dict(passed), dict(need)
    relay._deferred, relay._held, relay._low = {}, [], min(passed.values())
    relay.outbox = _RelayOutbox()
    return relay


def test_the_relay_answers_only_for_ranks_that_get_nothing_else_passed_all_and_are_up():
    r1, r2, r3, r4, child = _Link(1), _Link(2), _Link(3), _Link(4, alive=False), _Link(5, ranks=[5, 6])
    # rank 1 passed its last barrier (seq 9); rank 2 has not yet (a call may be running); rank 3 got a batch without
    # a barrier since (need: never); rank 4's sockets broke; the sub-relay of ranks 5 and 6 passed all
    relay = _relay({1: 10, 2: 8, 3: 10, 4: 10, 5: 10}, {1: 10, 2: 10, 3: float("inf"), 4: 10, 5: 10})
    frames = [(r, {"b": 7, "s": []}) for r in (r1, r2, r3, r4)] + [(child, {"b": [(5, 7, [0]), (6, 7, [0])]})]
    out = relay._answer_quiet(frames, 11, (0,))
    assert [m is None for _, m in frames] == [True, False, False, False, True]
    assert relay._deferred == {r1: [(7, 11)], child: [(5, 7, 11), (6, 7, 11)]}
    assert relay._passed == {1: 12, 2: 8, 3: 10, 4: 10, 5: 12} and set(relay._need.values()) == {12}
    assert out == []  # the host's minimum (rank 2's 8) did not move: nothing for the controller yet
    # a busy rank is not answered for, nor is a sub-relay one of whose ranks is busy; once every rank of the relay is
    # answered for, the host's minimum moves and goes to the controller at once
    relay = _relay({1: 12, 5: 12}, {1: 12, 5: 12})
    frames = [(r1, {"b": 8, "s": []}), (child, {"b": [(5, 8, [0]), (6, 8, [0])]})]
    assert relay._answer_quiet(frames, 13, (1, 6)) is None and all(m is not None for _, m in frames)
    frames = [(r1, {"b": 9, "s": []}), (child, {"b": [(5, 9, [0]), (6, 9, [0])]})]
    assert relay._answer_quiet(frames, 15, (0,)) is None  # need 14 after the last flush: rank 1 must answer it first
    relay._passed = {1: 16, 5: 16}  # both answered the barrier of seq 15
    frames = [(r1, {"b": 10, "s": []}), (child, {"b": [(5, 10, [0]), (6, 10, [0])]})]
    assert relay._answer_quiet(frames, 17, (0,)) == [("s", 18)] and relay.outbox.push()
    # a flush without a barrier (no ``q``): nothing answered, and every rank must answer a barrier again first
    frames = [(r1, {"b": 11, "s": []})]
    assert relay._answer_quiet(frames, None, None) is None and relay._need[1] == float("inf")


def test_a_sub_relay_that_lost_one_of_its_ranks_is_not_answered_for():
    """A sub-relay's rank whose sockets broke (its ``("l", rank, why)`` came up) is not answered for by the host
    relay, as a rank of its own would not be: before, the host relay answered for the whole sub-relay, and fetches
    returned values for the ``HostLink.LOST_GRACE`` (5 s) until the session failed naming the rank (fanout 2, 5
    ranks, rank 3's sockets to its sub-relay shut down on its live worker)."""
    child = _Link(5, ranks=[5, 6])
    relay = _relay({5: 10}, {5: 10})
    relay.below(child, [("l", 6, "EOFError: the peer closed the connection"), ("!",)])
    assert child.lost_ranks == {6}
    frames = [(child, {"b": [(5, 7, [0]), (6, 7, [0])]})]
    assert relay._answer_quiet(frames, 11, (0,)) is None and frames[0][1] is not None
    assert relay._deferred == {}


def test_a_rank_not_heard_from_lately_is_asked_not_answered_for():
    """A rank (or sub-relay) whose last frame is older than ``QUIET_HEARD`` (a SIGSTOPped process answers none of its
    hand-overs) gets the barrier and is waited for, so the heartbeat bound still catches a stopped process."""
    fresh, stale = _Link(1), _Link(2, heard=QUIET_HEARD + 0.5)
    child = _Link(5, ranks=[5, 6], heard=QUIET_HEARD + 0.5)
    relay = _relay({1: 10, 2: 10, 5: 10}, {1: 10, 2: 10, 5: 10})
    frames = [(fresh, {"b": 7, "s": []}), (stale, {"b": 7, "s": []}), (child, {"b": [(5, 7, [0]), (6, 7, [0])]})]
    assert relay._answer_quiet(frames, 11, (0,)) == []
    assert [m is None for _, m in frames] == [True, False, False] and list(relay._deferred) == [fresh]


def test_proc_state_tells_a_running_process_from_a_stopped_a_gone_and_another_one():
    """``proc_state.ProcState``: this process runs; a child runs, then is stopped (SIGSTOP), runs again (SIGCONT), and
    is gone once killed; a pid with another start time (a reused pid) and an unknown process are not running."""
    assert identity() is not None and ProcState(identity()).running()
    assert not ProcState(None).running()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            start = int(f.read().rsplit(b")", 1)[1].split()[19])
        state = ProcState((child.pid, start))
        assert state.running()
        assert not ProcState((child.pid, start + 1)).running()  # not that process
        os.kill(child.pid, signal.SIGSTOP)
        assert wait_until(lambda: not state.running(), 10, 0.01)
        os.kill(child.pid, signal.SIGCONT)
        assert wait_until(state.running, 10, 0.01)
        child.kill()
        child.wait(TIMEOUT)
        assert not state.running()
        state.close()
    finally:
        child.kill()
        child.wait(TIMEOUT)


def test_a_fetch_waits_for_a_quiet_rank_whose_worker_was_stopped():
    """SIGSTOP the worker of a quiet rank (one that had answered its last barrier): the relay asks it instead of
    answering for it, so the next fetch at the other rank times out naming the stopped rank, as a fetch does with
    a stopped worker (tests/test_failures.py), instead of returning a value."""
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0", silence_logs=50) as cluster:
        with Client(cluster) as client:
            _fetch_past_a_stopped_rank(client)


def _fetch_past_a_stopped_rank(client) -> None:
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=60)
    with mesh.activate():
        x = mesh.rank("dp") + torch.zeros(2)
    for _ in range(3):
        assert dm.inspect(x, dp=0).tolist() == [0.0, 0.0]  # rank 1 quiet
    victim = mesh._session.workers[1]
    victim_pid = client.run(os.getpid, workers=[victim])[victim]
    sigstop(victim_pid)
    try:
        with pytest.raises(TimeoutError, match=rf"rank 1 \({victim}\)"):
            dm.fetch_shard(x, dp=0).result(timeout=3)
    finally:
        os.kill(victim_pid, signal.SIGCONT)
    mesh.exit()
