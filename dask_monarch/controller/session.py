"""``Session``: one controller's connection to its mesh of Dask workers (DESIGN.md "Performance design").

Messages are buffered and flushed as one pinned Dask task per worker: after ``max_batch`` messages, before any
wait, and by a background flusher a few milliseconds after the first buffered message. Consecutive messages
for the same set of ranks form a segment that is pickled once and shared by every rank's task, so a message to
every rank is serialized once. Each rank's tasks carry an increasing batch number; the worker's inbox restores
the order that Dask does not keep.

Answers come back from the ``sync_batch`` tasks (keys ``monarch-fetch-...``, ``monarch-status-...``,
``monarch-exit-...``; ``task_keys``), whose results feed ``History`` and the fetch futures.
"""

from __future__ import annotations

import concurrent.futures
import logging
import pickle
import threading
import time
import uuid
import weakref
from collections import deque

import cloudpickle
from torch._subclasses.fake_tensor import FakeTensorMode

from ..exceptions import RemoteException, SessionError
from ..protocol import (
    BackendNetworkInit,
    CommandGroup,
    CreateStream,
    DeleteRefs,
    Exit,
    FetchResult,
    GetRefResult,
    Ref,
    RemoteFunctionFailed,
    RequestStatus,
    SessionFailed,
    SplitComm,
    Status,
    StreamCreationMode,
    StreamRef,
)
from ..worker.plugin import deliver_batch, session_state, sync_batch
from ..worker.tensor_worker import SessionParams
from .coalescing import held_messages, refuse_wait
from .history import History
from .propagation import Propagator
from .task_keys import parse_task_key, task_key

__all__ = ["Session", "MonarchFuture"]

logger = logging.getLogger("dask_monarch.controller")

#: The stream every session creates first (Monarch's ``Stream("main", _default=True)``).
DEFAULT_STREAM = StreamRef(0)


def _dumps(messages: list) -> bytes:
    try:
        return pickle.dumps(messages, protocol=5)
    except Exception:
        return cloudpickle.dumps(messages, protocol=5)


class MonarchFuture:
    """The answer to a fetch or a status request: ``result(timeout=None)``, ``done()``, ``exception()``.

    ``result`` waits as long as the mesh is alive and working; it raises ``RemoteException`` if the value
    depends on a failed invocation, ``SessionError`` if a worker failed fatally or left, and ``TimeoutError``
    (naming the ranks that did not answer) after ``timeout`` seconds.
    """

    def __init__(self, session: "Session", status_seq: int, describe: str):
        self._session = session
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self.status_seq = status_seq
        self._describe = describe
        #: the Dask futures of the tasks this answer waits for (one per rank), e.g. for ``distributed.progress``
        self.futures: list = []

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None):
        try:
            return self._result(timeout)
        except SessionError:
            self._session._failure_seen = True  # reported here, so mesh.exit() need not raise it again
            raise

    def _result(self, timeout: float | None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = self._session.liveness_interval
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            try:
                return self._future.result(timeout=wait)
            except concurrent.futures.TimeoutError:
                pass
            self._session.check_alive()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self._describe} was not answered within {timeout:g} s: "
                    f"{self._session.describe_pending(self.status_seq, diagnose=True)}"
                )

    def exception(self, timeout: float | None = None):
        try:
            self.result(timeout)
        except Exception as e:
            return e
        return None

    # set by the session
    def _set(self, value=None, error: BaseException | None = None) -> None:
        if self._future.done():
            return
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(value)


class Session:
    """One controller session over ``workers`` (Dask worker address per rank) on ``client``.

    ``comm_timeout`` (seconds) bounds rendezvous and collectives on the workers; ``max_batch`` is the number of
    buffered messages that forces a flush; ``flush_interval`` (seconds) is how long a message may wait in the
    buffer before the background flusher sends it; ``liveness_interval`` (seconds) is how often a waiting
    fetch checks that the mesh's workers are alive; ``record_answers`` keeps every controller message received
    in ``answers`` (for tests and debugging).

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
        record_answers: bool = False,
    ):
        self.id = uuid.uuid4().hex
        self.client = client
        self.workers = list(workers)
        self.world_size = len(self.workers)
        self.max_batch = max_batch
        self.flush_interval = flush_interval
        self.liveness_interval = liveness_interval
        options = {"comm_timeout": float(comm_timeout)}
        self.params = [SessionParams(self.id, r, self.world_size, options) for r in range(self.world_size)]
        self.lock = threading.RLock()
        self.history = History(self.world_size)
        self.failure: SessionError | None = None
        self._failure_seen = False
        self.closed = False
        self._all = tuple(range(self.world_size))
        self._buffer: list = []  # (targets tuple, message)
        self._deletes: deque = deque()  # (targets tuple, ref id), appended from any thread (GC)
        self._batch_seq = [0] * self.world_size
        self._inflight: list[deque] = [deque() for _ in range(self.world_size)]
        self._next_seq = 0
        self._next_ref = 0
        self._waiters: list[tuple] = []  # (status seq, MonarchFuture, on_done)
        self._fetch_results: dict[int, FetchResult] = {}
        self.get_ref_results: deque = deque()
        #: with ``record_answers``: every controller message received, as (rank, message), in arrival order
        self.answers: deque | None = deque() if record_answers else None
        self.functions: dict[int, str] = {}  # seq -> description of what it called, while incomplete
        self.fake_mode = FakeTensorMode()
        self.propagator = Propagator(self.fake_mode)
        self._storages: dict[int, weakref.WeakSet] = {}
        self._network = False
        self._splits: set = set()
        self._key = self.id[:8]
        self._wake = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name=f"monarch-flush-{self._key}", daemon=True)
        self._flusher.start()
        self.send(CreateStream(DEFAULT_STREAM, StreamCreationMode.UseDefaultStream))

    # ------------------------------------------------------------------------------------------------ ids
    def new_seq(self) -> int:
        with self.lock:
            seq = self._next_seq
            self._next_seq += 1
            return seq

    def new_ref(self) -> Ref:
        with self.lock:
            ref = Ref(self._next_ref)
            self._next_ref += 1
            return ref

    # ------------------------------------------------------------------------------------- tensors, history
    def track(self, tensor) -> None:
        """Remember ``tensor`` among the live aliases of its (fake) storage."""
        key = tensor._fake.untyped_storage()._cdata
        aliases = self._storages.get(key)
        if aliases is None:
            aliases = self._storages[key] = weakref.WeakSet()
        aliases.add(tensor)

    def aliases_of(self, tensors) -> list:
        """Every live tensor that shares storage with one of ``tensors`` (these included), by ref id."""
        found = {}
        for t in tensors:
            found[t.ref.id] = t
            for alias in self._storages.get(t._fake.untyped_storage()._cdata, ()):
                found[alias.ref.id] = alias
        return list(found.values())

    def record(self, seq: int, defs, uses, what: str = "") -> None:
        """Add invocation ``seq`` to the dependency graph (``History.new_node``)."""
        if what:
            self.functions[seq] = what
        self.history.new_node(seq, defs, uses)

    def ensure_comm(self, mesh, mesh_ref: Ref, stream: StreamRef, dims) -> None:
        """Send ``BackendNetworkInit`` (once per session, to every rank) and ``SplitComm`` (once per mesh, stream
        and sorted dims, to every rank) before the first ``Reduce`` that needs them (spec §1 ``reduce``)."""
        with self.lock:
            if not self._network:
                self._network = True
                self.send(BackendNetworkInit(f"{self.id}/net"))
            key = (mesh_ref.id, stream.id, tuple(dims))
            if key not in self._splits:
                self._splits.add(key)
                self.send(SplitComm(list(dims), mesh_ref, stream))

    # -------------------------------------------------------------------------------------------- sending
    def check_ok(self) -> None:
        if self.failure is not None:
            self._failure_seen = True
            raise self.failure
        if self.closed:
            raise SessionError(f"session {self.id} is closed (mesh.exit() was called)")

    def send(self, message, ranks=None) -> None:
        """Queue ``message`` for ``ranks`` (an iterable of ranks; default every rank of the session). Inside
        ``coalescing()`` the message is held for the block's ``CommandGroup``."""
        targets = self._all if ranks is None else tuple(ranks)
        held = held_messages()
        if held is not None:
            self.check_ok()
            held.setdefault(self, []).append((targets, message))
            return
        with self.lock:
            self.check_ok()
            was_empty = not self._buffer
            self._buffer.append((targets, message))
            if len(self._buffer) >= self.max_batch:
                self._flush_locked(None)
            elif was_empty:
                self._wake.set()

    def send_group(self, items) -> None:
        """Send held ``(targets, message)`` items as one ``CommandGroup`` per rank, in order; ranks with the same
        messages share one group (``coalescing``)."""
        per_rank: dict[int, list] = {}
        for targets, message in items:
            for rank in targets:
                per_rank.setdefault(rank, []).append(message)
        groups: dict[tuple, list] = {}
        for rank, messages in per_rank.items():
            groups.setdefault(tuple(map(id, messages)), [messages, []])[1].append(rank)
        with self.lock:
            for messages, ranks in groups.values():
                self.send(CommandGroup(messages), ranks)

    def drop_ref(self, ref_id: int, ranks=None) -> None:
        """A controller-side handle died: free ``ref_id`` on ``ranks`` with the next flush (``DeleteRefs``).
        Safe from any thread, including the garbage collector's."""
        if not self.closed:
            self._deletes.append((self._all if ranks is None else tuple(ranks), ref_id))

    def flush(self) -> None:
        with self.lock:
            self._flush_locked(None)

    def _take_deletes(self) -> list:
        taken = []
        pop = self._deletes.popleft
        while True:
            try:
                taken.append(pop())
            except IndexError:
                break
        if not taken:
            return []
        by_targets: dict[tuple, list] = {}
        for targets, ref_id in taken:
            by_targets.setdefault(targets, []).append(Ref(ref_id))
            self.history.drop_ref(ref_id)
        return [(targets, DeleteRefs(refs)) for targets, refs in by_targets.items()]

    def _flush_locked(self, sync_seq: int | None, exit_after: bool = False, kind: str = "status"):
        """Send what is buffered as one task per rank (``monarch-messages-...``). With ``sync_seq``, every rank
        gets a ``sync_batch`` task of ``kind`` (``task_keys``) ending with ``RequestStatus{sync_seq}`` (then
        ``Exit`` if ``exit_after``) and the futures of those tasks are returned."""
        items = self._buffer
        self._buffer = []
        self._wake.clear()
        if len(self._storages) > 4 * 1024:
            self._storages = {k: v for k, v in self._storages.items() if len(v)}
        items.extend(self._take_deletes())
        if sync_seq is not None:
            items.append((self._all, RequestStatus(sync_seq, False)))
            if exit_after:
                items.append((self._all, Exit(None)))
        if not items:
            return None
        # consecutive messages with the same targets form one segment, pickled once
        segments: list[tuple[tuple, bytes]] = []
        start = 0
        for i in range(1, len(items) + 1):
            if i == len(items) or items[i][0] != items[start][0]:
                segments.append((items[start][0], _dumps([m for _, m in items[start:i]])))
                start = i
        per_rank: list[list] = [[] for _ in range(self.world_size)]
        for targets, blob in segments:
            for r in targets:
                per_rank[r].append(blob)
        futures = {}
        for rank, blobs in enumerate(per_rank):
            if not blobs:
                continue
            bseq = self._batch_seq[rank]
            self._batch_seq[rank] = bseq + 1
            common = dict(workers=[self.workers[rank]], allow_other_workers=False, pure=False, priority=-bseq)
            if sync_seq is not None:
                fut = self.client.submit(
                    sync_batch, self.params[rank], bseq, blobs, sync_seq, exit_after,
                    key=task_key("exit" if exit_after else kind, self.id, rank, bseq), **common,
                )
                fut.add_done_callback(self._on_sync_done)
                futures[rank] = fut
            else:
                fut = self.client.submit(
                    deliver_batch, self.params[rank], bseq, blobs,
                    key=task_key("messages", self.id, rank, bseq), **common,
                )
                fut.add_done_callback(self._on_batch_done)
            inflight = self._inflight[rank]
            inflight.append(fut)
            while inflight and inflight[0].done():
                inflight.popleft()
        return futures

    def _flush_loop(self) -> None:
        while not self.closed:
            self._wake.wait()
            if self.closed:
                return
            time.sleep(self.flush_interval)
            try:
                with self.lock:
                    if self.failure is None and not self.closed:
                        self._flush_locked(None)
            except Exception as e:  # the client is gone: report it on the next use
                self._fail(SessionError(f"session {self.id}: could not send a message batch: {e}"))

    # ------------------------------------------------------------------------------------------------ waits
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
            futures = self._flush_locked(seq, exit_after=exit_after, kind=kind)
            future.futures = list(futures.values()) if futures else []
            return future

    def describe_pending(self, seq: int, diagnose: bool = False) -> str:
        """Which ranks have not answered ``Status`` past ``seq``; with ``diagnose``, what their workers report
        about this session (inbox position, stream queues, failure)."""
        late = [r for r in range(self.world_size) if self.history.first_incomplete[r] <= seq]
        who = ", ".join(f"rank {r} ({self.workers[r]})" for r in late)
        text = f"no Status past seq {seq} from {who or 'nobody (answers are being processed)'}"
        if diagnose and late:
            try:
                states = self.client.run(
                    session_state, self.id, workers=[self.workers[r] for r in late], on_error="return"
                )
                sent = {self.workers[r]: self._batch_seq[r] for r in late}
                text += "".join(
                    f"\n  {addr}: {state!r}; batches sent to it: {sent.get(addr)}" for addr, state in states.items()
                )
            except Exception as e:
                text += f"\n  (could not ask the workers: {type(e).__name__}: {e})"
        return text

    def check_alive(self) -> None:
        """Raise ``SessionError`` if the session failed or a worker of the mesh left the cluster."""
        if self.failure is not None:
            raise self.failure
        try:
            info = self.client.scheduler_info()
        except Exception as e:
            err = SessionError(f"session {self.id}: the Dask scheduler is unreachable: {type(e).__name__}: {e}")
            self._fail(err)
            raise err from None
        alive = set(info.get("workers", {}))
        gone = [(r, a) for r, a in enumerate(self.workers) if a not in alive]
        if gone:
            names = ", ".join(f"rank {r} ({a})" for r, a in gone)
            err = SessionError(f"session {self.id}: worker(s) left the cluster: {names}; the mesh cannot continue")
            self._fail(err)
            raise err

    # ---------------------------------------------------------------------------------------------- answers
    def _on_batch_done(self, fut) -> None:
        if fut.status == "error":
            try:
                exc = fut.exception()
            except Exception as e:
                exc = e
            self._fail(SessionError(f"session {self.id}: delivering a message batch ({fut.key}) failed: {exc}"))

    def _on_sync_done(self, fut) -> None:
        rank = parse_task_key(fut.key)[2]
        if fut.status != "finished":
            try:
                exc = fut.exception()
            except Exception as e:
                exc = e
            self._fail(SessionError(f"session {self.id}: status request to rank {rank} ({fut.key}) failed: {exc}"))
            return
        try:
            messages = pickle.loads(fut.result())
        except Exception as e:
            self._fail(SessionError(f"session {self.id}: could not read rank {rank}'s answers: {e}"))
            return
        with self.lock:
            for msg in messages:
                self._handle(rank, msg)

    def _handle(self, rank: int, msg) -> None:
        if self.answers is not None:
            self.answers.append((rank, msg))
        kind = type(msg)
        if kind is Status:
            if self.history.status(rank, msg.seq):
                low = self.history.completed
                ready = [w for w in self._waiters if w[0] < low]
                self._waiters = [w for w in self._waiters if w[0] >= low]
                for _, future, on_done in sorted(ready, key=lambda w: w[0]):
                    try:
                        future._set(on_done() if on_done is not None else None)
                    except BaseException as e:
                        future._set(error=e)
                for s in [s for s in self.functions if s < low]:
                    del self.functions[s]
        elif kind is RemoteFunctionFailed:
            err = RemoteException(msg.seq, rank, self.workers[rank], msg.error.backtrace, self.functions.get(msg.seq, ""))
            self.history.fail(msg.seq, err)
        elif kind is FetchResult:
            self._fetch_results[msg.seq] = msg
        elif kind is GetRefResult:
            self.get_ref_results.append((rank, msg))
        elif kind is SessionFailed:
            self._fail(SessionError(
                f"session {self.id} failed on rank {rank} ({self.workers[rank]}): {msg.error.backtrace}"
            ))
        else:
            logger.warning("dask_monarch: ignoring unknown answer %r from rank %d", msg, rank)

    def take_fetch_result(self, seq: int) -> FetchResult | None:
        return self._fetch_results.pop(seq, None)

    def _fail(self, error: SessionError) -> None:
        """Fail the session: every pending and later wait raises ``error``."""
        with self.lock:
            if self.failure is not None:
                return
            self.failure = error
            waiters, self._waiters = self._waiters, []
        logger.error("%s", error)
        for _, future, _ in waiters:
            future._set(error=error)
        self._exit_remote(str(error))
        try:  # fail rendezvous still waiting in this session (a rank building a communicator with a lost peer)
            self.client.loop.add_callback(self.client.scheduler.monarch_session_close, session_id=self.id)
        except Exception:
            pass

    def _exit_remote(self, reason: str) -> None:
        """Best effort, no wait: ``Exit`` with an error to every rank whose worker is still there, so that peers
        release their communicators (a stream blocked in a collective with the failed rank errors out) and the
        session's threads and tensors are freed."""
        with self.lock:
            blob = _dumps([Exit((None, reason[:2000]))])
            for rank, address in enumerate(self.workers):
                bseq = self._batch_seq[rank]
                self._batch_seq[rank] = bseq + 1
                try:
                    self._inflight[rank].append(self.client.submit(
                        deliver_batch, self.params[rank], bseq, [blob], key=task_key("exit", self.id, rank, bseq),
                        workers=[address], allow_other_workers=False, pure=False, priority=-bseq,
                    ))
                except Exception:
                    pass

    # ------------------------------------------------------------------------------------------------- exit
    def close(self, timeout: float = 60.0) -> None:
        """Flush, send ``RequestStatus`` + ``Exit`` to every rank, wait up to ``timeout`` seconds for their answers,
        and stop the flusher. Raises the first failure nobody fetched (``RemoteException``), or the
        ``SessionError`` if the session failed and no fetch reported it."""
        if self.closed:
            return
        try:
            if self.failure is None:
                self.sync("mesh.exit()", exit_after=True).result(timeout=timeout)
        except SessionError:
            pass
        finally:
            self.closed = True
            self._wake.set()
        if self.failure is not None and not self._failure_seen:
            self._failure_seen = True
            raise self.failure
        with self.lock:
            unconsumed = list(self.history.unconsumed.values())
            self.history.unconsumed.clear()
        if unconsumed:
            raise unconsumed[0]
