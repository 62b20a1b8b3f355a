"""Transport of a session (``Session``'s concern ``Transport``; DESIGN.md "Performance design"): batching,
flushing, and applying the answers.

Messages are buffered and flushed as one batch per worker: after ``max_batch`` messages, before any wait, and by a
background flusher a few milliseconds after the first buffered message. Consecutive messages for the same set of
ranks (and the same stream, for messages that run on one stream) form a segment that is pickled once and shared
by every rank's batch, so a message to every rank is serialized once (``protocol/batch.py``). Each rank's batches
carry an increasing number; the worker's inbox restores the order that Dask does not keep.

Every batch travels as a pinned Dask task (keys ``monarch-<session>-messages-...``; ``monarch-<session>-fetch-...``,
``-status-...``, ``-exit-...`` for a batch that ends with ``RequestStatus``: ``task_keys``). When the
rank has an answer channel (``channel.py``), the batch is written on it at once, and its task waits up to
``task_period`` seconds, travelling with the rank's other batches of that time as one task (an exit's goes at
once). A batch its host's relay took (``tree.py``: its only way, as a lost relay fails the session) goes in its
task as its number alone, a receipt the inbox ignores: its bytes (~1 KB an eager op a rank) skip the scheduler.
The answers come back in numbered chunks of the worker's outbox, on the channel or in the ``sync_batch`` tasks'
results, and a rank's chunks are applied in that order, whichever way and in whatever order they come.
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
from ..worker.plugin import deliver_batch, deliver_batches, sync_batch, sync_batches
from .answers import AnswerLost
from .coalescing import HeldDelete, held_messages
from .local import propagating
from .task_keys import parse_task_key, task_key

__all__ = ["Transport", "dumps"]

logger = logging.getLogger("dask_monarch.controller")
_new_object = object.__new__


def dumps(messages: list) -> bytes:
    """Pickle ``messages``; local tensors among their arguments pickle locally, not as mesh ops. Plain ``pickle``:
    every flush runs this, and a pickler with a ``reducer_override`` (``protocol/tensor_bytes.py``) costs a Python
    call per message object (about 20 % more per batch)."""
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
        self._fetch_results: dict[int, dict] = {}  # seq -> {rank: FetchResult}
        self.get_ref_results: deque = deque()
        #: with ``record_answers``: every controller message received, as (rank, message), in arrival order
        self.answers: deque | None = deque() if self._record_answers else None
        self._wake = threading.Event()
        #: the answer channels (``channel.py``), or None (Dask config ``monarch.answer-channel: false``)
        self.channels = None
        self._later: list[list] = [[] for _ in range(self.world_size)]  # per rank: (batch, segments, sync) sent on
        self._later_due: float | None = None  # its channel, whose task is not yet submitted; when to submit them

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
            if self._urgent_deletes:  # an OpaqueRef's handle was dropped: its object goes before what follows
                self._urgent_deletes = False
                self._buffer.extend(self._take_deletes())
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
        """Send what is buffered now, and submit the Dask tasks of every batch sent so far (``task_interval``)."""
        with self.lock:
            self._flush_locked(None)
            self._submit_later()

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
        drop = self.history.drop_ref
        for targets, ref_id in taken:
            ref = _new_object(Ref)  # without Ref's check of its id: the session's count made it
            ref.id = ref_id
            by_targets.setdefault(targets, []).append(ref)
            drop(ref_id)
        return [(targets, DeleteRefs(refs)) for targets, refs in by_targets.items()]

    def _flush_locked(self, sync_seq: int | None, exit_after: bool = False, kind: str = "status",
                      tasks: dict | None = None) -> None:
        """Send what is buffered as one batch per rank (a ``monarch-<session>-messages-...`` task). With ``sync_seq``,
        every rank's batch ends with ``RequestStatus{sync_seq}`` (then ``Exit`` if ``exit_after``), and its task is
        a ``sync_batch`` task of ``kind`` (``task_keys``), entered in ``tasks`` (rank -> Dask future) once
        submitted (at once for a rank without a channel, and for an exit)."""
        items = self._buffer
        self._buffer = []
        self._wake.clear()
        items.extend(self._take_deletes())
        quiet = None  # a sync flush's (seq, the ranks that get more than its RequestStatus), for the host relays
        if sync_seq is not None:
            quiet = None if exit_after else (sync_seq, batch.targeted(items, self._all))
            items.append((self._all, RequestStatus(sync_seq, False)))
            if exit_after:
                items.append((self._all, Exit(None)))
        if not items:
            return
        # consecutive messages with the same targets (and stream, for stream messages) form one segment, pickled
        # once (protocol/batch.py)
        segments = batch.segments(items, dumps)
        everyone = self._all
        if all(targets is everyone for targets, _ in segments):
            # every segment for every rank (the common case): one list, whose indices every host's frame shares, so
            # a flush costs O(segments + ranks), not O(segments x ranks) (BENCHMARKS.md "A model at 1,024 ranks")
            shared = [segment for _, segment in segments]
            shared_idx = list(range(len(shared)))
            per_rank: list = [shared] * self.world_size
        else:
            shared = None
            per_rank = [[] for _ in range(self.world_size)]
            for targets, segment in segments:
                for r in targets:
                    per_rank[r].append(segment)
        channels = self.channels
        relays = channels.relays if channels is not None and channels.tree else None
        hosts: dict = {}  # HostLink -> ([(rank, batch, [segment index])], [segment], {id(segment): index})
        for rank, blobs in enumerate(per_rank):
            if not blobs:
                continue
            bseq = self._batch_seq[rank]
            self._batch_seq[rank] = bseq + 1
            sync = None if sync_seq is None else (sync_seq, "exit" if exit_after else kind, tasks)
            self._later[rank].append((bseq, blobs, sync))
            host = relays[rank] if relays is not None else None
            if host is not None:  # one frame per host, each segment once (tree.py)
                if blobs is shared:  # every rank has every segment: the host's frame carries them in order
                    (hosts.get(host) or hosts.setdefault(host, ([], shared, None)))[0].append((rank, bseq, shared_idx))
                    continue
                entries, segs, index = hosts.get(host) or hosts.setdefault(host, ([], [], {}))
                idx = []
                for blob in blobs:
                    i = index.get(id(blob))
                    if i is None:
                        i = index[id(blob)] = len(segs)
                        segs.append(blob)
                    idx.append(i)
                entries.append((rank, bseq, idx))
                continue
            if channels is not None and channels.send(rank, bseq, blobs) and not exit_after:
                self._tasks_later()
                continue
            self._submit(rank)
        for host, (entries, segs, _) in hosts.items():
            if host.send(entries, segs, quiet):
                for rank, _, _ in entries:  # its task carries its number alone (the module's docstring)
                    self._later[rank][-1] = (self._later[rank][-1][0], None, self._later[rank][-1][2])
                if not exit_after:
                    self._tasks_later()
                    continue
            for rank, _, _ in entries:
                self._submit(rank)

    def _tasks_later(self) -> None:
        """The batches just sent on channels travel as Dask tasks later (``task_period``): the flusher submits them."""
        if self._later_due is None:
            self._later_due = time.monotonic() + self.task_period
            self._wake.set()

    @property
    def task_period(self) -> float:
        """Seconds a batch sent on a channel waits for its Dask task: ``task_interval`` times the number of ranks,
        so that the scheduler gets about one such task per ``task_interval`` whatever the mesh's size (issue 23
        item 3: the tasks are the dashboard's copy; the channels carry the batches and the answers)."""
        return self.task_interval * self.world_size

    def _submit(self, rank: int):
        """Submit the batches of ``rank`` not yet sent as a task (``_later``) as one pinned task; returns its future."""
        entries, self._later[rank] = self._later[rank], []
        syncs = [sync for _, _, sync in entries if sync is not None]
        common = dict(workers=[self.workers[rank]], allow_other_workers=False, pure=False, priority=-entries[0][0])
        params, last = self.params[rank], entries[-1][0]
        one = len(entries) == 1  # deliver_batch / sync_batch, else deliver_batches / sync_batches
        args = (last, entries[0][1]) if one else ([(b, segments) for b, segments, _ in entries],)
        if syncs:
            status_seq, kind = max(s[0] for s in syncs), syncs[-1][1]
            fut = self.client.submit(sync_batch if one else sync_batches, params, *args, status_seq, kind == "exit",
                                     key=task_key(kind, self.id, rank, last), **common)
        else:
            fut = self.client.submit(deliver_batch if one else deliver_batches, params, *args,
                                     key=task_key("messages", self.id, rank, last), **common)
        self._answers.add(fut, sync=bool(syncs))
        for _, _, tasks in syncs:
            if tasks is not None:
                tasks[rank] = fut
        inflight = self._inflight[rank]
        inflight.append(fut)
        while inflight and inflight[0].done():
            inflight.popleft()
        return fut

    def submit_tasks_of(self, status_seq: int) -> None:
        """Submit now the Dask tasks that carry the ``RequestStatus{status_seq}`` batches (``MonarchFuture.futures``)."""
        with self.lock:
            for rank, entries in enumerate(self._later):
                if any(sync is not None and sync[0] == status_seq for _, _, sync in entries):
                    self._submit(rank)

    def _submit_later(self) -> None:
        """Submit every rank's batches that went on its channel and still wait for their task."""
        self._later_due = None
        for rank, entries in enumerate(self._later):
            if entries:
                self._submit(rank)

    def _channel_lost(self, rank: int, error: BaseException, what: str = "answer channel",
                      instead: str = "Dask task results") -> None:
        """Rank ``rank``'s channel (``what``: its comm, or its answer sockets) broke (on the event loop, or the
        sockets' thread): its batches go on the way left (``instead``), and the tasks of those already sent on it
        are submitted now (the flusher does it: no lock here)."""
        # the program closing its own Client under the session closes the channels too: no news then; nor once
        # the session failed (its error, logged already, says why; nothing comes back on the way left)
        quiet = (self.closed or self.failure is not None
                 or getattr(self.client, "status", None) in ("closing", "closed"))
        logger.log(logging.DEBUG if quiet else logging.WARNING,
                   "dask_monarch: session %s: the %s to rank %d (%s) closed (%s: %s); its answers come back on %s "
                   "from now on", self._key, what, rank, self.workers[rank], type(error).__name__, error, instead)
        self._later_due = time.monotonic()
        self._wake.set()

    def _flush_loop(self) -> None:
        """The background flusher: flushes ``flush_interval`` seconds after a message is buffered into an empty
        buffer, and submits the tasks of the batches sent on channels when they are due (``task_interval``)."""
        while not self.closed:
            due = self._later_due
            woke = self._wake.wait(None if due is None else max(0.0, due - time.monotonic()))
            if self.closed:
                return
            if woke and self._buffer:
                time.sleep(self.flush_interval)
            try:
                with self.lock:
                    if self.failure is not None or self.closed:
                        self._wake.clear()
                        self._later_due = None
                        continue
                    self._flush_locked(None)
                    if self._later_due is not None and time.monotonic() >= self._later_due:
                        self._submit_later()
            except Exception as e:  # the client is gone: report it on the next use
                why = self._client_closed() or f"could not send a message batch: {e}"
                self._fail(SessionError(f"session {self.id}: {why}"))

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
            closed = self._client_closed()
            why = f"cancelled: {closed}" if closed else (
                f"cancelled (the cluster was restarted, or the task was released){self._meanwhile()}")
            self._fail(SessionError(
                f"session {self.id}: the status request to rank {rank} ({self.workers[rank]}, {fut.key}) was {why}"
            ))
            return
        if fut.status == "error":
            exc = self._answers.exception(fut)
            self._fail(SessionError(f"session {self.id}: status request to rank {rank} ({fut.key}) failed: {exc}"))
            return
        try:
            blobs = self._answers.result(fut)
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
        for blob in blobs:
            self._on_chunk(rank, blob)

    def _client_closed(self) -> str | None:
        """Why nothing more can run, if the program closed the session's ``Client`` while the session was open."""
        if self.client.status in ("closing", "closed"):
            return (f"the session's Client ({self.client.id}) was closed while the session was open; attach again "
                    "with an open Client")
        return None

    def _on_chunk(self, rank: int, blob) -> None:
        """Apply answer chunk ``blob`` of rank ``rank`` (pickled ``(chunk, messages)``, from a task's result or the
        rank's channel, or already unpickled by ``_chunk_inline``; on the answers thread). Each rank's chunks are
        applied in their order (Dask may finish two status tasks of one rank in either order, and a chunk may come
        both ways: a Status applied before the FetchResult it follows would resolve a fetch without its value); one
        that came already is ignored."""
        if type(blob) is tuple:
            chunk, messages = blob
        elif type(blob) is int:  # a relayed rank's chunk of Status alone (``Outbox._take``), if its relay was lost
            chunk, messages = None, [Status(blob, self.workers[rank])]
        else:
            try:
                chunk, messages = pickle.loads(blob)
            except Exception as e:
                self._fail(SessionError(f"session {self.id}: could not read rank {rank}'s answers: {e}"))
                return
        if chunk is not None and (chunk < self._answers_next[rank] or chunk in self._answers_held[rank]):
            return
        messages = [self._unwrap(rank, m) if type(m) is FetchResult else m for m in messages]
        note = ""
        failed = [m for m in messages if type(m) is SessionFailed]
        if self.failure is None and failed:
            # a rank failing in a collective often reports a lost peer (connection reset, timeout): name the
            # worker that left or went silent, if the scheduler knows one
            note = self._departed(failed[0].error.backtrace)
        with self.lock:
            self._apply_chunk(rank, chunk, messages, note)

    #: the largest answer chunk (bytes) applied on the event loop (``_chunk_inline``); larger ones go to the thread
    INLINE_CHUNK = 64 * 1024

    def _chunk_inline(self, rank: int, blob: bytes):
        """Apply a channel's answer chunk right here on the event loop when that is cheap and cannot wait on anything
        (``Answers.put_chunk``): a chunk of at most ``INLINE_CHUNK`` bytes of ``Status`` and ``FetchResult`` answers
        only (not ``SessionFailed``, whose report asks the scheduler who left, nor a failure, which marks every
        user of the failed seq; nor a separately pickled fetched value, whose class may import a module), when the
        session lock is free now (a thread holding it may be waiting for this event loop). Returns None if applied,
        else what the answers thread is to apply (the unpickled ``(chunk, messages)``, or ``blob`` itself)."""
        if type(blob) is not bytes or len(blob) > self.INLINE_CHUNK:  # a tuple: one with out-of-band tensors
            return blob
        try:
            decoded = pickle.loads(blob)
        except Exception:
            return blob  # the answers thread reports it
        chunk, messages = decoded
        if chunk is None:
            return decoded
        for m in messages:
            kind = type(m)
            if kind is not Status and (kind is not FetchResult or type(m.value) is PickledValue):
                return decoded
        if not self.lock.acquire(blocking=False):
            return decoded
        try:
            if chunk >= self._answers_next[rank] and chunk not in self._answers_held[rank]:
                self._apply_chunk(rank, chunk, messages, "")
        finally:
            self.lock.release()
        return None

    def _apply_chunk(self, rank: int, chunk: int | None, messages: list, note: str) -> None:
        """Apply ``messages``, chunk ``chunk`` of rank ``rank``, in chunk order (held until the chunks before it have
        been applied). Under the session lock."""
        if chunk is None:  # the session had already ended on that worker
            for msg in messages:
                self._handle(rank, msg, note)
            return
        if chunk < self._answers_next[rank]:  # applied already: it came both ways (the sockets' reader checks late)
            return
        held = self._answers_held[rank]
        held[chunk] = (messages, note)
        while self._answers_next[rank] in held:
            messages, note = held.pop(self._answers_next[rank])
            self._answers_next[rank] += 1
            for msg in messages:
                self._handle(rank, msg, note)

    def _advanced(self) -> None:
        """Every rank has passed ``history.completed``: resolve the waits below it. Under the session lock."""
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
                self._advanced()
        elif kind is RemoteFunctionFailed:
            what = self.functions.get(msg.seq, "")
            if msg.controller_frame_index is not None and hasattr(what, "operation"):  # a compiled call's operation
                what = what.operation(msg.controller_frame_index)
            err = RemoteException(msg.seq, rank, self.workers[rank], msg.error.backtrace, str(what))
            self.history.fail(msg.seq, err)
        elif kind is FetchResult:
            self._fetch_results.setdefault(msg.seq, {})[rank] = msg
        elif kind is GetRefResult:
            self.get_ref_results.append((rank, msg))
        elif kind is SessionFailed:
            self._fail(self._failed_on(rank, msg.error.backtrace, note))
        else:
            logger.warning("dask_monarch: ignoring unknown answer %r from rank %d", msg, rank)

    def take_fetch_result(self, seq: int) -> FetchResult | None:
        """The ``FetchResult`` of ``seq`` (a fetch asks one rank), or None."""
        answers = self._fetch_results.pop(seq, None)
        return next(iter(answers.values())) if answers else None

    def take_fetch_results(self, seq: int) -> dict:
        """Every rank's ``FetchResult`` of ``seq`` (an actor call asks several): ``{rank: FetchResult}``."""
        return self._fetch_results.pop(seq, None) or {}

    def _exit_remote(self, reason: str | None) -> None:
        """Best effort, no wait: ``Exit`` with an error to every rank whose worker is still there, so that peers
        release their communicators (a stream blocked in a collective with the failed rank errors out) and the
        session's threads and tensors are freed. ``reason`` None: a clean ``Exit`` (nothing failed there)."""
        with self.lock:
            blob = dumps([Exit(None if reason is None else (None, reason[:2000]))])
            for rank, address in enumerate(self.workers):
                bseq = self._batch_seq[rank]
                self._batch_seq[rank] = bseq + 1
                try:
                    if self._later[rank]:  # sent on the channel only: the exit must not wait behind them
                        self._submit(rank)
                    if self.channels is not None:
                        self.channels.send(rank, bseq, [blob])
                    self._inflight[rank].append(self.client.submit(
                        deliver_batch, self.params[rank], bseq, [blob], key=task_key("exit", self.id, rank, bseq),
                        workers=[address], allow_other_workers=False, pure=False, priority=-bseq,
                    ))
                except Exception:
                    pass
