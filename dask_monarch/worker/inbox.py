"""``Inbox``: the per-(session, worker) reorder buffer (DESIGN.md "Seed concept -> Dask concept"), and
``load_segment``, which opens the pickled segments of its batches.

Dask runs pinned tasks out of order (LIFO ties; spec/dask-notes.md §0, §1.5), so every batch carries its
sequence number and the dispatcher takes batches strictly in that order. A duplicate delivery is ignored.
"""

from __future__ import annotations

import gc
import pickle
import threading

from ..protocol import ProtocolError
from .errors import FatalError

__all__ = ["Inbox", "load_segment"]


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

    def put(self, batch_seq: int, segments: list) -> bool:
        """Accept batch ``batch_seq`` (a list of segments, ``protocol/batch.py``). Returns False for a duplicate, and
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
            while self._next not in self._pending and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            segments = self._pending.pop(self._next)
            self._next += 1
            return segments

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
