"""``Inbox``: the per-(session, worker) reorder buffer (DESIGN.md "Seed concept -> Dask concept"), and
``load_segment``, which opens the pickled segments of its batches.

Dask runs pinned tasks out of order (LIFO ties; spec/dask-notes.md §0, §1.5), so every batch carries its
sequence number and the dispatcher takes batches strictly in that order. A duplicate delivery is ignored.
"""

from __future__ import annotations

import gc
import pickle
import threading
import weakref

from ..protocol import DeleteRefs, ProtocolError, RequestStatus
from .errors import FatalError

__all__ = ["Inbox", "SocketInbox", "load_segment"]


_gc_lock = threading.Lock()
_gc_pausers = 0  # load_segment calls running now (the dispatcher's and every stream thread's)
_gc_resume = False  # whether the first of them found the GC enabled


def load_segment(segment: bytes) -> list:
    """The messages of a pickled segment (``protocol/batch.py``), unpickled with the cyclic garbage collector
    paused: a segment allocates thousands of small objects, and the collections they would trigger cost several
    times the unpickling itself. Messages pickle as calls of their validating constructors
    (``protocol/messages.py``): a malformed one raises ``FatalError`` ("malformed message: ...") here, as does a
    segment that cannot be unpickled.

    The dispatcher and every stream thread call this at once, and the GC switch is process-wide: the pause is
    counted (the first caller pauses, the last resumes), so that the GC stays paused while any load runs and is
    never left off (a check-then-disable per caller could read "disabled" from a concurrent load and then disable
    it after that load had resumed it, for good)."""
    global _gc_pausers, _gc_resume
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_resume = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        return pickle.loads(segment)
    except ProtocolError as e:
        raise FatalError(f"malformed message: {e}") from None
    except Exception as e:
        raise FatalError(f"could not unpickle a message batch: {type(e).__name__}: {e}") from None
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_resume:
                gc.enable()


class Inbox:
    """Batches keyed by a per-worker batch number starting at 0, handed out in order."""

    def __init__(self):
        self._cond = threading.Condition()
        self._pending: dict[int, list] = {}
        self._next = 0
        self._closed = False
        self._active = False  # the dispatcher took a batch and has not said ``done`` yet
        self._taken = False  # another thread took a batch (``take``) and has not said ``release`` yet

    def put(self, batch_seq: int, segments: list) -> bool:
        """Accept batch ``batch_seq`` (a list of segments, ``protocol/batch.py``: pickled bytes, stream segments, or
        lists of messages ``SocketInbox`` already opened). Returns False for a duplicate, and
        for ``segments`` None: a receipt, the task copy of a batch that travels on its host's relay alone
        (``controller/transport.py``)."""
        if segments is None:
            return False
        with self._cond:
            if self._closed or batch_seq < self._next or batch_seq in self._pending:
                return False
            self._pending[batch_seq] = segments
            if batch_seq == self._next:
                self._cond.notify()
            return True

    def get(self) -> list | None:
        """Block until the next batch in order is here and return it, or None once closed."""
        with self._cond:
            while (self._taken or self._next not in self._pending) and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            segments = self._pending.pop(self._next)
            self._next += 1
            self._active = True
            return segments

    def done(self) -> None:
        """The dispatcher has applied the batch it took last, and flushed its streams."""
        with self._cond:
            self._active = False

    def take_idle(self, batch_seq: int, idle) -> bool:
        """Take batch ``batch_seq`` out of turn, for the caller to apply itself (``SocketInbox``): only if it is the
        next one in order, none is waiting, the dispatcher is not applying one and ``idle()`` (called under this
        inbox's lock, so the dispatcher cannot start meanwhile) says so. Returns whether it was taken."""
        return self._take(batch_seq, idle, hold=False)

    def take(self, batch_seq: int) -> bool:
        """Take batch ``batch_seq`` out of turn, for the caller to apply itself in the dispatcher's place
        (``SocketInbox``): only if it is the next one in order, none is waiting and the dispatcher is not applying
        one. Until ``release()``, the dispatcher takes no batch. Returns whether it was taken."""
        return self._take(batch_seq, None, hold=True)

    def _take(self, batch_seq: int, idle, hold: bool) -> bool:
        with self._cond:
            if self._closed or self._active or self._taken or self._pending or batch_seq != self._next \
                    or (idle is not None and not idle()):
                return False
            self._next += 1
            self._taken = hold
            return True

    def release(self) -> None:
        """The caller of ``take`` has applied its batch: the dispatcher may take the next one."""
        with self._cond:
            self._taken = False
            if self._next in self._pending:
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify_all()

    @property
    def next_batch(self) -> int:
        return self._next

    def waiting(self) -> int:
        """Batches delivered but not yet taken (held back by an earlier missing one, or not yet reached)."""
        return len(self._pending)


#: the most bytes of a segment that ``SocketInbox`` opens (a lone ``RequestStatus`` pickles to about 75 bytes, a
#: ``DeleteRefs`` of a few refs to a few hundred)
_SMALL = 2048


class SocketInbox:
    """What a rank's answer sockets (``worker/sockets.py``) deliver the controller's batches to, on their reader
    thread: the tensor worker's ``Inbox``, except that a batch that is a lone ``RequestStatus`` (a fetch or sync at
    a rank that has nothing else to do for it) is answered right there when the rank is idle (no batch waiting or
    being applied, and every stream has run all that was handed to it): ``Status{seq + 1}`` is emitted from the
    reader thread, which writes it on the up socket, instead of the dispatcher's and a stream's thread each waking
    up for it in turn. What it answers is what the barrier would (spec §2: every stream has run what was queued
    before). Profiled at 8 ranks on 2 cores (``bench/fetch_costs.py``, docs/benchmarks.md): the two hand-offs cost
    a plain rank about 90 us of CPU and two wake-ups a fetch.

    Likewise a batch that only hands work to streams (stream segments, which their threads open, and lone
    ``RequestStatus`` barriers: a training step's ops and its loss's fetch), when the dispatcher is not applying one
    and none is waiting, is handed to the streams right here (``TensorWorker.enqueue_batch``, holding the inbox with
    ``Inbox.take``): the dispatcher's wake-up is saved. Any other batch (its messages may block, or create streams)
    takes the ordinary way, in order. ``answered`` and ``enqueued`` count the batches answered and handed over
    here. It holds the tensor worker weakly."""

    def __init__(self, tensor_worker):
        self.inbox = tensor_worker.inbox
        self._tw = weakref.ref(tensor_worker)
        self.answered = 0
        self.enqueued = 0  # batches handed to the streams here, in the dispatcher's place
        self.noted_count = 0  # batches its host relay answered (``noted``)

    def put(self, batch_seq: int, segments: list) -> bool:
        tw = self._tw()
        if tw is None or tw.failure is not None or tw.closed:
            return self.inbox.put(batch_seq, segments)
        opened = _open_small(segments)
        if opened is None:  # a message for the dispatcher itself: the ordinary way
            return self.inbox.put(batch_seq, segments)
        if len(opened) == 1 and len(opened[0]) == 1 and type(opened[0][0]) is RequestStatus \
                and self.inbox.take_idle(batch_seq, lambda: _idle(tw)):
            msg = opened[0][0]
            tw.received += 1
            tw.current = msg
            self.answered += 1
            tw.emit_status(msg.seq, msg.controller)
            return True
        if not all(type(m) in _ENQUEUE_ONLY for part in opened if type(part) is list for m in part) \
                or not self.inbox.take(batch_seq):  # needs the dispatcher, or it is busy, or a batch is waiting
            return self.inbox.put(batch_seq, opened)  # the dispatcher does not open them again
        try:
            tw.enqueue_batch(opened)
        finally:
            self.inbox.release()
        self.enqueued += 1
        return True

    def noted(self, entries: list) -> None:
        """``entries``: ``[(batch_seq, seq), ...]``, batches that were a lone ``RequestStatus{seq}`` which this rank's
        host relay answered for it (the rank had run all it was sent before: ``worker/relay.py``, "Quiet ranks") and
        hands over later. Each is applied here as ``put`` would; only the last one's ``Status`` is reported, which
        tells the relay that the rank is still there (``relay.QUIET_HEARD``). A rank that is not idle after all takes
        it the ordinary way (its ``Status`` then goes to the relay, which keeps the highest)."""
        tw = self._tw()
        last = len(entries) - 1
        for i, (batch_seq, seq) in enumerate(entries):
            msg = RequestStatus(seq, False)
            if tw is not None and tw.failure is None and not tw.closed \
                    and self.inbox.take_idle(batch_seq, lambda: _idle(tw)):
                tw.received += 1
                tw.current = msg
                self.noted_count += 1
                tw.emit_status(seq, report=i == last)
            else:
                self.inbox.put(batch_seq, [[msg]])  # opened: the dispatcher applies it as it is


#: messages whose handlers only enqueue on the streams (never block, create nothing): ``SocketInbox`` applies a batch
#: of these and stream segments on its own thread
_ENQUEUE_ONLY = (RequestStatus, DeleteRefs)


def _open_small(segments: list) -> list | None:
    """``segments`` with every small one (at most ``_SMALL`` bytes) that holds a barrier or a deletion (which pickles
    as ``protocol/wire_forms.delete_refs_from_wire``) opened into its list of messages (the dispatcher takes such
    lists as they are), or None if a segment is left that only the dispatcher should open (a larger one, or a run
    of other messages). Stream segments (tuples) stay as they are."""
    out = []
    for segment in segments:
        if type(segment) is bytes:
            if len(segment) > _SMALL or (b"RequestStatus" not in segment and b"delete_refs" not in segment):
                return None
            try:
                segment = load_segment(segment)
            except Exception:  # the dispatcher reports it, in order
                return None
        elif type(segment) is not tuple:
            return None
        out.append(segment)
    return out


def _idle(tw) -> bool:
    """Whether every stream of ``tw`` has run everything handed to it (read under the inbox's lock, while the
    dispatcher, which alone hands them work, is idle)."""
    if tw.failure is not None or tw.closed:
        return False
    return all(not s.pending and s.applied == s.enqueued for s in tw.streams.values())
