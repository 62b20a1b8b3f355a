"""``Inbox``: the per-(session, worker) reorder buffer (DESIGN.md "Seed concept -> Dask concept").

Dask runs pinned tasks out of order (LIFO ties; spec/dask-notes.md §0, §1.5), so every batch carries its
sequence number and the dispatcher takes batches strictly in that order. A duplicate delivery is ignored.
"""

from __future__ import annotations

import threading

__all__ = ["Inbox"]


class Inbox:
    """Batches keyed by a per-worker batch number starting at 0, handed out in order."""

    def __init__(self):
        self._cond = threading.Condition()
        self._pending: dict[int, list] = {}
        self._next = 0
        self._closed = False

    def put(self, batch_seq: int, segments: list) -> bool:
        """Accept batch ``batch_seq`` (a list of pickled segments). Returns False for a duplicate."""
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
