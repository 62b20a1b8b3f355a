"""Transport of a session (``Session``'s concern ``Transport``; DESIGN.md "Performance design"): batching,
flushing, and applying the answers.

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

import logging
import pickle
import threading
import time
from collections import deque

import cloudpickle

from ..exceptions import RemoteException, SessionError
from ..protocol import (
    CommandGroup,
    DeleteRefs,
    Exit,
    FetchResult,
    GetRefResult,
    PickledValue,
    Ref,
    RemoteFunctionFailed,
    RequestStatus,
    SessionFailed,
    Status,
    WorkerError,
)
from ..protocol import batch
from ..worker.plugin import deliver_batch, sync_batch
from .answers import AnswerLost
from .coalescing import HeldDelete, held_messages
from .local import propagating
from .task_keys import parse_task_key, task_key

__all__ = ["Transport", "dumps"]

logger = logging.getLogger("dask_monarch.controller")


def dumps(messages: list) -> bytes:
    """Pickle ``messages``; local tensors among their arguments pickle locally, not as mesh ops."""
    with propagating():
        try:
            return pickle.dumps(messages, protocol=5)
        except Exception:
            return cloudpickle.dumps(messages, protocol=5)


class Transport:
    """The session's transport (a part of ``Session``; see the module's docstring). ``_init_transport`` makes its
    state: the buffer, per-rank batch numbers and tasks in flight, the answers' order, and the fetch results."""

    def _init_transport(self) -> None:
        self._buffer: list = []  # (targets tuple, message)
        self._batch_seq = [0] * self.world_size
        self._inflight: list = [deque() for _ in range(self.world_size)]
        self._answers_next = [0] * self.world_size  # per rank: the next outbox chunk to apply
        self._answers_held: list[dict] = [{} for _ in range(self.world_size)]  # chunks that came early
        self._fetch_results: dict[int, FetchResult] = {}
        self.get_ref_results: deque = deque()
        #: with ``record_answers``: every controller message received, as (rank, message), in arrival order
        self.answers: deque | None = deque() if self._record_answers else None
        self._wake = threading.Event()

    # -------------------------------------------------------------------------------------------- sending
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
        deletes = [(targets, message.ref) for targets, message in items if type(message) is HeldDelete]
        items = [item for item in items if type(item[1]) is not HeldDelete]
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
        for targets, segment in batch.segments(items, dumps):
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

    def _exit_remote(self, reason: str) -> None:
        """Best effort, no wait: ``Exit`` with an error to every rank whose worker is still there, so that peers
        release their communicators (a stream blocked in a collective with the failed rank errors out) and the
        session's threads and tensors are freed."""
        with self.lock:
            blob = dumps([Exit((None, reason[:2000]))])
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
