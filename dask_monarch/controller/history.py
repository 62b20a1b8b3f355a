"""``History``: the controller's dependency graph over seqs (spec §3 "Controller"; Monarch ``History``).

Every invocation is a node ``seq`` that defines some refs (results and mutated refs) and uses others. A failure
reported for a seq marks that seq and every transitive user failed (first error wins); a ref defined by a
failed seq carries its ``RemoteException``. ``Status`` reports from every rank advance the first incomplete seq;
nodes below it are forgotten, so memory follows the work in flight, not the length of the program.
"""

from __future__ import annotations

from collections import deque

__all__ = ["History"]


class History:
    """Bookkeeping for ``world_size`` ranks. Not thread-safe: the session calls it under its lock."""

    def __init__(self, world_size: int):
        self.first_incomplete = [0] * world_size
        self.completed = 0  # every seq below this is complete on every rank
        # how many ranks are still at ``completed`` (= min(first_incomplete)): the minimum is taken again only when
        # the last of them moves, so that a fetch's answers cost O(ranks) once, not O(ranks) each (issue 23 item 6:
        # at 128 hosts x 8, ``min`` over 1,024 ranks per host answer was 75 % of applying it, bench/host_costs.py)
        self._at_low = world_size
        self._defs: dict[int, list] = {}  # seq -> ref ids it defines (incomplete seqs only)
        self._users: dict[int, list] = {}  # seq -> seqs that used one of its refs (incomplete seqs only)
        self._producer: dict[int, int] = {}  # ref id -> seq that last defined it, while that seq is incomplete
        self.ref_errors: dict[int, Exception] = {}  # ref id -> the failure it carries
        self.failed: dict[int, Exception] = {}  # seq -> failure, for incomplete seqs
        self.unconsumed: dict[int, Exception] = {}  # id(root failure) -> failure nobody has been told about

    def new_node(self, seq: int, defs, uses) -> Exception | None:
        """Record invocation ``seq``. Returns the failure it inherits if an input already failed, else None."""
        inherited = None
        for ref in uses:
            err = self.ref_errors.get(ref)
            if err is not None:
                inherited = inherited or err
                continue
            producer = self._producer.get(ref)
            if producer is not None and producer >= self.completed:
                self._users.setdefault(producer, []).append(seq)
        if type(defs) is not list:
            defs = list(defs)
        self._defs[seq] = defs
        if inherited is not None:
            self.failed[seq] = inherited
            for ref in defs:
                self.ref_errors[ref] = inherited
        else:
            for ref in defs:
                self.ref_errors.pop(ref, None)
                self._producer[ref] = seq
        return inherited

    def fail(self, seq: int, error: Exception) -> None:
        """A rank reported that ``seq`` failed: mark it and every transitive user (breadth-first); first error wins."""
        if seq in self.failed:
            return
        self.unconsumed.setdefault(id(error), error)
        todo = deque([seq])
        while todo:
            s = todo.popleft()
            if s in self.failed:
                continue
            self.failed[s] = error
            for ref in self._defs.get(s, ()):
                self.ref_errors[ref] = error
            todo.extend(self._users.get(s, ()))

    def error_of(self, refs) -> Exception | None:
        """The failure carried by the first failed ref of ``refs``, if any."""
        for ref in refs:
            err = self.ref_errors.get(ref)
            if err is not None:
                return err
        return None

    def consumed(self, error: Exception) -> None:
        """``error`` reached the user (a fetch raised it); it is not raised again at exit."""
        self.unconsumed.pop(id(error), None)

    def status(self, rank: int, seq: int) -> bool:
        """Rank ``rank`` has completed every seq below ``seq``. Returns True if the global minimum advanced."""
        first = self.first_incomplete
        old = first[rank]
        if seq <= old:
            return False
        first[rank] = seq
        if old == self.completed:
            self._at_low -= 1
            if self._at_low == 0:
                return self._advance()
        return False

    def _advance(self) -> bool:
        """The last rank at ``completed`` moved: the new minimum, and how many ranks are at it."""
        low = min(self.first_incomplete)
        self._at_low = self.first_incomplete.count(low)
        if low <= self.completed:
            return False
        for s in [s for s in self._defs if s < low]:
            del self._defs[s]
            self._users.pop(s, None)
            self.failed.pop(s, None)
        self._producer = {r: s for r, s in self._producer.items() if s >= low}
        self.completed = low
        return True

    def status_many(self, ranks, seq: int) -> bool:
        """Every rank of ``ranks`` has completed every seq below ``seq`` (a host's relay answered for them).
        Returns True if the global minimum advanced."""
        first, low, moved = self.first_incomplete, self.completed, 0
        for rank in ranks:
            old = first[rank]
            if seq > old:
                first[rank] = seq
                moved += old == low
        if not moved:
            return False
        self._at_low -= moved
        return self._at_low == 0 and self._advance()

    def drop_ref(self, ref: int) -> None:
        """The controller deleted ``ref``."""
        self.ref_errors.pop(ref, None)
        self._producer.pop(ref, None)
