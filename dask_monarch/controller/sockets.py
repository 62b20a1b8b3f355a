"""``SocketLink``: the controller's end of one rank's answer sockets, the fast path of a session's answer channel
(issue 13 item 1; DESIGN.md "Decisions": what the controller waits for may come back on a faster path;
``protocol/frames.py`` is the wire format, ``worker/sockets.py`` the other end).

The worker offers them over the Dask comm of the answer channel (``channel.py``), which carries the client's
``Security``: a host, a port its OS picked, a one-time random token, and whether it wants TLS. The link connects
twice (a *down* socket for batches and acknowledgements, an *up* one for answers), with the client's
``ssl_context`` (``Security.get_connection_args("client")``) when the cluster uses TLS, and presents the token
first. Then:

* the thread that flushes (the program's, or the flusher) writes each batch with ``sendall`` itself (``send``),
  with the acknowledgements of the answer chunks received since, bounded by ``SEND_TIMEOUT`` seconds plus one per
  ``frames.MIN_RATE`` bytes, so that a stopped worker (SIGSTOP) never blocks the controller for long;
* the ``monarch-<session>-socket-r<rank>`` thread reads the answer chunks (a fetched tensor's bytes straight into
  the buffer that becomes the tensor: ``protocol/frames.py``; a frame that declares more than this machine's memory
  ends the link before anything is allocated) and applies them at once
  (``Session._on_chunk``, in the rank's chunk order with those that come in task results), and acknowledges those
  that no batch carried within ``ACK_DELAY`` seconds.

A socket that breaks or times out ends the link: the rank's batches go on the comm channel and its answers come
back there (``Channels._socket_lost``), nothing lost (the Dask tasks carry every batch; the worker pushes again
what was not acknowledged).
"""

from __future__ import annotations

import logging
import threading

from ..protocol.frames import connect_pair, receivable, recv_frame, send_frame, shutdown

__all__ = ["SocketLink"]

logger = logging.getLogger("dask_monarch.controller")


class SocketLink:
    """Rank ``rank``'s answer sockets for ``channels`` (``Channels``), connected from ``offer`` within ``timeout``
    seconds (``OSError``, ``ssl.SSLError`` or ``EOFError`` if they cannot be). ``send(batch, segments)`` (under the
    session lock) writes a batch: False if the link is lost (``lost`` says why); ``close()`` ends it."""

    #: seconds a batch's write may take (plus one per ``frames.MIN_RATE`` bytes) before the link counts as lost
    SEND_TIMEOUT = 5.0
    #: seconds an answer chunk's acknowledgement may wait to travel with the rank's next batch before it goes alone
    ACK_DELAY = 0.002

    def __init__(self, channels, rank: int, offer: dict, ssl_context, timeout: float):
        self.channels = channels
        self.rank = rank
        self.down, self.up = connect_pair(offer, ssl_context, timeout)
        self.lost: BaseException | None = None
        self.limit = receivable()  # the most bytes one answer frame may declare
        self._lock = threading.Lock()  # writes on the down socket, and the pending acknowledgements
        self._acks: list = []
        self._lost_lock = threading.Lock()
        key = channels.session.tag
        self.thread = threading.Thread(target=self._read, name=f"monarch-{key}-socket-r{rank}", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------------------------------------ sending
    def send(self, batch: int, segments: list, extra: dict | None = None) -> bool:
        """Write batch ``batch`` (its segments) with the pending acknowledgements (and the keys of ``extra``), from
        this thread. False if the link is lost, or is lost now (the socket broke, or the worker did not take the
        batch in time)."""
        with self._lock:
            if self.lost is not None:
                return False
            msg = {"b": batch, "s": segments}
            if extra:
                msg.update(extra)
            if self._acks:
                msg["a"], self._acks = self._acks, []
            try:
                send_frame(self.down, msg, self.SEND_TIMEOUT)
                return True
            except OSError as e:
                error = e.with_traceback(None)  # no frame -> traceback -> frame cycle (the GC may be off)
        self._lose(error)
        return False

    # ------------------------------------------------------------------------------------------------ answers
    def _apply(self, blob: bytes) -> None:
        """Apply one answer chunk's data (on the reader)."""
        self.channels.socket_chunks[self.rank] += 1
        self.channels.session._on_chunk(self.rank, blob)

    def _read(self) -> None:
        rank, up, channels = self.rank, self.up, self.channels
        try:
            while True:
                msg = recv_frame(up, self.limit, self._idle)
                if "x" in msg:
                    channels.ended.add(rank)
                    continue
                try:
                    self._apply(msg["d"])
                except Exception:  # a bug here must not end the link: later answers still count
                    logger.exception("dask_monarch: could not apply an answer of rank %d", rank)
                with self._lock:
                    self._acks.append(msg["c"])
                msg = None  # a fetched tensor is the program's now: not kept here until the next answer
                up.settimeout(self.ACK_DELAY)
        except Exception as e:
            self._lose(e)
        finally:  # this thread owns the sockets from here: nobody writes on a lost link
            with self._lock:
                self.down.close()
            up.close()

    def _idle(self) -> None:
        """No answer for ``ACK_DELAY`` seconds: acknowledge what no batch carried meanwhile (on the reader)."""
        self.up.settimeout(None)
        error = None
        with self._lock:
            if not self._acks or self.lost is not None:
                return
            acks, self._acks = self._acks, []
            try:
                send_frame(self.down, {"a": acks}, self.SEND_TIMEOUT)
            except OSError as e:
                error = e.with_traceback(None)  # no frame -> traceback -> frame cycle (the GC may be off)
        if error is not None:
            self._lose(error)

    # ------------------------------------------------------------------------------------------------ the end
    def _lose(self, error: BaseException) -> None:
        with self._lost_lock:
            if self.lost is not None:
                return
            self.lost = error.with_traceback(None)  # kept: its frames would keep the session (a cycle)
        shutdown(self.down)
        shutdown(self.up)
        self._gone(error)

    def _gone(self, error: BaseException) -> None:
        """The link broke (``_lose``): the comm channel takes over (``Channels._socket_lost``)."""
        self.channels._socket_lost(self.rank, self, error)

    def close(self, timeout: float = 5.0) -> None:
        """End the link (the session ends): shut both sockets down and join the reader (at most ``timeout``
        seconds), which closes them."""
        with self._lost_lock:
            if self.lost is None:
                self.lost = ConnectionAbortedError("the session ended")
        shutdown(self.down)
        shutdown(self.up)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)  # the thread closes them as it ends
