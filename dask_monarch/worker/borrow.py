"""Borrows: a tensor of one stream used on another (spec §4 "Borrow protocol"; seed ``BorrowCreate``,
``BorrowFirstUse``, ``BorrowLastUse``, ``BorrowDrop``).

A ``Borrow`` is created by the dispatcher (``TensorWorker.borrow_create``) and lives until ``BorrowDrop``. Its
states advance Created -> FirstUsed -> LastUsed -> Dropped, checked in message order by the dispatcher; a
message out of that order, or for an unknown id, is fatal. The four steps run on stream threads:

* ``lend`` (the *from* stream, at ``BorrowCreate``): look the tensor up and hand it over, with a CUDA event
  recorded on the lender's stream, through the first-use channel. An errored tensor is handed over as its error.
* ``first_use`` (the *to* stream): wait for that hand-over (so it cannot run ahead of the creation point), make
  its CUDA stream wait on the event, and store the *same* tensor (an alias: writes are visible at the origin) or
  the error under ``result``.
* ``last_use`` (the *to* stream): record an event, remove ``result`` and hand it back through the last-use channel.
* ``drop`` (the *from* stream): wait for the hand-back and make the lender's stream wait on its event, then let the
  value go: whatever the lender does next is ordered after the borrower's work.

On CPU the channels alone order the two threads (host-side synchronization); the events are ``None``. A borrow
between a stream and itself works: each hand-over is queued on the stream before the step that waits for it.
Every wait is bounded by the session's ``comm_timeout`` and ends early when the session fails or closes.
"""

from __future__ import annotations

import enum
import queue
import time

import torch

from .errors import FatalError

__all__ = ["Borrow", "BorrowStep", "BorrowState", "SessionOver"]

_POLL = 0.2  # seconds between checks of the session's state while a stream waits for a hand-over


class BorrowState(enum.Enum):
    CREATED = "created"
    FIRST_USED = "first_used"
    LAST_USED = "last_used"
    DROPPED = "dropped"


#: which state each message needs and which it leads to
_NEXT = {
    "BorrowFirstUse": (BorrowState.CREATED, BorrowState.FIRST_USED),
    "BorrowLastUse": (BorrowState.FIRST_USED, BorrowState.LAST_USED),
    "BorrowDrop": (BorrowState.LAST_USED, BorrowState.DROPPED),
}


class BorrowStep:
    """One step of a borrow, queued on a stream like a message: the stream calls ``fn(stream)`` in order."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn


class Borrow:
    """Borrow ``id`` of ref ``tensor`` from stream ``lender`` to stream ``borrower`` as ref ``result`` (the
    ``StreamWorker``s of one ``TensorWorker``); ``timeout`` (seconds) bounds each wait for a hand-over."""

    def __init__(self, id: int, tensor, result, lender, borrower, timeout: float):
        self.id = id
        self.tensor = tensor
        self.result = result
        self.lender = lender
        self.borrower = borrower
        self.timeout = timeout
        self.state = BorrowState.CREATED
        self._first_use: queue.SimpleQueue = queue.SimpleQueue()
        self._last_use: queue.SimpleQueue = queue.SimpleQueue()

    def __repr__(self) -> str:
        return (
            f"borrow {self.id} ({self.tensor} of stream {self.lender.ref.id} as {self.result} on stream "
            f"{self.borrower.ref.id})"
        )

    # ------------------------------------------------------------------------------------ dispatcher side
    def advance(self, message: str) -> None:
        """Move on for ``message`` (``"BorrowFirstUse"``, ...); ``FatalError`` if the borrow is not in the state
        that message needs (spec §4: an out-of-order call)."""
        needed, after = _NEXT[message]
        if self.state is not needed:
            raise FatalError(
                f"{message}: {self!r} is {self.state.value}, but {message} needs it {needed.value} "
                "(the order is BorrowCreate, BorrowFirstUse, BorrowLastUse, BorrowDrop)"
            )
        self.state = after

    # ---------------------------------------------------------------------------------- stream-thread steps
    def lend(self, stream) -> None:
        """On the lending stream, at ``BorrowCreate``: hand ``tensor`` (or its error) to the borrower."""
        value = stream.env.get(self.tensor.id, _MISSING)
        if value is _MISSING:
            raise FatalError(f"BorrowCreate: {self!r}: ref not found: {self.tensor} on stream {stream.ref.id}")
        self._first_use.put((_record(stream, value), value))

    def first_use(self, stream) -> None:
        """On the borrowing stream, at ``BorrowFirstUse``: wait for the lender, then store the alias or error."""
        event, value = self._take(self._first_use, stream, "BorrowFirstUse", "lend", self.lender)
        if event is not None:
            stream.cuda_stream.wait_event(event)
            value.record_stream(stream.cuda_stream)  # the allocator must not reuse it before our work is done
        if self.result.id in stream.env:
            raise FatalError(f"BorrowFirstUse: {self!r}: Duplicate write to reference {self.result}")
        stream.env[self.result.id] = value

    def last_use(self, stream) -> None:
        """On the borrowing stream, at ``BorrowLastUse``: remove ``result`` and hand it back to the lender."""
        value = stream.env.pop(self.result.id, _MISSING)
        if value is _MISSING:
            raise FatalError(f"BorrowLastUse: {self!r}: ref not found: {self.result} on stream {stream.ref.id}")
        self._last_use.put((_record(stream, value), value))

    def drop(self, stream) -> None:
        """On the lending stream, at ``BorrowDrop``: wait for the hand-back; the lender's later work is ordered
        after the borrower's, and the value is released."""
        event, _value = self._take(self._last_use, stream, "BorrowDrop", "give back", self.borrower)
        if event is not None:
            stream.cuda_stream.wait_event(event)

    def _take(self, channel: queue.SimpleQueue, stream, message: str, what: str, peer):
        """The next item of ``channel``, waited for at most ``timeout`` seconds; ``FatalError`` naming the stream
        that did not answer. ``SessionOver`` as soon as the session fails or closes meanwhile."""
        tw = stream.tw
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return channel.get(timeout=_POLL)
            except queue.Empty:
                pass
            if tw.failure is not None or tw.closed:
                raise SessionOver()
            if time.monotonic() >= deadline:
                raise FatalError(
                    f"{message}: {self!r}: stream {peer.ref.id} did not {what} {self.tensor} within "
                    f"{self.timeout:g} s (comm_timeout); it is still running earlier work: "
                    f"{peer.applied} messages applied, {peer.backlog()} batches queued"
                )


class SessionOver(Exception):
    """The session failed or closed while a stream waited for a hand-over: the stream stops, reporting nothing."""


_MISSING = object()


def _record(stream, value):
    """A CUDA event recorded now on ``stream``'s CUDA stream when ``value`` is a CUDA tensor, else None."""
    if stream.cuda_stream is None or not isinstance(value, torch.Tensor) or not value.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(stream.cuda_stream)
    return event
