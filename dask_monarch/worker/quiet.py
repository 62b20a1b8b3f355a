"""Quiet ranks (issue 23 items 1 and 6): the part of a host's relay (``worker/relay.py``, ``HostRelay``) that
answers a fetch's barrier itself for the ranks that have nothing else to do.

A fetch sends ``RequestStatus{seq}`` to every rank, and most ranks have nothing else to do for it
(spec §1 "Fetch"). For a flush that ends with ``RequestStatus{seq}``, the controller's frame says which ranks get
more than that (``"q": (seq, busy)``; ``busy`` None: every rank). The relay answers the barrier itself for a rank
that gets nothing else and has passed everything it was sent (its last batch ended with a ``RequestStatus`` that
it answered, and its sockets are up): by the barrier's rule (spec §2) that rank would answer ``Status{seq + 1}`` at
once, and nothing can reach its streams but through this relay. The relay counts it as passed, and hands the
batch to the rank later, in order, as ``{"d": [(batch, seq), ...]}`` (``SocketInbox.noted``: applied without a
``Status`` for each): before the rank's next batch, or within ``QUIET_DELAY`` seconds. So consecutive fetches at a
mesh wake the fetched rank and the relays only, not every rank per fetch; a sub-relay all of whose ranks are quiet
is answered for the same way (its ``"d"`` lists ``(rank, batch, seq)``), and a rank that is busy, or that the relay
(or the sub-relay: its ``("l", rank, why)``) lost, is asked as before.

A rank is answered for only while its process runs (``proc_state.py``: not stopped, traced or gone; for a sub-relay,
every one of its ranks') and was heard from within ``QUIET_HEARD`` seconds (a rank answers each hand-over with one
``Status``): a stopped process is asked instead, and the fetch waits for it as the heartbeat bound expects.
"""

from __future__ import annotations

import time

__all__ = ["NEVER", "QUIET_DELAY", "QUIET_HEARD", "QuietRanks"]

#: seconds a quiet rank's barrier that the relay answered may wait before it is handed to the rank (the module's
#: docstring): a Dask task copy of it (``sync_batch``) and the dashboard's view of the rank wait that long at most
QUIET_DELAY = 0.025
#: seconds since a rank (a sub-relay) was last heard from, past which it is asked, not answered for: a stopped
#: process is then waited for, and caught by the heartbeat bound as before (a rank answers each hand-over)
QUIET_HEARD = 1.0
NEVER = float("inf")  # what a rank must pass after a batch without a barrier: it is not quiet before its next one


class QuietRanks:
    """``HostRelay``'s quiet-rank methods; they use its ``_lock``, ``_fan_out``, ``_passed``, ``_need``,
    ``_deferred``, ``_due``, ``_low``, ``_held``, ``outbox``, ``links``, ``children``, ``_child_of`` and ``_send``."""

    def _answer_quiet(self, frames: list, seq: int | None, busy) -> list | None:
        """Under the fan-out lock, before ``frames`` (``[(link, msg)]``) are written: what each link must pass to
        count as quiet after them, and the barriers answered here, whose ``msg`` becomes None (kept for a later
        ``_hand_over``). Returns None if none was answered here, else what went to the controller (maybe ``[]``)."""
        need = NEVER if seq is None else seq + 1
        busy = None if busy is None else set(busy)
        answered = False
        recent = time.monotonic() - QUIET_HEARD
        with self._lock:
            for i, (link, msg) in enumerate(frames):
                key = link.rank
                if busy is not None and link.alive and not link.ended and link.heard > recent \
                        and self._passed[key] >= self._need[key] and all(p.running() for p in link.procs) \
                        and (key not in busy if link.ranks is None
                             else len(msg["b"]) == len(link.ranks) and busy.isdisjoint(link.ranks)
                             and not link.lost_ranks and not link.done):
                    entries = [(msg["b"], seq)] if link.ranks is None else [(r, b, seq) for r, b, _ in msg["b"]]
                    self._deferred.setdefault(link, []).extend(entries)
                    self._passed[key] = max(self._passed[key], need)
                    frames[i] = (link, None)
                    answered = True
                self._need[key] = need
            if not answered:
                return None
            low = min(self._passed.values())
            if low <= self._low:
                return []
            self._low = low
            self._held.append(("s", low))
            out, self._held = self._held, []
            self.outbox.extend(out)
            return out

    def _hand_over(self, link) -> None:
        """Under the fan-out lock: hand ``link`` the barriers answered for it (``{"d": [...]}``)."""
        entries = self._deferred.pop(link, None)
        if entries:
            self._send(link, {"d": entries})

    def _hand_over_all(self) -> None:
        """On the fan-in thread, at ``QUIET_DELAY`` after a barrier was answered here: hand every link its own; if
        a flush is being written meanwhile (a stopped rank may hold it up to ``SEND_TIMEOUT``), later, so that this
        thread goes on reading the answers."""
        if not self._fan_out.acquire(blocking=False):
            self._due = time.monotonic() + QUIET_DELAY
            return
        try:
            self._due = None
            for link in list(self._deferred):
                self._hand_over(link)
        finally:
            self._fan_out.release()

    def noted(self, entries: list) -> None:
        """On a sub-relay: ``entries`` (``[(rank, batch, seq)]``), barriers that the host relay answered for its
        ranks, handed to each rank at once (the host relay waited already)."""
        per_link: dict = {}
        for rank, batch, seq in entries:
            link = self.links.get(rank)
            if link is not None:
                per_link.setdefault(link, []).append((batch, seq))
            elif rank in self._child_of:
                per_link.setdefault(self._child_of[rank], []).append((rank, batch, seq))
        with self._fan_out:
            for link, items in per_link.items():
                if link in self._deferred:
                    self._hand_over(link)
                self._send(link, {"d": items})

    def _close_procs(self) -> None:
        """Give back the ``/proc`` descriptors (under the fan-out lock: no ``_answer_quiet`` reads them meanwhile)."""
        with self._fan_out:
            for link in [*self.links.values(), *self.children.values()]:
                for proc in link.procs:
                    proc.close()
