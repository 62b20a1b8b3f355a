"""``MonarchWorkerPlugin`` and the task functions that carry controller messages to it
(DESIGN.md "Seed concept -> Dask concept").

The controller sends each worker its messages as pinned Dask tasks:

* ``deliver_batch`` (key ``monarch-messages-...``, ``async``): hands a batch to the session's inbox and returns.
* ``sync_batch`` (keys ``monarch-fetch-...``, ``monarch-status-...``, ``monarch-exit-...``): hands its batch over (which ends with ``RequestStatus{seq}``),
  secedes from the worker's thread pool so it never blocks other tasks, waits for ``Status{seq + 1}``, and
  returns the pickled outbox (``RemoteFunctionFailed``, ``FetchResult``, ``Status``, ``SessionFailed``, ...).
"""

from __future__ import annotations

import pickle
import threading

import cloudpickle

from distributed import get_worker, secede
from distributed.diagnostics.plugin import WorkerPlugin

from .. import interpreter
from ..protocol import FetchResult, SessionFailed, WorkerError
from . import prometheus
from .metrics import worker_snapshot
from .tensor_worker import SessionParams, TensorWorker

__all__ = ["MonarchWorkerPlugin", "PLUGIN_NAME", "METRICS_KEY", "deliver_batch", "sync_batch"]

PLUGIN_NAME = "dask-monarch"
#: worker stream-handler op that ends a session (sent through ``Scheduler.worker_send``)
END_SESSION_OP = "monarch-end-session"
#: the key of dask_monarch's numbers in ``worker.metrics`` (sent with every heartbeat; ``worker/metrics.py``)
METRICS_KEY = "monarch"
_CLOSED_MEMORY = 1024


class MonarchWorkerPlugin(WorkerPlugin):
    """Installs the tensor-worker state machine in a Dask worker: one ``TensorWorker`` per controller session,
    created on the session's first task. Idempotent: a second controller's registration keeps this instance.
    Reports its sessions' numbers with every heartbeat (``worker.metrics["monarch"]``) and on the worker's
    Prometheus ``/metrics`` endpoint.

    While sessions run, the worker holds dask_monarch's interpreter settings (``interpreter.py``: gen-0 of the GC
    threshold raised to Dask config ``monarch.gc-threshold``, the GIL switch interval lowered to
    ``monarch.switch-interval``), and gives Python's back when the last session ends."""

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker) -> None:
        self.worker = worker
        self.sessions: dict[str, TensorWorker] = {}
        self.closed: dict[str, str | None] = {}  # ended session -> its failure text, or None
        self._lock = threading.Lock()
        worker.stream_handlers[END_SESSION_OP] = self.end_session
        worker.metrics[METRICS_KEY] = self.metrics
        prometheus.register(self)

    def metrics(self, worker) -> dict:
        """The heartbeat metric (``worker_snapshot``)."""
        return worker_snapshot(self)

    def end_session(self, session_id: str, reason: str) -> None:
        """Stream handler (sent by the scheduler plugin when a controller disappears): fail and close the
        session here, on a thread, since closing joins the session's threads."""
        tw = self.sessions.get(session_id)
        if tw is None:
            # not (or no longer) running here: remember it as ended, so a batch still on its way (the session's
            # first one, when attach failed right after creating it) cannot start it afterwards
            with self._lock:
                tw = self.sessions.get(session_id)
                if tw is None:
                    self.closed.setdefault(session_id, reason)
                    self._trim_closed()
                    return

        def end():
            tw.fail(reason)
            tw.close(join_timeout=1.0)

        threading.Thread(target=end, name=f"monarch-{session_id[:8]}-end", daemon=True).start()

    def teardown(self, worker) -> None:
        if worker.metrics.get(METRICS_KEY) == self.metrics:
            del worker.metrics[METRICS_KEY]
        prometheus.unregister(self)
        for tw in list(self.sessions.values()):
            tw.fail("the Dask worker is shutting down")
            tw.close(join_timeout=1.0)

    def tensor_worker(self, params) -> TensorWorker | None:
        """The session's ``TensorWorker``, created on first use; None if the session already ended here, or if it
        began on another process at this address (``options["worker_id"]``, the Dask id of the worker the
        controller pinned the rank to): a worker restarted at the same address (a nanny restart with a fixed
        port, ``Client.restart_workers``, ``Client.restart``) runs the tasks the scheduler re-sends it, and must
        not start the session anew there, with an inbox waiting for batches that went to the dead process."""
        session_id = params[0]
        tw = self.sessions.get(session_id)
        if tw is not None:
            return tw
        with self._lock:
            tw = self.sessions.get(session_id)
            if tw is None and session_id not in self.closed:
                session_id, rank, world_size, options = params
                expected = options.get("worker_id")
                if expected and expected != self.worker.id:
                    self.closed[session_id] = (
                        f"the Dask worker at {self.worker.address} was restarted after session {session_id} began "
                        f"(this process is {self.worker.id}, rank {rank} began on {expected}): the session's state "
                        "there is gone"
                    )
                    self._trim_closed()
                    return None
                first = not self.sessions
                if first:  # before the session's threads start: a bad config value fails here, leaving nothing
                    interpreter.hold(gc_threshold=True)
                try:
                    tw = TensorWorker(self.worker, session_id, rank, world_size, options, on_close=self._forget)
                except BaseException:
                    if first:
                        interpreter.release(gc_threshold=True)
                    raise
                self.sessions[session_id] = tw
            return tw

    def _forget(self, session_id: str, failure: str | None = None) -> None:
        with self._lock:
            removed = self.sessions.pop(session_id, None) is not None
            self.closed[session_id] = failure
            self._trim_closed()
            if removed and not self.sessions:
                interpreter.release(gc_threshold=True)

    def _trim_closed(self) -> None:
        while len(self.closed) > _CLOSED_MEMORY:
            self.closed.pop(next(iter(self.closed)))


def session_state(session_id: str, dask_worker=None) -> dict:
    """What this worker knows of a session, for diagnosing a wait that ran out of time (run with
    ``Client.run``): the inbox position, per-stream queues, the last status, the failure."""
    plugin = (dask_worker or get_worker()).plugins.get(PLUGIN_NAME)
    tw = plugin.sessions.get(session_id) if plugin is not None else None
    if tw is None:
        closed = plugin is not None and session_id in plugin.closed
        return {"session": "closed" if closed else "unknown on this worker"}
    return {
        "next_batch": tw.inbox.next_batch,
        "batches_held_back": tw.inbox.waiting(),
        "messages_received": tw.received,
        "status_seq": tw.completed_seq,
        "streams": {sid: {"queued_batches": s.backlog(), "applied": s.applied} for sid, s in tw.streams.items()},
        "failure": tw.failure,
    }


def _plugin() -> MonarchWorkerPlugin:
    worker = get_worker()
    plugin = worker.plugins.get(PLUGIN_NAME)
    if plugin is None:
        raise RuntimeError(
            f"dask_monarch's WorkerPlugin is not installed on worker {worker.address}; attach through "
            "dask_monarch.attach(), which registers it"
        )
    return plugin


async def deliver_batch(params: SessionParams, batch_seq: int, segments: list) -> int:
    """Hand batch ``batch_seq`` (pickled message segments) to the session's inbox. Returns the message count
    estimate of segments delivered (0 if the session already ended on this worker)."""
    tw = _plugin().tensor_worker(params)
    if tw is None:
        return 0
    tw.inbox.put(batch_seq, segments)
    return len(segments)


def sync_batch(params: SessionParams, batch_seq: int, segments: list, status_seq: int, exit: bool = False) -> bytes:
    """Deliver batch ``batch_seq``, whose last message is ``RequestStatus{status_seq}`` (then ``Exit`` if
    ``exit``), then wait (seceded) for ``Status{status_seq + 1}`` (and for the session to close if ``exit``) and
    return the pickled ``(chunk, messages)``: the controller messages collected so far and the number of this
    drain of the outbox (``TensorWorker.drain``); ``chunk`` is None when the session had already ended here."""
    plugin = _plugin()
    tw = plugin.tensor_worker(params)
    if tw is None:
        text = plugin.closed.get(params[0]) or f"session {params[0]} already ended on this worker"
        return pickle.dumps((None, [SessionFailed(WorkerError(text, get_worker().address))]))
    secede()
    tw.inbox.put(batch_seq, segments)
    tw.wait_status(status_seq)
    if exit:
        tw.wait_closed()
    chunk, messages = tw.drain()
    return _dumps_outbox(chunk, messages, tw.actor_id)


def _dumps_outbox(chunk: int, messages: list, actor_id: str) -> bytes:
    """Pickle ``(chunk, messages)``; a fetched value that cannot be pickled becomes that fetch's error, nothing
    is lost."""
    try:
        return pickle.dumps((chunk, messages), protocol=5)
    except Exception:
        pass
    safe = []
    for msg in messages:
        try:
            cloudpickle.dumps(msg, protocol=5)
        except Exception as e:
            if not isinstance(msg, FetchResult):
                raise
            text = f"the fetched value of type {type(msg.value).__name__} cannot be pickled: {type(e).__name__}: {e}"
            msg = FetchResult(msg.seq, error=WorkerError(text, actor_id))
        safe.append(msg)
    return cloudpickle.dumps((chunk, safe), protocol=5)
