"""``Outbox``: what one session's tensor worker has to tell its controller (``RemoteFunctionFailed``,
``FetchResult``, ``Status``, ``SessionFailed``, ...), handed over in numbered chunks (issue 13; DESIGN.md
"Decisions": the answers the controller waits for may return on a faster path).

Chunks are numbered 0, 1, ... in the order they are taken, whoever takes them, and the controller applies a rank's
chunks in that order (``controller/transport.py``), so they may travel two ways:

* pushed on the session's answer channel when the controller opened one: a ``Status`` or ``SessionFailed`` (what
  the controller waits for) wakes the channel, which takes the chunk and writes it: the answer socket
  (``worker/sockets.py``) from the waking thread itself, the comm channel (``worker/channel.py``) on the worker's
  event loop. A pushed chunk is *retained* until the controller acknowledges it, and pushed again by the channel
  attached after the one that broke;
* returned by a ``sync_batch`` task (``for_task``): with a channel, the task first waits, at most ``settle``
  seconds, for the pushes under way and their acknowledgements, then takes what is still retained (the channel
  broke, or the controller is slow to acknowledge: the controller ignores a chunk it already has) and the rest of
  the outbox. Nothing is lost when the channel breaks, and nothing waits on it for longer than ``settle``.
"""

from __future__ import annotations

import collections
import threading

import cloudpickle
from dask.sizeof import sizeof

from ..protocol import FetchResult, SessionFailed, Status, WorkerError, tensor_bytes

__all__ = ["Outbox", "dumps_chunk"]

# a ``sync_batch`` task's result may hold an ``OutOfBand`` chunk: Dask's memory manager counts its tensors' bytes
sizeof.register(tensor_bytes.OutOfBand)(lambda chunk: chunk.nbytes)

#: the answers whose arrival wakes the channel (the controller waits for them); the others ride along
_PUSHED = (Status, SessionFailed)


def dumps_chunk(chunk: int | None, messages: list, actor_id: str):
    """Pickle ``(chunk, messages)`` (``protocol/tensor_bytes.py``: bytes, or a ``tensor_bytes.OutOfBand`` that
    refers to the memory of its large tensors, not a copy); a fetched value that cannot be pickled becomes that
    fetch's error, nothing is lost."""
    try:
        return tensor_bytes.dumps((chunk, messages))  # a fetched CPU tensor as its bytes
    except Exception:
        pass
    safe = []
    for msg in messages:
        try:
            cloudpickle.dumps(msg, protocol=5)
        except Exception as e:
            if not isinstance(msg, FetchResult):
                raise
            text = f"the fetched value of type {type(msg.value).__name__} cannot be pickled: {type(e).__name__}: {e}"
            msg = FetchResult(msg.seq, error=WorkerError(text, actor_id))
        safe.append(msg)
    return cloudpickle.dumps((chunk, safe), protocol=5)


class Outbox:
    """The controller messages of one tensor worker (``actor_id`` names it in errors), in numbered chunks."""

    def __init__(self, actor_id: str):
        self.actor_id = actor_id
        self._messages: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._next = 0
        self._retained: dict = {}  # chunk -> its pickle (``dumps_chunk``), pushed and not yet acknowledged
        self._channel = None
        self._scheduled = False  # a push is on its way to the event loop
        self._resend = False  # the channel attached last has not yet pushed the retained chunks
        #: a host's relay (``worker/relay.py``) carries the answers: tasks return none (they would overtake it)
        self.relayed = False

    def __len__(self) -> int:
        return len(self._messages)

    def put(self, message) -> None:
        """Queue ``message`` (any thread). A ``Status`` or ``SessionFailed`` wakes the channel."""
        self._messages.append(message)
        channel = self._channel
        if channel is not None and type(message) in _PUSHED and not self._scheduled:
            self._scheduled = True
            channel.wake()

    def _take(self) -> tuple[int, object] | None:
        """The next chunk: everything queued, numbered and pickled; None if nothing is queued. Under ``_cond``."""
        messages = []
        pop = self._messages.popleft
        while True:
            try:
                messages.append(pop())
            except IndexError:
                break
        if not messages:
            return None
        chunk = self._next
        self._next += 1
        if self.relayed and all(type(m) is Status for m in messages):
            return chunk, max(m.seq for m in messages)  # all a relay reads of it (``HostRelay.chunk``): no pickle
        return chunk, dumps_chunk(chunk, messages, self.actor_id)

    # -------------------------------------------------------------------------------------------- channel
    def attach(self, channel) -> None:
        """Push on ``channel`` from now on (``channel.wake()`` is called from any thread; it calls ``push``); the
        chunks retained for another channel (one that broke) are pushed again on it first."""
        with self._cond:
            self._channel = channel
            self._scheduled = False
            self._resend = bool(self._retained)
            wake = self._resend or bool(self._messages)
            if wake:  # what came before it was opened goes at once
                self._scheduled = True
        if wake:
            channel.wake()

    def stale(self, channel, closed: bool = False) -> None:
        """A wake came to ``channel`` after it broke: hand it to the channel attached now, if any."""
        with self._cond:
            current = self._channel
            if current is None or current is channel:
                self._scheduled = False
                return
            self._scheduled = True
        current.wake(closed)

    def detach(self, channel) -> None:
        """``channel`` broke or closed: tasks take every answer from now on, those it did not deliver included."""
        with self._cond:
            if self._channel is channel:
                self._channel = None
            self._scheduled = False
            self._cond.notify_all()

    def push(self) -> list[tuple[int, object]]:
        """The chunks to push now, in order (each kept until ``acked``): those retained for a channel that broke,
        once, then everything queued as a new chunk; maybe none. Called by the channel, on its own thread."""
        with self._cond:
            self._scheduled = False
            chunks = []
            if self._resend:
                self._resend = False
                chunks = sorted(self._retained.items())
            taken = self._take()
            if taken is not None:
                if not self.relayed:  # a relay is acknowledged by nobody: losing it fails the session instead
                    self._retained[taken[0]] = taken[1]
                chunks.append(taken)
            self._cond.notify_all()  # a task waiting for the pushes under way: this one is done
            return chunks

    def closed(self) -> None:
        """The session ended on this worker: the channel pushes what is left, then says so (``{"x": True}``)."""
        channel = self._channel
        if channel is not None:
            channel.wake(closed=True)

    def acked(self, chunk: int) -> None:
        """The controller has chunk ``chunk``."""
        with self._cond:
            if self._retained.pop(chunk, None) is not None and not self._retained:
                self._cond.notify_all()

    # ---------------------------------------------------------------------------------------------- tasks
    def for_task(self, settle: float) -> list:
        """The chunks a ``sync_batch`` task returns: after waiting up to ``settle`` seconds for the channel's pushes
        under way to be acknowledged (if a channel is attached), the chunks still unacknowledged and then the rest
        of the outbox as a new chunk (any of them may be empty); nothing when a host's relay carries the answers
        (the relay is their only way: the controller fails the session if it is lost)."""
        with self._cond:
            if self.relayed:
                return []
            if self._channel is not None:
                self._cond.wait_for(lambda: self._channel is None or not (self._scheduled or self._retained), settle)
            blobs = [self._retained.pop(k) for k in sorted(self._retained)]
            taken = self._take()
            if taken is not None:
                blobs.append(taken[1])
            return blobs
