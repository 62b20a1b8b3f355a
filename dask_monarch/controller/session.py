"""``Session``: one controller's connection to its mesh of Dask workers (DESIGN.md "Layout").

A session is three concerns, each a module:

* ``transport.py`` (``Transport``): batching, flushing, and applying the answers;
* ``bookkeeping.py`` (``Bookkeeping``): seqs and refs, aliases, borrows, the deferred list, history;
* ``liveness.py`` (``Liveness``): heartbeats, probes, the workers the ranks were pinned to.

This module joins them and holds what spans them: the parameters, waits (``sync``), failure (``_fail``) and the
session's end (``close``, ``stop``). Below it are ``protocol`` and the session's helpers (``history``,
``answers``, ``coalescing``, ``propagation``, ``local``, ``task_keys``); the mesh and the frontend sit above it
and it imports neither.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import dask
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .. import interpreter
from ..exceptions import RemoteException, SessionError
from ..protocol import ArgsKwargs, CallFunction, CreateStream, FunctionPath, StreamCreationMode, StreamRef
from ..protocol.session_id import new_session_id, session_tag
from ..worker.tensor_worker import SessionParams
from .answers import Answers
from .channel import MODES, Channels
from .bookkeeping import Bookkeeping
from .debugger import Debugger
from .coalescing import refuse_wait
from .future import MonarchFuture
from .liveness import Liveness, quiet_reconnect
from .propagation import Propagator
from .transport import Transport

__all__ = ["Session", "MonarchFuture", "DEFAULT_STREAM"]

_SET_DEFAULT_DTYPE = FunctionPath("torch.set_default_dtype")

logger = logging.getLogger("dask_monarch.controller")

#: The stream every session creates first (Monarch's ``Stream("main", _default=True)``).
DEFAULT_STREAM = StreamRef(0)
#: seconds ``mesh.exit()`` waits for busy ranks by default (Dask config ``monarch.exit-timeout``)
DEFAULT_EXIT_TIMEOUT = 600.0


def _local_ranks(workers: list[str]) -> list[int]:
    """Each rank's position among the session's ranks on the same host (which GPU it takes when its worker sees
    every GPU of the host; ``worker/device.py``)."""
    from distributed.comm import get_address_host

    seen: dict = {}
    local = []
    for address in workers:
        try:
            host = get_address_host(address)
        except Exception:
            host = address
        local.append(seen.get(host, 0))
        seen[host] = local[-1] + 1
    return local


def _local_world_size(workers: list[str], local_ranks: list[int], rank: int) -> int:
    """How many of the session's ranks share ``rank``'s host (``LOCAL_WORLD_SIZE``)."""
    from distributed.comm import get_address_host

    def host(address):
        try:
            return get_address_host(address)
        except Exception:
            return address

    mine = host(workers[rank])
    return sum(1 for a in workers if host(a) == mine)


class Session(Transport, Bookkeeping, Liveness):
    """One controller session over ``workers`` (Dask worker address per rank) on ``client``.

    ``comm_timeout`` (seconds) bounds rendezvous and collectives on the workers; ``max_batch`` is the number of
    buffered messages that forces a flush; ``flush_interval`` (seconds) is how long a message may wait in the
    buffer before the background flusher sends it; ``liveness_interval`` (seconds) is how often a waiting
    fetch checks that the mesh's workers are alive; ``heartbeat_timeout`` (seconds) is how long a worker of the
    mesh may go without a heartbeat to the scheduler (a stopped or wedged process: Dask itself waits for its
    worker-ttl, 5 minutes) before the session fails naming it (default: Dask config ``monarch.heartbeat-timeout``,
    else 30 s); ``answer_channel`` opens an answer channel to each rank's worker (``channel.py``: batches go out on it
    at once and answers come back on it, about 1 ms a fetch instead of 10): ``True`` or ``"socket"`` with its
    answer sockets (the fast path, ``sockets.py``), ``"comm"`` through the Dask comm alone, ``False`` for none
    (``ValueError`` for anything else; default: Dask config ``monarch.answer-channel``, else True); ``task_interval`` (seconds) is how long a batch sent on a channel may
    wait before its Dask task is submitted (the batches of a rank in that time travel as one task);
    ``exit_timeout`` (seconds) bounds ``mesh.exit()``: it waits for work still running on a rank (a long remote
    function, a step) as long as the rank's worker keeps its heartbeat, up to that long, saying once (a WARNING of
    logger ``dask_monarch.controller``, on stderr by default) which rank it waits for and on what (default: Dask
    config ``monarch.exit-timeout``, else 600 s);
    ``record_answers`` keeps every controller message received in ``answers`` (for tests and debugging);
    ``session_id`` is the id to use (default: a new one, ``protocol/session_id.py``; attach registers it with the
    scheduler first). Dask
    config ``monarch.dashboard.stuck-after`` (seconds, default 60) is how long a rank may be busy on one message
    before the ``/monarch`` page flags it and shows its stream threads' stacks (``ValueError`` if not a positive
    number).

    Low-level use (tests, tools): ``send(message, ranks)`` queues any ``WorkerMessage``; ``sync(...).result()``
    waits until every rank has applied everything sent before.
    """

    def __init__(
        self,
        client,
        workers: list[str],
        *,
        comm_timeout: float = 300.0,
        max_batch: int = 4096,
        flush_interval: float = 0.005,
        liveness_interval: float = 1.0,
        heartbeat_timeout: float | None = None,
        answer_channel: bool | None = None,
        task_interval: float = 0.05,
        exit_timeout: float | None = None,
        record_answers: bool = False,
        session_id: str | None = None,
    ):
        if heartbeat_timeout is None:
            heartbeat_timeout = dask.config.get("monarch.heartbeat-timeout", 30.0)
        if exit_timeout is None:
            exit_timeout = dask.config.get("monarch.exit-timeout", DEFAULT_EXIT_TIMEOUT)
        for name, value in (("heartbeat_timeout", heartbeat_timeout), ("liveness_interval", liveness_interval),
                            ("exit_timeout (Dask config monarch.exit-timeout)", exit_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name, value in (("flush_interval", flush_interval), ("task_interval", task_interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
        if answer_channel is None:
            answer_channel = dask.config.get("monarch.answer-channel", True)
        if answer_channel is True:
            answer_channel = "socket"
        if answer_channel is not False and answer_channel not in MODES:
            raise ValueError("answer_channel (Dask config monarch.answer-channel) must be true, false, "
                             f"{' or '.join(map(repr, MODES))}, got {answer_channel!r}")
        stuck_after = dask.config.get("monarch.dashboard.stuck-after", 60.0)
        if (isinstance(stuck_after, bool) or not isinstance(stuck_after, (int, float))
                or not 0 < stuck_after < math.inf):
            raise ValueError(
                f"Dask config monarch.dashboard.stuck-after must be a positive number of seconds, got {stuck_after!r}"
            )
        if type(max_batch) is not int or max_batch < 1:
            raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
        self.id = session_id or new_session_id()
        #: the 8 letters that name the session everywhere (repr, dashboard link, logs, task keys, threads)
        self.tag = session_tag(self.id)
        self.client = client
        self.workers = list(workers)
        self.world_size = len(self.workers)
        self.max_batch = max_batch
        self.flush_interval = flush_interval
        self.task_interval = task_interval
        self.liveness_interval = liveness_interval
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.exit_timeout = float(exit_timeout)
        self._worker_ids: dict | None = None  # rank address -> worker process id, once pinned
        #: seconds each step of starting the session took, in order (``attach`` adds its own steps before these)
        self.attach_phases: dict[str, float] = {}
        start = time.perf_counter()
        self.pin_workers()
        self.attach_phases["pin workers"] = time.perf_counter() - start
        start = time.perf_counter()
        ids = self._worker_ids or {}
        # stuck_after: how long a rank may be busy on one message before the dashboard flags it and shows its stacks
        options = {"comm_timeout": float(comm_timeout), "stuck_after": float(stuck_after)}
        # each rank's tasks name the worker process they are for: one restarted at the same address refuses them
        local_ranks = _local_ranks(self.workers)
        self.params = [
            SessionParams(self.id, r, self.world_size, {
                **options, "local_rank": local, "local_world_size": _local_world_size(self.workers, local_ranks, r),
                "worker_id": ids.get(a),
            })
            for r, (a, local) in enumerate(zip(self.workers, local_ranks))
        ]
        self._all = tuple(range(self.world_size))
        self.failure: SessionError | None = None
        self.drained = False  # set by close() once every rank passed the exit (the scheduler's close is then clean)
        self._failure_seen = False
        self.closed = False
        self._waiters: list[tuple] = []  # (status seq, MonarchFuture, on_done)
        #: the Dask futures of this session's actors (``mesh.spawn``), released when the session stops
        self.actor_futures: list = []
        self._record_answers = record_answers
        self._init_bookkeeping()
        self._init_transport()
        self.fake_mode = FakeTensorMode()
        self.propagator = Propagator(self.fake_mode)
        #: torch's default dtype on the workers as far as this session set it (fresh Dask workers have float32)
        self.default_dtype = torch.float32
        self._key = self.tag
        self._close_lock = threading.Lock()
        self._flusher = threading.Thread(target=self._flush_loop, name=f"monarch-{self.tag}-flush", daemon=True)
        self._released = False  # the interpreter settings given back (``stop``)
        self._release_lock = threading.Lock()
        # a shorter GIL switch interval, and gen-0 of the GC threshold at Dask config monarch.gc-threshold (each op
        # makes a few tracked objects: at Python's 700 a gen-0 collection ran every few dozen ops), while the session
        # runs (interpreter.py); given back by stop, or here if the session fails to start
        interpreter.hold(gc_threshold=True)
        try:
            self._answers = Answers(self, self._key)  # never Dask's shared callback thread (answers.py)
            self.debugger = Debugger(self)  # breakpoint() in a remote function: pdb on the rank, driven from waits
            #: callables run once when the session stops (layers above the session release what they keep for it)
            self.on_stop: list = []
            self.attach_phases["session state"] = time.perf_counter() - start
            if answer_channel:
                tree = bool(dask.config.get("monarch.answer-tree", True))
                self.channels = Channels(self, answer_channel, tree=tree)
                self.channels.open(self.CHANNEL_TIMEOUT)
                if self.channels.reasons:
                    logger.warning("dask_monarch: session %s: no answer channel to %s; their answers come back as "
                                   "Dask task results (about 10 ms a fetch)", self._key,
                                   "; ".join(f"rank {r} ({self.workers[r]}): {why}"
                                             for r, why in sorted(self.channels.reasons.items())))
            self._flusher.start()
        except BaseException:
            self._release_interpreter()
            raise
        self.send(CreateStream(DEFAULT_STREAM, StreamCreationMode.UseDefaultStream))

    #: seconds to open the answer channels (a worker the controller cannot reach costs attach this long)
    CHANNEL_TIMEOUT = 5.0
    #: seconds ``mesh.exit()`` lets the exit tasks finish once every rank said on its channel that it closed
    EXIT_TASK_GRACE = 1.0
    #: seconds ``mesh.exit()`` waits before it says which rank it waits for (a normal exit takes milliseconds)
    EXIT_NOTICE_AFTER = 5.0

    def check_ok(self) -> None:
        """Raise the session's failure (``SessionError``), or ``SessionError`` if it is closed."""
        if self.failure is not None:
            self._failure_seen = True
            raise self.failure
        if self.closed:
            raise SessionError(f"session {self.id} is closed (mesh.exit() was called)")

    # ------------------------------------------------------------------------------------------------ waits
    def follow_default_dtype(self, stream_ref) -> None:
        """Give the workers the controller's ``torch.get_default_dtype()`` before an operation is sent, if it
        changed: the controller's fake tensors (output shapes and dtypes) follow the controller's default, so the
        workers must too (factories such as ``torch.ones(2)``, an integer tensor's true division). Sent as a
        ``CallFunction`` of ``torch.set_default_dtype`` on ``stream_ref`` to every rank; each worker puts its own
        default back when the session ends there (``TensorWorker.close``). The default is one per process: two
        sessions that share a worker and want different defaults at once get the later one's."""
        dtype = torch.get_default_dtype()
        if dtype is self.default_dtype:
            return
        with self.lock:
            self.default_dtype = dtype
            seq = self.new_seq()
            self.record(seq, defs=[], uses=[], what="torch.set_default_dtype")
            # it returns None: one leaf, so results=[None] (spec §2 CallFunction step 4)
            self.send(CallFunction(seq, (None,), (), _SET_DEFAULT_DTYPE, ArgsKwargs((dtype,), {}), stream_ref, ()))

    def sync(self, describe: str, on_done=None, exit_after: bool = False, kind: str = "status") -> MonarchFuture:
        """Flush, then ``RequestStatus`` on every rank. The returned future resolves once every rank has answered
        ``Status`` past it; ``on_done()`` (under the session lock) computes its value or raises. ``kind`` names
        the tasks on the dashboard (``"status"`` or ``"fetch"``; ``"exit"`` with ``exit_after``)."""
        refuse_wait(describe)
        with self.lock:
            self.check_ok()
            seq = self.new_seq()
            future = MonarchFuture(self, seq, describe)
            self._waiters.append((seq, future, on_done))
            self._flush_locked(seq, exit_after=exit_after, kind=kind, tasks=future.tasks)
            return future

    def tell_dashboard(self, handler: str, **kwargs) -> None:
        """Call the scheduler plugin's ``handler(session_id=self.id, **kwargs)`` (``scheduler/plugin.py``) for the
        ``/monarch`` page, without waiting for it: nothing happens if the scheduler's dask_monarch has no such
        handler or the client is closing (the page is a view; the program never waits for it)."""
        client = self.client

        async def tell():
            try:
                await getattr(client.scheduler, handler)(session_id=self.id, **kwargs)
            except Exception:
                pass

        try:
            client.loop.add_callback(tell)
        except Exception:
            pass

    # ---------------------------------------------------------------------------------------------- failure
    def _fail(self, error: SessionError) -> None:
        """Fail the session: every pending and later wait raises ``error``. Nothing once the session has stopped
        (``stop``): a task's answer that comes back broken while the cluster shuts down after ``mesh.exit()``
        (e.g. "could not read rank 1's answers: ... Stream is closed") has nobody to tell."""
        if self.closed:
            return
        gone = self.scheduler_gone()
        if gone:
            quiet_reconnect()  # the Client's own ERROR lines about it, once the program closes it, would only repeat it
            if gone not in str(error):  # what a rank or a task saw of it (a socket, a cancelled task) follows
                error = SessionError(f"session {self.id}: {gone} (meanwhile: {error})")
        with self.lock:
            if self.failure is not None:
                return
            self.failure = error
            waiters, self._waiters = self._waiters, []
        # the program closed its own Client under the session: its end is no news (here, nor on the workers, which
        # get a clean Exit, and whose end by "controller disconnected" the scheduler marks as the owner leaving)
        owner_closed = getattr(self.client, "status", None) in ("closing", "closed")
        if not owner_closed:
            logger.error("%s", error)
        for _, future, _ in waiters:
            future._set(error=error)
        self._exit_remote(None if owner_closed else str(error))
        # and through the scheduler: fail rendezvous still waiting in this session, and end it on every worker
        # around its inbox (a rank building a communicator with a lost peer does not read its inbox)
        scheduler, reason = self.client.scheduler, str(error)[:2000]

        async def close_on_scheduler():
            try:
                await scheduler.monarch_session_close(session_id=self.id, reason=reason)
            except Exception:  # the Client closed meanwhile (its connection pool refuses): nothing left to tell
                pass

        if gone:  # nobody to tell: the question would only wait for its connect timeout
            return
        try:
            self.client.loop.add_callback(close_on_scheduler)
        except Exception:
            pass

    # ------------------------------------------------------------------------------------------------- exit
    def stop(self) -> None:
        """Close the session on the controller only: later use raises, the flusher and answers threads end (joined:
        nothing of the session is held by a thread after it), its tasks still pending are cancelled and the finished
        ones released (the workers keep a task's result while the controller holds its future), nothing more is
        sent (``close`` drains the workers first; attach uses this alone when it fails half-way)."""
        self.closed = True
        self._wake.set()
        self.debugger.close()
        on_stop, self.on_stop = self.on_stop, []
        for release in on_stop:
            try:
                release()
            except Exception:  # the client is closing: nothing left to release there
                logger.debug("dask_monarch: session %s: a release at stop failed", self._key, exc_info=True)
        if self.channels is not None:
            self.channels.close()
        self._answers.stop()  # joins its thread
        flusher = self._flusher
        if flusher.is_alive() and threading.current_thread() is not flusher:
            flusher.join(self._answers.JOIN_TIMEOUT)  # woken above (``_wake``): it sees ``closed`` and returns
        with self.lock:
            for inflight in self._inflight:
                inflight.clear()
            actor_futures, self.actor_futures = self.actor_futures, []
        for fut in actor_futures:  # Dask deletes each actor on its worker (mesh.spawn)
            try:
                fut.release()
            except Exception:  # the client is closing: the scheduler forgets its futures anyway
                pass
        self._release_interpreter()

    def _release_interpreter(self) -> None:
        """Give back the interpreter settings this session holds (``interpreter.hold``), once."""
        with self._release_lock:
            if not self._released:
                self._released = True
                interpreter.release(gc_threshold=True)

    def _exit_notice(self, seq: int, deadline: float) -> None:
        """Say once which ranks ``mesh.exit()`` waits for and what they are busy on (``describe_busy``)."""
        logger.warning("dask_monarch: session %s: mesh.exit() waits for %s; it waits as long as each worker keeps its "
                       "heartbeat, %s s more at most (exit_timeout)", self._key, self.describe_busy(seq),
                       f"{max(0.0, deadline - time.monotonic()):.0f}")

    def _wait_closed(self, futures: dict, deadline: float) -> None:
        """Wait until every rank has closed the session (threads joined, memory freed), which may be after the
        ``Status`` that the channel brought: its exit task (``futures``: rank -> Dask future) is done, or its
        worker said so on the channel. A rank whose worker leaves or goes silent meanwhile fails it, as any wait
        (``check_alive``, every ``liveness_interval``). Raises ``TimeoutError`` naming the ranks still closing at
        ``deadline`` (``time.monotonic()``)."""
        ended = self.channels.ended if self.channels is not None else set()
        check = time.monotonic() + self.liveness_interval
        while True:
            late = [r for r, f in futures.items() if r not in ended and not f.done()]
            if not late:
                break
            if self.failure is not None:
                raise self.failure
            now = time.monotonic()
            if now >= deadline:
                names = ", ".join(f"rank {r} ({self.workers[r]})" for r in late)
                raise TimeoutError(f"mesh.exit(): the session did not finish closing on {names} in time")
            if now >= check:
                self.check_alive()
                check = now + self.liveness_interval
            time.sleep(0.002)
        # a rank that said so on the channel still runs its exit task for a moment (it returns once its last answers
        # are acknowledged): let it end, briefly, so that closing an embedded cluster next does not cancel it under
        # the worker (Dask then logs "Async instruction ... ended with CancelledError")
        grace = min(deadline, time.monotonic() + self.EXIT_TASK_GRACE)
        while time.monotonic() < grace and not all(f.done() for f in futures.values()):
            time.sleep(0.002)

    def close(self, timeout: float | None = None) -> None:
        """Flush, send ``RequestStatus`` + ``Exit`` to every rank, wait up to ``timeout`` seconds (default
        ``exit_timeout``) for their answers, and stop the flusher. A rank busy on long work is waited for while its
        worker keeps its heartbeat; after ``EXIT_NOTICE_AFTER`` seconds a WARNING says once which rank and what.
        Raises the failure nobody fetched with the smallest seq (``RemoteException``; its ``others`` and message
        list the other unfetched ones, spec §3 "Controller"), the ``SessionError`` if the session failed and no
        fetch reported it (a rank that fails, leaves or goes silent while draining included: within
        ``heartbeat_timeout``), or ``TimeoutError`` naming the ranks that did not drain in ``timeout`` and what
        they were busy on."""
        with self._close_lock:  # a second exit (another thread) waits for the first, then returns
            if self.closed:
                return
            self._close(self.exit_timeout if timeout is None else timeout)

    def _close(self, timeout: float) -> None:
        during_exit = None
        deadline = time.monotonic() + timeout
        try:
            if self.failure is None:
                future = self.sync("mesh.exit()", exit_after=True)
                future._result(timeout, notice=(self.EXIT_NOTICE_AFTER,
                                                lambda: self._exit_notice(future.status_seq, deadline)))
                self._wait_closed(future.tasks, deadline)
                self.drained = True  # every rank passed the exit: the scheduler's close may call it clean
        except SessionError as e:
            during_exit = e  # a rank failed or went silent while draining: nobody else reports it
        finally:
            self.stop()
        if during_exit is not None:
            raise during_exit
        if self.failure is not None and not self._failure_seen:
            self._failure_seen = True
            raise self.failure
        with self.lock:
            unconsumed = list(self.history.unconsumed.values())
            self.history.unconsumed.clear()
        if unconsumed:
            first, *others = sorted(unconsumed, key=lambda e: e.seq)
            if not others:
                raise first
            raise RemoteException(first.seq, first.rank, first.worker, first.backtrace, first.function, others)
