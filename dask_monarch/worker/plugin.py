"""``MonarchWorkerPlugin`` and the task functions that carry controller messages to it
(DESIGN.md "Seed concept -> Dask concept").

The controller sends each worker its messages as pinned Dask tasks, each carrying one batch or, when the session
has an answer channel to the worker (``worker/channel.py``, whose handler this plugin adds), the batches sent on
the channel meanwhile:

* ``deliver_batch`` / ``deliver_batches`` (key ``monarch-<session>-messages-...``, ``async``): hands its batches to the
  session's inbox (which ignores a batch it already has) and returns.
* ``sync_batch`` / ``sync_batches`` (keys ``monarch-<session>-fetch-...``, ``-status-...``, ``-exit-...``):
  hands its batches over (the last ends with ``RequestStatus{seq}``), secedes from the worker's thread pool so it
  never blocks other tasks, waits for ``Status{seq + 1}``, and returns the outbox's chunks that the channel did
  not deliver (``Outbox.for_task``: ``RemoteFunctionFailed``, ``FetchResult``, ``Status``, ``SessionFailed``,
  ...), each pickled on its own.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import time

from distributed import get_worker, secede
from distributed.diagnostics.plugin import WorkerPlugin

from .. import interpreter
from ..protocol import SessionFailed, WorkerError
from ..protocol.frames import receivable
from ..protocol.session_id import session_tag
from . import activity, debugger, log_filter, prometheus
from .channel import CHANNEL_OP, serve
from .metrics import worker_snapshot
from .relay import RELAY_OP, HostRelay
from .tensor_worker import SessionParams, TensorWorker

__all__ = ["MonarchWorkerPlugin", "PLUGIN_NAME", "METRICS_KEY", "deliver_batch", "deliver_batches", "sync_batch",
           "sync_batches", "SETTLE"]

PLUGIN_NAME = "dask-monarch"
#: worker stream-handler op that ends a session (sent through ``Scheduler.worker_send``)
END_SESSION_OP = "monarch-end-session"
#: the key of dask_monarch's numbers in ``worker.metrics`` (sent with every heartbeat; ``worker/metrics.py``)
METRICS_KEY = "monarch"
_CLOSED_MEMORY = 1024
#: seconds a closing worker waits for its session threads to end (``join_session_threads``): less than the 4 s
#: to 5 s a closing nanny gives its worker process before it kills it
TEARDOWN_JOIN = 3.0
#: seconds a sync task waits for the answer channel's pushes under way to be acknowledged (``Outbox.for_task``)
SETTLE = 2.0


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
        self.relays: dict[str, HostRelay] = {}  # session -> this host's relay, on its leader
        worker.stream_handlers[END_SESSION_OP] = self.end_session
        worker.handlers[CHANNEL_OP] = self.channel
        worker.handlers[RELAY_OP] = self.relay
        worker.metrics[METRICS_KEY] = self.metrics
        prometheus.register(self)
        debugger.install()  # breakpoint() in a remote function: pdb on the rank, driven from the controller
        log_filter.install(worker)  # the heartbeat a closing worker cuts short itself: DEBUG, not an ERROR traceback

    def metrics(self, worker) -> dict:
        """The heartbeat metric (``worker_snapshot``)."""
        return worker_snapshot(self)

    async def channel(self, comm, params: bytes, sockets: bool = False) -> None:
        """Handler ``monarch_channel``: serve a session's answer channel on ``comm``, and with ``sockets`` offer its
        answer sockets (``worker/channel.py``, ``worker/sockets.py``)."""
        await serve(self, comm, params, sockets)

    async def relay(self, comm, params: bytes, offers: bytes, children: bytes | None = None) -> None:
        """Handler ``monarch_relay``: start this host's relay of a session on its leader (``worker/relay.py``),
        connected to the answer sockets ``offers`` (pickled ``{rank: offer}``) of the host's ranks, and to the
        sub-relays ``children`` (pickled ``{leader: {"offer": offer, "ranks": [rank, ...]}}``, on a host of more
        ranks than Dask config ``monarch.relay-fanout``), and answer ``{"ready": offer}`` (the relay's own sockets)
        or ``{"refused": why}``. A sub-relay is started the same way, without ``children``."""
        params, offers = pickle.loads(params), pickle.loads(offers)
        children = pickle.loads(children) if children is not None else None
        session_id, rank = params[0], params[1]
        worker = self.worker
        try:
            if self.tensor_worker(params) is None:
                raise RuntimeError(f"session {session_id} already ended on this worker")
            host = offers[min(offers)]["host"]
            listen = worker.security.get_listen_args("worker").get("ssl_context")
            connect = worker.security.get_connection_args("worker").get("ssl_context")
            limit = receivable(worker.memory_manager.memory_limit)
            relay = await asyncio.to_thread(HostRelay, session_id, rank, offers, host, listen, connect, limit,
                                            children)
        except Exception as e:
            await comm.write({"refused": f"{type(e).__name__}: {e}"})
            return
        old = self.relays.pop(session_id, None)
        if old is not None:
            old.close()
        if session_id not in self.sessions:  # it ended meanwhile
            relay.close()
            await comm.write({"refused": f"session {session_id} ended on this worker meanwhile"})
            return
        self.relays[session_id] = relay
        await comm.write({"ready": relay.offer})

    def end_session(self, session_id: str, reason: str, owner_left: bool = False, clean: bool = False) -> None:
        """Stream handler (sent by the scheduler plugin when a controller disappears): fail and close the
        session here, on a thread, since closing joins the session's threads. ``owner_left``: its controller's
        Client disconnected (a program that closed its own Client, or one that died): logged as an end, not an
        error of this worker. ``clean``: the controller closed the session after a clean exit; a rank still ending
        on that clean ``Exit`` here (its streams done, its session not yet forgotten) is left to end cleanly, not
        failed: the controller's exit returns once every rank passed the exit's ``RequestStatus``, which can be
        before this rank has finished closing."""
        tw = self.sessions.get(session_id)
        if clean and tw is not None and tw.failure is None and (tw.exiting or tw.closed):
            return
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
            tw.fail(reason, owner_left=owner_left)
            tw.close(join_timeout=1.0)

        threading.Thread(target=end, name=f"monarch-{session_tag(session_id)}-end", daemon=True).start()

    def teardown(self, worker):
        """The worker closes (or the plugin is removed): fail and close every session here, then wait, off the event
        loop, up to ``TEARDOWN_JOIN`` seconds for this process's session threads to end (``join_session_threads``).
        Dask awaits the returned coroutine before the worker process goes on to exit."""
        if worker.metrics.get(METRICS_KEY) == self.metrics:
            del worker.metrics[METRICS_KEY]
        prometheus.unregister(self)
        for relay in list(self.relays.values()):
            relay.close()
        for tw in list(self.sessions.values()):
            tw.fail("the Dask worker is shutting down")
            tw.close(join_timeout=1.0)
        return asyncio.to_thread(join_session_threads, TEARDOWN_JOIN)

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
        self.relays.pop(session_id, None)  # it ends by itself once every rank of the host has ended (relay.py)
        with self._lock:
            removed = self.sessions.pop(session_id, None) is not None
            self.closed[session_id] = failure
            self._trim_closed()
            if removed and not self.sessions:
                interpreter.release(gc_threshold=True)

    def _trim_closed(self) -> None:
        while len(self.closed) > _CLOSED_MEMORY:
            self.closed.pop(next(iter(self.closed)))


def join_session_threads(timeout: float) -> list[str]:
    """Wait up to ``timeout`` seconds for every session thread of this process (named ``monarch-...``: streams,
    dispatchers, answer sockets, relays, pipes, the threads that end sessions) to end; returns the names of those
    still running then.

    A thread that closes a session drops its process groups (``Comms.abort``/``shutdown``); pybind11 runs
    ``ProcessGroupGloo``'s destructor with the GIL released (torch 2.13: ``IntrusivePtrNoGilDestructor``). If the
    interpreter finalizes meanwhile (the worker's close returned), CPython before 3.14 ends that daemon thread with
    ``pthread_exit`` as it takes the GIL back, whose unwinding through the destructor's ``noexcept`` frames aborts
    the process: "terminate called without an active exception" (seen in a worker whose controller closed its
    Client and exited at once; the end thread's close was still under way, and the teardown's own ``close``
    returned at once, since the session was closing already)."""
    deadline = time.monotonic() + timeout
    me = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not me and thread.name.startswith("monarch-"):
            thread.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in threading.enumerate() if t is not me and t.name.startswith("monarch-") and t.is_alive()]


def session_state(session_id: str, dask_worker=None) -> dict:
    """What this worker knows of a session, for diagnosing a wait that ran out of time or takes long (run with
    ``Client.run``): the inbox position, per-stream queues, the last status, the failure, whether it is ending
    here (``exiting``) and what its busy threads apply (``busy``: ``activity.observe``'s entries of the busy ones,
    ``{"stream", "kind", "seq", "name", "for_s", ...}``)."""
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
        "exiting": tw.exiting,
        "busy": [e for e in activity.observe(tw) if e["busy"]],
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
    return await deliver_batches(params, [(batch_seq, segments)])


async def deliver_batches(params: SessionParams, batches: list) -> int:
    """Hand ``batches`` (``(batch_seq, segments)`` pairs) to the session's inbox, which ignores those it already has
    (they came on the answer channel) and the receipts (None: the batch came through its host's relay). Returns the
    number of segments (0 if the session already ended here)."""
    tw = _plugin().tensor_worker(params)
    if tw is None:
        return 0
    for batch_seq, segments in batches:
        tw.inbox.put(batch_seq, segments)
    return sum(len(segments) for _, segments in batches if segments is not None)


def sync_batch(params: SessionParams, batch_seq: int, segments: list, status_seq: int, exit: bool = False) -> list:
    """``sync_batches`` of the one batch ``batch_seq``."""
    return sync_batches(params, [(batch_seq, segments)], status_seq, exit)


def sync_batches(params: SessionParams, batches: list, status_seq: int, exit: bool = False) -> list:
    """Deliver ``batches`` (``(batch_seq, segments)`` pairs), the last of which ends with ``RequestStatus{status_seq}``
    (then ``Exit`` if ``exit``), then wait (seceded) for ``Status{status_seq + 1}`` (and for the session to close if
    ``exit``) and return the answer chunks that the channel did not deliver, each pickled ``(chunk, messages)``
    (``Outbox.for_task``): ``[]`` when it delivered everything; ``chunk`` is None when the session had already
    failed or ended here because of another process (a chunk that fails the session at the controller). A task of a
    session that this worker ended cleanly (after ``Exit``) finds nothing to do: ``[]``."""
    plugin = _plugin()
    tw = plugin.tensor_worker(params)
    if tw is None:
        if params[0] in plugin.closed and plugin.closed[params[0]] is None:
            return []
        text = plugin.closed.get(params[0]) or f"session {params[0]} already ended on this worker"
        return [pickle.dumps((None, [SessionFailed(WorkerError(text, get_worker().address))]))]
    secede()
    for batch_seq, segments in batches:
        tw.inbox.put(batch_seq, segments)
    tw.wait_status(status_seq)
    if exit:
        tw.wait_closed()
    return tw.outbox.for_task(SETTLE)
