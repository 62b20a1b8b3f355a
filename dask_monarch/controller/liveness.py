"""Liveness of a session (``Session``'s concern ``Liveness``; spec/dask-notes.md §5): whether the mesh's workers are
still there, and who did not answer.

A wait checks every ``liveness_interval`` that each rank's worker is still in the cluster, not shutting down, not
restarted (the process the rank was pinned to at attach, ``pin_workers``) and sending the scheduler heartbeats
(``heartbeat_timeout``); a wait that runs out of time names the ranks that did not answer and what their workers
report (``describe_pending``). Every question to the scheduler or a worker is bounded (``PROBE_TIMEOUT``): a
stopped worker is named, not waited for.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

from ..exceptions import SessionError
from ..worker.plugin import session_state

__all__ = ["Liveness", "quiet_reconnect", "scheduler_gone"]

#: what the worker's failure text says when a collective or a communicator failed (``worker/comm.py``)
_COMM_FAILURE = re.compile(r"communicator|among .+ (failed|abandoned)|comm_timeout")

#: statuses of a Dask worker that is going away (``distributed.core.Status``)
_CLOSING = ("closing", "closing_gracefully", "closed", "stopping", "stopped", "failed")


def scheduler_gone(client) -> str:
    """Why ``client``'s Dask scheduler is gone, as text, or ``""``: the ``Client``'s own connection to it closed
    (the Client then tries to reconnect: ``Client.status`` is ``"connecting"``), which happens at once when the
    scheduler's process dies. A scheduler that comes back is a new one, without the session (Dask keeps no state
    across a scheduler restart). A Client the program closed itself is not reported here."""
    status = getattr(client, "status", None)
    comm = getattr(getattr(client, "scheduler_comm", None), "comm", None)
    try:
        closed = comm is not None and comm.closed()
    except Exception:
        closed = False
    if status == "connecting" or (status == "running" and closed):
        address = getattr(getattr(client, "scheduler", None), "address", "?")
        return (f"the Dask scheduler is gone: the Client's connection to it ({address}) closed, so the session's "
                "state there (its tasks, rendezvous and workers' sessions) is lost")
    return ""


class _QuietReconnect(logging.Filter):
    """Drops what Dask's ``Client`` logs at ERROR when the program closes a Client that is still trying to reconnect
    to a scheduler that died: the ``CancelledError`` of its reconnect, with its traceback (``distributed.utils.
    log_errors`` around ``Client._reconnect``), or "Failed to reconnect to scheduler after 30.00 seconds, closing
    client" (which it also says when the program closed it sooner). Installed on logger ``distributed.client``
    once a session has reported that death (``quiet_reconnect``), whose error already says it; nothing else is
    dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError):
            return False
        return not (isinstance(record.msg, str) and record.msg.startswith("Failed to reconnect to scheduler"))


_QUIET_RECONNECT = _QuietReconnect()


def quiet_reconnect() -> None:
    """Install ``_QuietReconnect`` (once: ``Logger.addFilter`` adds a filter once)."""
    logging.getLogger("distributed.client").addFilter(_QUIET_RECONNECT)


class Liveness:
    """The session's liveness checks (a part of ``Session``; see the module's docstring)."""

    #: how long a diagnostic question to a worker or the scheduler may take (the liveness check of a wait allows
    #: the scheduler ``heartbeat_timeout``)
    PROBE_TIMEOUT = 5.0

    def describe_pending(self, seq: int, diagnose: bool = False) -> str:
        """Which ranks have not answered ``Status`` past ``seq``; with ``diagnose``, how long ago each sent the
        scheduler a heartbeat, what its worker reports about this session (inbox position, stream queues,
        failure) and what it is busy on. Every question is bounded (``PROBE_TIMEOUT``): a stopped worker is named,
        not waited for.

        A host's relay sends the controller its ranks' lowest ``Status`` (``worker/relay.py``), so one busy rank
        holds back the answers of every rank of its host. With ``diagnose``, a rank whose worker says it has passed
        ``seq`` (``session_state``'s ``status_seq``) is told apart from those that have not: only these are named
        as not answering (with what they are busy on), the others listed as passed."""
        late = [r for r in range(self.world_size) if self.history.first_incomplete[r] <= seq]
        if not (diagnose and late):
            who = ", ".join(f"rank {r} ({self.workers[r]})" for r in late)
            return f"no Status past seq {seq} from {who or 'nobody (answers are being processed)'}"
        try:
            ages = self._worker_ages(self.PROBE_TIMEOUT)[0]
        except Exception:
            ages = {}
        states = self._probe_workers([self.workers[r] for r in late])
        passed = [r for r in late if isinstance(states[self.workers[r]], dict)
                  and states[self.workers[r]].get("status_seq", 0) > seq]
        waiting = [r for r in late if r not in passed]
        who = ", ".join(f"rank {r} ({self.workers[r]}) {_busy_text(states[self.workers[r]])}" for r in waiting)
        text = f"no Status past seq {seq} from {who or 'nobody any more (the answers were on their way)'}"
        if passed:
            text += (f"; rank(s) {', '.join(map(str, passed))} passed it on their workers (their answers wait in "
                     "their host's relay for its slowest rank, or were on their way)")
        for r in waiting:
            address = self.workers[r]
            age = ages.get(address)
            beat = "" if age is None else f"last heartbeat {age:.1f} s ago; "
            state = states[address]
            text += (f"\n  {address}: {beat}{state if isinstance(state, str) else repr(state)}; "
                     f"batches sent to it: {self._batch_seq[r]}")
        return text

    def describe_busy(self, seq: int) -> str:
        """The ranks that have not answered ``Status`` past ``seq`` and what each one's worker says it applies now
        (``session_state``'s ``busy``; asked in parallel, each bounded by ``PROBE_TIMEOUT``): ``rank 1
        (tcp://...) on CallFunction seq 3: __main__.train (main, busy 12 s)``."""
        late = [r for r in range(self.world_size) if self.history.first_incomplete[r] <= seq]
        states = self._probe_workers([self.workers[r] for r in late]) if late else {}
        parts = []
        for r in late:
            state = states.get(self.workers[r])
            parts.append(f"rank {r} ({self.workers[r]}) " + _busy_text(state))
        return "; ".join(parts) or "nobody (answers are being processed)"

    def _probe_workers(self, addresses: list) -> dict:
        """``session_state`` of each worker (a dict), or why it could not be asked (a str), asked one by one in
        parallel, each bounded by ``PROBE_TIMEOUT``."""
        timeout = self.PROBE_TIMEOUT
        client = self.client
        gone = self.scheduler_gone()
        if gone:  # the workers are asked through the scheduler
            return {a: f"could not be asked: {gone}" for a in addresses}

        async def ask(address):
            try:
                answer = await asyncio.wait_for(
                    client._run(session_state, self.id, workers=[address], on_error="return"), timeout
                )
                return answer.get(address, answer)
            except asyncio.TimeoutError:
                return f"did not answer within {timeout:g} s (stopped, hung or unreachable)"
            except Exception as e:
                return f"could not be asked: {type(e).__name__}: {e}"

        async def ask_all():
            return dict(zip(addresses, await asyncio.gather(*(ask(a) for a in addresses))))

        try:
            return client.sync(ask_all, callback_timeout=timeout + 5)
        except Exception as e:
            return {a: f"could not be asked: {type(e).__name__}: {e}" for a in addresses}

    def _worker_ages(self, timeout: float | None = None) -> tuple[dict, float, dict, dict]:
        """(seconds since each mesh worker's last heartbeat, or None if it left; the heartbeat interval; the id
        of each worker's process, or None; each worker's status, e.g. ``"closing"``), from the scheduler, bounded
        by ``timeout`` (default ``heartbeat_timeout``: a scheduler busy with a large graph may take seconds to
        answer, and a silent scheduler is judged like a silent worker)."""
        timeout = self.heartbeat_timeout if timeout is None else timeout
        gone = self.scheduler_gone()
        if gone:  # a question would wait for its connect timeout
            raise ConnectionError(gone)
        answer = self.client.sync(
            self.client.scheduler.monarch_worker_ages, workers=self.workers, callback_timeout=timeout
        )
        if answer is None:  # the scheduler runs an older dask_monarch without the handler: membership only
            info = self.client.sync(self.client.scheduler.identity, callback_timeout=timeout)
            known = info.get("workers", {})
            ids = {a: known[a].get("id") if a in known else None for a in self.workers}
            return {a: (0.0 if a in known else None) for a in self.workers}, 0.0, ids, {}
        return answer["ages"], float(answer["interval"]), answer.get("ids", {}), answer.get("status", {})

    def pin_workers(self) -> None:
        """Remember the process behind each rank's address (the scheduler's worker id), so that one restarted
        at the same address (fixed ports: the nanny brings it back there) is told apart from it."""
        try:
            self._worker_ids = dict(self._worker_ages()[2])
        except Exception:
            self._worker_ids = None  # the first liveness check pins them

    def _unhealthy(self, ages: dict, interval: float, ids: dict | None = None, status: dict | None = None) -> str:
        """The ranks whose worker left the cluster, is shutting down or was restarted, else those silent for
        more than ``heartbeat_timeout`` (and ten heartbeat intervals), as text; empty if all look alive."""
        gone = [(r, a) for r, a in enumerate(self.workers) if ages.get(a, 0.0) is None]
        if gone:
            names = ", ".join(f"rank {r} ({a})" for r, a in gone)
            return f"worker(s) left the cluster: {names}"
        closing = [(r, a) for r, a in enumerate(self.workers) if (status or {}).get(a) in _CLOSING]
        if closing:
            names = ", ".join(f"rank {r} ({a})" for r, a in closing)
            return f"worker(s) shutting down (closed, restarted or retired): {names}"
        pinned = self._worker_ids
        if ids and pinned is None:
            self._worker_ids = pinned = dict(ids)
        if ids and pinned:
            new = [(r, a) for r, a in enumerate(self.workers)
                   if ids.get(a) and pinned.get(a) and ids.get(a) != pinned.get(a)]
            if new:
                names = ", ".join(f"rank {r} ({a})" for r, a in new)
                return (f"{names} was restarted (a new worker process at the same address): the session's state "
                        "there is gone")
        limit = max(self.heartbeat_timeout, 10 * interval)
        stale = [(r, a, ages[a]) for r, a in enumerate(self.workers) if (ages.get(a) or 0.0) > limit]
        if stale:
            names = ", ".join(f"rank {r} ({a}) has sent no heartbeat to the Dask scheduler for {age:.0f} s"
                              for r, a, age in stale)
            return (f"{names} (heartbeat_timeout={self.heartbeat_timeout:g} s): its process is stopped, hung or "
                    "its event loop is blocked")
        return ""

    def scheduler_gone(self) -> str:
        """Why the Dask scheduler is gone, as text, or ``""`` (``scheduler_gone(self.client)``)."""
        return scheduler_gone(self.client)

    def watch_scheduler(self) -> None:
        """Fail the session if the scheduler is gone (``scheduler_gone``). Cheap (no question to anyone): the
        answers thread calls it every ``SCHEDULER_WATCH`` seconds, so a session fails within that of the scheduler's
        death even while the program waits for nothing."""
        if self.failure is not None or self.closed:
            return
        gone = self.scheduler_gone()
        if gone:
            self._fail(SessionError(f"session {self.id}: {gone}"))

    #: seconds between the answers thread's checks of the Client's connection to the scheduler (``watch_scheduler``)
    SCHEDULER_WATCH = 0.25

    def check_alive(self) -> None:
        """Raise ``SessionError`` if the session failed, the scheduler is gone (``scheduler_gone``), a worker of the
        mesh left the cluster, or one has been silent for longer than ``heartbeat_timeout`` (a stopped process,
        which Dask keeps for its worker-ttl)."""
        if self.failure is not None:
            raise self.failure
        self.watch_scheduler()
        if self.failure is not None:
            raise self.failure
        try:
            ages, interval, ids, status = self._worker_ages()
        except Exception as e:
            err = SessionError(f"session {self.id}: the Dask scheduler is unreachable: {type(e).__name__}: {e}")
            self._fail(err)
            raise err from None
        problem = self._unhealthy(ages, interval, ids, status)
        if problem:
            err = SessionError(f"session {self.id}: {problem}; the mesh cannot continue")
            self._fail(err)
            raise err

    #: seconds a failure in a collective waits for the scheduler to notice the peer it lost (see ``_departed``)
    PEER_GRACE = 3.0

    def _meanwhile(self) -> str:
        """``"\\n(meanwhile: ...)"`` with what ``_departed`` finds, or ``""``."""
        problem = self._departed()
        return f"\n(meanwhile: {problem})" if problem else ""

    def _departed(self, failure: str = "") -> str:
        """The ranks whose worker left, is shutting down, restarted or went silent, as the scheduler sees it, as
        text, or ``""``. When ``failure`` (a rank's error) is a failed collective, whose text names only a
        socket ("Connection closed by peer [127.0.0.1]:44187"), the scheduler is asked again for up to
        ``PEER_GRACE`` seconds: the surviving rank may report the loss before the scheduler has seen its peer
        go. Each question is bounded by ``PROBE_TIMEOUT``."""
        deadline = time.monotonic() + (self.PEER_GRACE if self.world_size > 1 and _COMM_FAILURE.search(failure) else 0)
        while True:
            try:
                problem = self._unhealthy(*self._worker_ages(self.PROBE_TIMEOUT))
            except Exception:
                problem = ""
            if problem or time.monotonic() >= deadline:
                return problem
            time.sleep(0.25)

    def _failed_on(self, rank: int, text: str, departed: str) -> SessionError:
        """The error of rank ``rank``'s ``SessionFailed``: led by the workers that left, are shutting down or
        restarted when the scheduler names some (``departed``, from ``_departed``), since what the rank itself
        saw of that is often only a socket ("Connection closed by peer [127.0.0.1]:44187")."""
        where = f"rank {rank} ({self.workers[rank]})"
        if departed:
            return SessionError(f"session {self.id}: {departed}; the mesh cannot continue ({where} reported: {text})")
        return SessionError(f"session {self.id} failed on {where}: {text}")


def _busy_text(state) -> str:
    """What a worker's ``session_state`` says its session's threads apply, as text (``describe_busy``)."""
    if not isinstance(state, dict):
        return f"(its worker {state if isinstance(state, str) else repr(state)})"
    busy = state.get("busy")
    if busy is None:
        return f"({state})"
    streams = [e for e in busy if e["stream"] != "dispatcher"] or busy
    if not streams:
        return "(nothing running there now)"
    parts = []
    for e in streams:
        what = " ".join(p for p in (e["kind"], f"seq {e['seq']}" if e["seq"] is not None else "") if p)
        if e["name"]:
            what += f": {e['name']}"
        where = "main" if e["stream"] == "0" else ("the dispatcher" if e["stream"] == "dispatcher" else
                                                  f"stream {e['stream']}")
        parts.append(f"{what} ({where}, busy {e['for_s']:.0f} s)")
    return "on " + ", ".join(parts)
