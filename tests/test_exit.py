"""``mesh.exit()`` with a rank still busy (issue 25 item 2): it waits while the rank's worker keeps its heartbeat, up
to ``exit_timeout``, says once which rank and what it waits for, and ends the session cleanly; the dashboard
shows the rank as finishing meanwhile. Past ``exit_timeout`` it raises naming the rank and ends the session on
the workers; a rank that stops meanwhile fails it within ``heartbeat_timeout``."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import dask
import pytest

import dask_monarch as dm
from conftest import wait_until
from dask_monarch.controller.task_keys import session_tag
from processes import sigstop


def sleep_on_rank_one(mesh, seconds):
    if mesh.dims["dp"].rank == 1:
        time.sleep(seconds)


def pid():
    return os.getpid()


def ended_on_workers(client, session_id: str) -> dict:
    """How the session ended on each worker (``plugin.closed``): address -> failure text, None (a clean end), or
    ``"open"`` while it runs there."""
    def closed(dask_worker):
        plugin = dask_worker.plugins["dask-monarch"]
        return plugin.closed.get(session_id, "open")

    return client.run(closed)


def dashboard_states(client, session_id: str) -> tuple[list, str]:
    """The ``/monarch`` page's rank states and health line of the session, from the scheduler's sampled data."""
    def view(dask_scheduler):
        from dask_monarch.dashboard.install import read_scheduler

        v = dask_scheduler.plugins["dask-monarch"].dashboard.update(*read_scheduler(dask_scheduler), time.time())
        tag = session_tag(session_id)
        states = [s for t, s in zip(v["ranks"]["session"], v["ranks"]["state"]) if t == tag]
        return states, next((h["text"] for h in v["health"] if h["session"] == tag), "")

    return tuple(client.run_on_scheduler(view))


def test_exit_waits_for_a_rank_busy_30_s_says_so_once_and_ends_cleanly(client2, caplog):
    mesh = dm.attach(client2, dims={"dp": 2}, comm_timeout=60)
    sid = mesh.session_id
    with mesh.activate():
        dm.remote(sleep_on_rank_one, propagate="inspect")(mesh, 30)
    started = time.monotonic()
    outcome = {}

    def exit_mesh():
        try:
            mesh.exit()
            outcome["ok"] = time.monotonic() - started
        except BaseException as e:
            outcome["error"] = e

    caplog.set_level(logging.WARNING, logger="dask_monarch.controller")
    exiting = threading.Thread(target=exit_mesh)
    exiting.start()
    try:
        # meanwhile: rank 0 has exited, rank 1 is finishing (never "exited" while it runs), on the page
        seen = wait_until(lambda: dashboard_states(client2, sid)[0] == ["exited", "finishing"], 20)
        states, health = dashboard_states(client2, sid)
        assert seen, states
        assert health.startswith(f"{session_tag(sid)} finishing"), health
    finally:
        exiting.join(120)
    assert "error" not in outcome, outcome
    assert 25 < outcome["ok"] < 60, outcome
    notices = [r.getMessage() for r in caplog.records if "mesh.exit() waits for" in r.getMessage()]
    assert len(notices) == 1, notices
    assert f"rank 1 ({mesh.workers[1]}) on CallFunction seq" in notices[0], notices[0]
    assert "test_exit.sleep_on_rank_one (main, busy" in notices[0], notices[0]
    assert "exit_timeout" in notices[0] and "rank 0" not in notices[0], notices[0]
    assert wait_until(lambda: set(ended_on_workers(client2, sid).values()) == {None}, 20), \
        ended_on_workers(client2, sid)


def test_a_clean_close_reaching_a_rank_still_finishing_its_exit_leaves_it_to_end_cleanly(client2):
    """The controller's exit returns once every rank passed the exit's ``RequestStatus``, then closes the session on
    the scheduler, which ends it on the workers (``END_SESSION_OP``); a rank can still be closing on its clean
    ``Exit`` then (found beside a CPU hog: a worker recorded a normal exit as "the controller ended the session").
    Here rank 1 is still running a function under its ``Exit`` when that clean close reaches it: it finishes and
    ends cleanly, and the exit returns without error."""
    mesh = dm.attach(client2, dims={"dp": 2}, comm_timeout=60)
    sid = mesh.session_id
    with mesh.activate():
        dm.remote(sleep_on_rank_one, propagate="inspect")(mesh, 8)
    outcome = {}

    def exit_mesh():
        try:
            mesh.exit()
            outcome["ok"] = True
        except BaseException as e:
            outcome["error"] = e

    exiting = threading.Thread(target=exit_mesh)
    exiting.start()
    try:
        assert wait_until(lambda: dashboard_states(client2, sid)[0] == ["exited", "finishing"], 20), \
            dashboard_states(client2, sid)
        # as the controller's closer does once its exit drained every rank
        client2.sync(client2.scheduler.monarch_session_close, session_id=sid, clean=True)
    finally:
        exiting.join(120)
    assert outcome == {"ok": True}, outcome
    assert wait_until(lambda: set(ended_on_workers(client2, sid).values()) == {None}, 20), \
        ended_on_workers(client2, sid)


def test_exit_past_exit_timeout_raises_naming_the_busy_rank_and_ends_it_there(client2):
    with pytest.raises(ValueError, match="exit_timeout"):
        dm.attach(client2, dims={"dp": 2}, exit_timeout=0)
    with dask.config.set({"monarch.exit-timeout": 7}):
        configured = dm.attach(client2, dims={"dp": 2}, comm_timeout=60)
    assert configured._session.exit_timeout == 7.0
    configured.exit()

    mesh = dm.attach(client2, dims={"dp": 2}, comm_timeout=60, exit_timeout=3)
    sid = mesh.session_id
    with mesh.activate():
        dm.remote(sleep_on_rank_one, propagate="inspect")(mesh, 15)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"mesh.exit\(\) was not answered within 3 s: no Status past seq \d+ from "
                                           rf"rank 1 \({mesh.workers[1]}\)(.|\n)*test_exit.sleep_on_rank_one"):
        mesh.exit()
    assert time.monotonic() - start < 15
    # the session ends on the busy rank's worker too, as a failure (its queued work dropped), not at the sleep's end
    assert wait_until(lambda: ended_on_workers(client2, sid)[mesh.workers[1]] not in ("open", None), 10), \
        ended_on_workers(client2, sid)
    assert "the controller ended the session" in ended_on_workers(client2, sid)[mesh.workers[1]]


def test_a_busy_rank_that_stops_during_exit_fails_it_within_the_heartbeat_bound(client2):
    mesh = dm.attach(client2, dims={"dp": 2}, comm_timeout=60, heartbeat_timeout=5)
    with mesh.activate():
        dm.remote(sleep_on_rank_one, propagate="inspect")(mesh, 20)
    victim = mesh.workers[1]
    victim_pid = client2.run(pid)[victim]
    sigstop(victim_pid)
    try:
        start = time.monotonic()
        with pytest.raises(dm.SessionError, match=rf"rank 1 \({victim}\) has sent no heartbeat"):
            mesh.exit()
        assert time.monotonic() - start < 30
    finally:
        os.kill(victim_pid, signal.SIGCONT)


def test_leaving_the_block_on_an_exception_waits_for_busy_work_only_briefly(client2, monkeypatch):
    """The program's own error (an exception, Ctrl-C) leaves ``with mesh:`` after at most the short bound
    (``EXIT_ON_ERROR_TIMEOUT``), not ``exit_timeout``: the exception propagates and the session still ends there."""
    monkeypatch.setattr(dm.DeviceMesh, "EXIT_ON_ERROR_TIMEOUT", 2.0)
    mesh = dm.attach(client2, dims={"dp": 2}, comm_timeout=60, exit_timeout=300)
    sid = mesh.session_id
    start = time.monotonic()
    with pytest.raises(KeyError, match="the program's own error"):
        with mesh:
            with mesh.activate():
                dm.remote(sleep_on_rank_one, propagate="inspect")(mesh, 20)
            raise KeyError("the program's own error")
    assert time.monotonic() - start < 15
    assert wait_until(lambda: "open" not in ended_on_workers(client2, sid).values(), 10), \
        ended_on_workers(client2, sid)
