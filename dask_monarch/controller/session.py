"""``Session``: one controller's connection to its mesh of Dask workers (DESIGN.md "Performance design").

Messages are buffered and flushed as one pinned Dask task per worker: after ``max_batch`` messages, before any
wait, and by a background flusher a few milliseconds after the first buffered message. Consecutive messages
for the same set of ranks (and the same stream, for messages that run on one stream) form a segment that is
pickled once and shared by every rank's task, so a message to every rank is serialized once
(``protocol/batch.py``). Each rank's tasks carry an increasing batch number; the worker's inbox restores
the order that Dask does not keep.

Answers come back from the ``sync_batch`` tasks (keys ``monarch-fetch-...``, ``monarch-status-...``,
``monarch-exit-...``; ``task_keys``), whose results feed ``History`` and the fetch futures. Each carries a
numbered chunk of its worker's outbox, and a rank's chunks are applied in that order, whatever order Dask
finishes the tasks in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import pickle
import re
import threading
import time
import uuid
import weakref
from collections import deque

import cloudpickle
import dask
from torch._subclasses.fake_tensor import FakeTensorMode

from .. import interpreter
from ..exceptions import RemoteException, SessionError
from ..protocol import batch
from ..protocol import (
    BackendNetworkInit,
    CommandGroup,
    CreateStream,
    DeleteRefs,
    Exit,
    FetchResult,
    GetRefResult,
    PickledValue,
    Ref,
    RemoteFunctionFailed,
    RequestStatus,
    SessionFailed,
    SplitComm,
    Status,
    StreamCreationMode,
    StreamRef,
    WorkerError,
)
from ..worker.plugin import deliver_batch, session_state, sync_batch
from ..worker.tensor_worker import SessionParams
from .answers import AnswerLost, Answers
from .coalescing import held_messages, refuse_wait
from .history import History
from .propagation import Propagator
from .task_keys import parse_task_key, task_key

__all__ = ["Session", "MonarchFuture"]

logger = logging.getLogger("dask_monarch.controller")

#: The stream every session creates first (Monarch's ``Stream("main", _default=True)``).
DEFAULT_STREAM = StreamRef(0)

#: what the worker's failure text says when a collective or a communicator failed (``worker/comm.py``)
_COMM_FAILURE = re.compile(r"communicator|among .+ (failed|abandoned)|comm_timeout")

#: statuses of a Dask worker that is going away (``distributed.core.Status``)
_CLOSING = ("closing", "closing_gracefully", "closed", "stopping", "stopped", "failed")


def _storage(tensor) -> int:
    """The identity of a remote tensor's (fake) storage, shared by all its aliases."""
    return tensor._fake.untyped_storage()._cdata


class _HeldDelete(tuple):
    """A ref dropped inside a ``coalescing()`` block, held with the block's messages (``Session.drop_ref``)."""

    __slots__ = ()

    def __new__(cls, ref_id: int):
        return super().__new__(cls, (ref_id,))

    @property
    def ref(self) -> int:
        return self[0]


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


def _dumps(messages: list) -> bytes:
    from .dispatch import propagating  # local tensors among the arguments pickle locally, not as mesh ops

    with propagating():
        return _dumps_plain(messages)


def _dumps_plain(messages: list) -> bytes:
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
    fetch checks that the mesh's workers are alive; ``heartbeat_timeout`` (seconds) is how long a worker of the
    mesh may go without a heartbeat to the scheduler (a stopped or wedged process: Dask itself waits for its
    worker-ttl, 5 minutes) before the session fails naming it (default: Dask config ``monarch.heartbeat-timeout``,
    else 30 s); ``record_answers`` keeps every controller
    message received in ``answers`` (for tests and debugging); ``session_id`` is the id to use (default: a
    new uuid; attach registers it with the scheduler first).

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
        record_answers: bool = False,
        session_id: str | None = None,
    ):
        if heartbeat_timeout is None:
            heartbeat_timeout = dask.config.get("monarch.heartbeat-timeout", 30.0)
        for name, value in (("heartbeat_timeout", heartbeat_timeout), ("liveness_interval", liveness_interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if isinstance(flush_interval, bool) or not isinstance(flush_interval, (int, float)) or not (
            0 <= flush_interval < math.inf
        ):
            raise ValueError(f"flush_interval must be a non-negative number of seconds, got {flush_interval!r}")
        if type(max_batch) is not int or max_batch < 1:
            raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
        self.id = session_id or uuid.uuid4().hex
        self.client = client
        self.workers = list(workers)
        self.world_size = len(self.workers)
        self.max_batch = max_batch
        self.flush_interval = flush_interval
        self.liveness_interval = liveness_interval
        self.heartbeat_timeout = float(heartbeat_timeout)
        self._worker_ids: dict | None = None  # rank address -> worker process id, once pinned
        self.pin_workers()
        ids = self._worker_ids or {}
        options = {"comm_timeout": float(comm_timeout)}
        # each rank's tasks name the worker process they are for: one restarted at the same address refuses them
        self.params = [
            SessionParams(self.id, r, self.world_size, {**options, "local_rank": local, "worker_id": ids.get(a)})
            for r, (a, local) in enumerate(zip(self.workers, _local_ranks(self.workers)))
        ]
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
        self._answers_next = [0] * self.world_size  # per rank: the next outbox chunk to apply
        self._answers_held: list[dict] = [{} for _ in range(self.world_size)]  # chunks that came early
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
        #: streams of this session other than the default: ``Stream`` -> ``StreamRef`` (``controller/stream.py``)
        self.streams: dict = {}
        # weak, so that an undropped borrow can be garbage-collected (it then drops itself, deferred)
        self._lent: dict[int, weakref.WeakSet] = {}  # fake storage of a borrowed tensor -> its live borrows
        self._borrowed = weakref.WeakValueDictionary()  # fake storage of a borrow's tensor -> that borrow
        self._deferred: deque = deque()  # work the garbage collector left for the next send (Borrow.__del__)
        #: the ``Recorder`` of a compiled function recording now (``controller/recording.py``): what its thread (and
        #: autograd's threads, which run a backward pass of CUDA tensors) sends meanwhile is captured instead
        self.recorder = None
        self._network = False
        self._splits: set = set()
        self._key = self.id[:8]
        self._wake = threading.Event()
        self._close_lock = threading.Lock()
        self._flusher = threading.Thread(target=self._flush_loop, name=f"monarch-flush-{self._key}", daemon=True)
        self._released = False  # the interpreter settings given back (``stop``)
        self._release_lock = threading.Lock()
        interpreter.hold()  # a shorter GIL switch interval while the session runs (interpreter.py)
        self._answers = Answers(self, self._key)  # never Dask's shared callback thread (answers.py)
        self._flusher.start()
        self.send(CreateStream(DEFAULT_STREAM, StreamCreationMode.UseDefaultStream))

    # ------------------------------------------------------------------------------------------------ ids
    def recording(self):
        """The recorder capturing what this thread sends: set while a compiled function records, on its own thread
        and on autograd's threads (``Recorder.owns_thread``); else None."""
        recorder = self.recorder
        if recorder is not None and recorder.owns_thread():
            return recorder
        return None

    def new_seq(self) -> int:
        """The next seq; while a compiled function records, the next operation's index in the recording."""
        with self.lock:
            if self.recorder is not None and self.recorder.owns_thread():
                return self.recorder.next_index()
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
        if self.recorder is not None and self.recorder.owns_thread():
            self.recorder.created(tensor)
        key = tensor._fake.untyped_storage()._cdata
        aliases = self._storages.get(key)
        if aliases is None:
            aliases = self._storages[key] = weakref.WeakSet()
        aliases.add(tensor)

    def retrack(self, tensor, old_fake) -> None:
        """``tensor``'s fake changed from ``old_fake`` (a ``.data`` assignment): move it to its new storage's aliases."""
        key = old_fake.untyped_storage()._cdata
        aliases = self._storages.get(key)
        if aliases is not None:  # rebuilt: WeakSet.discard compares with ==, which is a remote op on tensors
            self._storages[key] = weakref.WeakSet(t for t in aliases if t is not tensor)
        self.track(tensor)

    def aliases_of(self, tensors) -> list:
        """Every live tensor that shares storage with one of ``tensors`` (these included), by ref id."""
        found = {}
        for t in tensors:
            found[t.ref.id] = t
            for alias in self._storages.get(t._fake.untyped_storage()._cdata, ()):
                found[alias.ref.id] = alias
        return list(found.values())

    # -------------------------------------------------------------------------------------------- borrows
    def lend(self, origin, borrow) -> None:
        """``borrow`` of ``origin`` is live (``controller/stream.py``)."""
        self._lent.setdefault(_storage(origin), weakref.WeakSet()).add(borrow)
        self._borrowed[_storage(borrow.tensor)] = borrow

    def unlend(self, origin, borrow) -> None:
        """``borrow`` of ``origin`` was dropped."""
        live = self._lent.get(_storage(origin))
        if live is not None:
            live.discard(borrow)
            if not live:
                del self._lent[_storage(origin)]
        self._borrowed.pop(_storage(borrow.tensor), None)

    def borrows_of(self, tensor) -> list:
        """The live borrows of ``tensor``'s storage."""
        self.run_deferred()
        return list(self._lent.get(_storage(tensor), ())) if self._lent else []

    def defer(self, fn) -> None:
        """Call ``fn()`` before the next message is sent (safe from the garbage collector: takes no lock)."""
        self._deferred.append(fn)

    def run_deferred(self) -> None:
        while self._deferred:
            try:
                fn = self._deferred.popleft()
            except IndexError:
                return
            with self.lock:
                fn()

    def borrow_by_alias(self, tensor):
        """The live borrow whose borrowed tensor shares ``tensor``'s storage, or None."""
        return self._borrowed.get(_storage(tensor)) if self._borrowed else None

    def record(self, seq: int, defs, uses, what="") -> None:
        """Add invocation ``seq``, which defines the remote tensors ``defs`` and uses ``uses``, to the dependency
        graph (``History.new_node``); ``what`` describes it in error reports. While a compiled function records,
        the recorder takes it instead (``seq`` is then the operation's index in the recording)."""
        recorder = self.recorder
        if recorder is not None and recorder.owns_thread():
            recorder.add(seq, defs, uses, what)
            return
        if what:
            self.functions[seq] = what
        self.history.new_node(seq, [t.ref.id for t in defs], [t.ref.id for t in uses])

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
        if self._deferred:
            self.run_deferred()
        targets = self._all if ranks is None else tuple(ranks)
        if self.recorder is not None:
            with self.lock:
                recorder = self.recorder
                if recorder is not None and recorder.owns_thread() and recorder.capture(targets, message):
                    return
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
        deletes = [(targets, message.ref) for targets, message in items if type(message) is _HeldDelete]
        items = [item for item in items if type(item[1]) is not _HeldDelete]
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
            self._deletes.extend(deletes)  # refs dropped inside the block: freed after its messages

    def drop_ref(self, ref_id: int, ranks=None) -> None:
        """A controller-side handle died: free ``ref_id`` on ``ranks`` with the next flush (``DeleteRefs``).
        Safe from any thread, including the garbage collector's. Inside ``coalescing()`` the delete waits for
        the end of the block: the block's held messages may still use the ref (``BorrowLastUse`` of a dropped
        borrow, an op on a tensor dropped after it), and a flush meanwhile would otherwise free it first."""
        if self.closed:
            return
        targets = self._all if ranks is None else tuple(ranks)
        recorder = self.recorder
        if recorder is not None and recorder.drop(targets, ref_id):
            return
        held = held_messages()
        if held is not None:
            held.setdefault(self, []).append((targets, _HeldDelete(ref_id)))
        else:
            self._deletes.append((targets, ref_id))

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
        # consecutive messages with the same targets (and stream, for stream messages) form one segment, pickled
        # once (protocol/batch.py)
        per_rank: list[list] = [[] for _ in range(self.world_size)]
        for targets, segment in batch.segments(items, _dumps):
            for r in targets:
                per_rank[r].append(segment)
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
                self._answers.add(fut, sync=True)
                futures[rank] = fut
            else:
                fut = self.client.submit(
                    deliver_batch, self.params[rank], bseq, blobs,
                    key=task_key("messages", self.id, rank, bseq), **common,
                )
                self._answers.add(fut, sync=False)
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

    #: how long a diagnostic question to a worker or the scheduler may take (the liveness check of a wait allows
    #: the scheduler ``heartbeat_timeout``)
    PROBE_TIMEOUT = 5.0

    def describe_pending(self, seq: int, diagnose: bool = False) -> str:
        """Which ranks have not answered ``Status`` past ``seq``; with ``diagnose``, how long ago each sent the
        scheduler a heartbeat and what its worker reports about this session (inbox position, stream queues,
        failure). Every question is bounded (``PROBE_TIMEOUT``): a stopped worker is named, not waited for."""
        late = [r for r in range(self.world_size) if self.history.first_incomplete[r] <= seq]
        who = ", ".join(f"rank {r} ({self.workers[r]})" for r in late)
        text = f"no Status past seq {seq} from {who or 'nobody (answers are being processed)'}"
        if diagnose and late:
            addresses = [self.workers[r] for r in late]
            try:
                ages = self._worker_ages(self.PROBE_TIMEOUT)[0]
            except Exception:
                ages = {}
            states = self._probe_workers(addresses)
            sent = {self.workers[r]: self._batch_seq[r] for r in late}
            for address in addresses:
                age = ages.get(address)
                beat = "" if age is None else f"last heartbeat {age:.1f} s ago; "
                text += f"\n  {address}: {beat}{states[address]}; batches sent to it: {sent.get(address)}"
        return text

    def _probe_workers(self, addresses: list) -> dict:
        """``session_state`` of each worker, asked one by one in parallel, each bounded by ``PROBE_TIMEOUT``."""
        timeout = self.PROBE_TIMEOUT
        client = self.client

        async def ask(address):
            try:
                answer = await asyncio.wait_for(
                    client._run(session_state, self.id, workers=[address], on_error="return"), timeout
                )
                return repr(answer.get(address, answer))
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

    def check_alive(self) -> None:
        """Raise ``SessionError`` if the session failed, a worker of the mesh left the cluster, or one has been
        silent for longer than ``heartbeat_timeout`` (a stopped process, which Dask keeps for its worker-ttl)."""
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

    # ---------------------------------------------------------------------------------------------- answers
    def _on_batch_done(self, fut) -> None:
        """A ``deliver_batch`` task is done (on the answers thread, ``answers.py``)."""
        if fut.status == "error":
            exc = self._answers.exception(fut)
            self._fail(SessionError(f"session {self.id}: delivering a message batch ({fut.key}) failed: {exc}"))

    def _on_sync_done(self, fut) -> None:
        """A ``sync_batch`` task is done: apply its answers (on the answers thread, ``answers.py``)."""
        rank = parse_task_key(fut.key)[2]
        if fut.status == "cancelled":
            self._fail(SessionError(
                f"session {self.id}: the status request to rank {rank} ({self.workers[rank]}, {fut.key}) was "
                f"cancelled (the cluster was restarted, or the task was released){self._meanwhile()}"
            ))
            return
        if fut.status == "error":
            exc = self._answers.exception(fut)
            self._fail(SessionError(f"session {self.id}: status request to rank {rank} ({fut.key}) failed: {exc}"))
            return
        try:
            chunk, messages = pickle.loads(self._answers.result(fut))
        except AnswerLost as e:
            if self.failure is None:
                self._fail(SessionError(
                    f"session {self.id}: the answers of rank {rank} ({self.workers[rank]}, {fut.key}) were lost before "
                    f"the controller collected them ({e}): its worker died or restarted{self._meanwhile()}"
                ))
            return
        except Exception as e:
            self._fail(SessionError(f"session {self.id}: could not read rank {rank}'s answers: {e}"))
            return
        messages = [self._unwrap(rank, m) if type(m) is FetchResult else m for m in messages]
        note = ""
        failed = [m for m in messages if type(m) is SessionFailed]
        if self.failure is None and failed:
            # a rank failing in a collective often reports a lost peer (connection reset, timeout): name the
            # worker that left or went silent, if the scheduler knows one
            note = self._departed(failed[0].error.backtrace)
        with self.lock:
            if chunk is None:  # the session had already ended on that worker
                for msg in messages:
                    self._handle(rank, msg, note)
                return
            # apply each rank's answers in the order its worker took them (Dask may finish two status tasks of
            # one rank in either order; a Status applied before the FetchResult it follows would resolve a fetch
            # without its value)
            held = self._answers_held[rank]
            held[chunk] = (messages, note)
            while self._answers_next[rank] in held:
                messages, note = held.pop(self._answers_next[rank])
                self._answers_next[rank] += 1
                for msg in messages:
                    self._handle(rank, msg, note)

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

    def _unwrap(self, rank: int, msg: FetchResult) -> FetchResult:
        """A fetched value travels pickled on its own (``PickledValue``): unpickle it here, so that a value the
        controller cannot load (its class's module is only on the workers) becomes that fetch's error."""
        value = msg.value
        if type(value) is not PickledValue:
            return msg
        try:
            return FetchResult(msg.seq, value=value.load())
        except Exception as e:
            text = (f"the fetched value of type {value.type_name} could not be unpickled on the controller: "
                    f"{type(e).__name__}: {e}")
            return FetchResult(msg.seq, error=WorkerError(text, self.workers[rank]))

    def _handle(self, rank: int, msg, note: str = "") -> None:
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
            what = self.functions.get(msg.seq, "")
            if msg.controller_frame_index is not None and hasattr(what, "operation"):  # a compiled call's operation
                what = what.operation(msg.controller_frame_index)
            err = RemoteException(msg.seq, rank, self.workers[rank], msg.error.backtrace, str(what))
            self.history.fail(msg.seq, err)
        elif kind is FetchResult:
            self._fetch_results[msg.seq] = msg
        elif kind is GetRefResult:
            self.get_ref_results.append((rank, msg))
        elif kind is SessionFailed:
            self._fail(self._failed_on(rank, msg.error.backtrace, note))
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
        # and through the scheduler: fail rendezvous still waiting in this session, and end it on every worker
        # around its inbox (a rank building a communicator with a lost peer does not read its inbox)
        try:
            self.client.loop.add_callback(
                self.client.scheduler.monarch_session_close, session_id=self.id, reason=str(error)[:2000]
            )
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
    def stop(self) -> None:
        """Close the session on the controller only: later use raises, the flusher and answers threads end, its
        tasks still pending are cancelled and the finished ones released (the workers keep a task's result while
        the controller holds its future), nothing more is sent (``close`` drains the workers first; attach uses
        this alone when it fails half-way)."""
        self.closed = True
        self._wake.set()
        self._answers.stop()
        with self.lock:
            for inflight in self._inflight:
                inflight.clear()
        with self._release_lock:
            if not self._released:
                self._released = True
                interpreter.release()

    def close(self, timeout: float = 60.0) -> None:
        """Flush, send ``RequestStatus`` + ``Exit`` to every rank, wait up to ``timeout`` seconds for their answers,
        and stop the flusher. Raises the failure nobody fetched with the smallest seq (``RemoteException``; its
        ``others`` and message list the other unfetched ones, spec §3 "Controller"), the ``SessionError``
        if the session failed and no fetch reported it (a rank that fails, leaves or goes silent while draining
        included), or ``TimeoutError`` naming the ranks that did not drain in ``timeout``."""
        with self._close_lock:  # a second exit (another thread) waits for the first, then returns
            if self.closed:
                return
            self._close(timeout)

    def _close(self, timeout: float) -> None:
        during_exit = None
        try:
            if self.failure is None:
                self.sync("mesh.exit()", exit_after=True).result(timeout=timeout)
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
