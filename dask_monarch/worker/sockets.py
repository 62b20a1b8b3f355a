"""The worker's end of a session's answer sockets (issue 13 item 1; DESIGN.md "Decisions": what the controller waits
for may come back on a faster path; ``protocol/frames.py`` is the wire format, ``controller/sockets.py`` the other
end).

When the controller asks for it in the answer channel's handshake (``worker/channel.py``), ``SocketEnd`` listens on
this worker's own host, on a port the OS picks, and offers ``{"host", "port", "token", "tls"}`` over the Dask comm
(which carries the client's ``Security``). The controller then connects twice, presenting the one-time random
token first (only the controller that opened the channel knows it): a *down* socket (batches and acknowledgements,
read here by the ``monarch-<session>-socket-r<rank>`` thread, which hands them to the inbox and the outbox as the
comm handler does) and an *up* socket, on which the outbox's chunks are written by the thread that produces them
(the stream thread that reports a ``Status``), under a lock, with no event loop in between. Each socket is used by
one thread at a time at each end, so that TLS (an ``ssl.SSLSocket``, not safe for a concurrent read and write)
works: both are wrapped in the worker's ``ssl_context`` (``Security.get_listen_args("worker")``) when the cluster
uses TLS.

Nothing waits unbounded: the controller has ``ACCEPT_TIMEOUT`` seconds to connect, a token or TLS handshake
``ACCEPT_TIMEOUT`` at most, and a write ``SEND_TIMEOUT`` seconds plus one per ``frames.MIN_RATE`` bytes (a
stopped controller). When a socket breaks, both close, and ``on_lost`` puts the comm channel back in charge of the
outbox (which re-sends the chunks not yet acknowledged); the batches come with their tasks. At the session's end
the up socket says so (``{"x": True}``) and both close; the reader thread ends on its own.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import threading
import time

from ..protocol.frames import ACCEPTED, DOWN, TOKEN_BYTES, UP, recv_exact, recv_frame, send_frame, shutdown
from ..protocol.session_id import session_tag
from .gloo import LISTENING

__all__ = ["SocketEnd", "ACCEPT_TIMEOUT", "SEND_TIMEOUT"]

logger = logging.getLogger("dask_monarch.worker")

#: seconds the controller has to connect both sockets once they are offered
ACCEPT_TIMEOUT = 10.0
#: seconds a frame's write may take (plus one per ``frames.MIN_RATE`` bytes) before the socket counts as broken
SEND_TIMEOUT = 10.0


class SocketEnd:
    """One session's answer sockets on this worker: ``offer`` is what the controller needs to connect; the outbox
    is attached to it once both sockets are up (``wake`` is the outbox's channel interface); ``close()`` (any
    thread) ends it. ``on_lost(error)`` is called (on its thread) if it breaks before ``close()``."""

    def __init__(self, session_id: str, rank: int, inbox, outbox, host: str, ssl_context, on_lost):
        self.inbox = inbox
        self.outbox = outbox
        self._ssl = ssl_context
        self._on_lost = on_lost
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with LISTENING:  # a gloo device being made meanwhile must not take it for its own (``worker/gloo.py``)
            self._listener = socket.create_server((host, 0), family=family)
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self.offer = {"host": host, "port": self._listener.getsockname()[1], "token": self._token,
                      "tls": ssl_context is not None}
        self._down: socket.socket | None = None
        self._up: socket.socket | None = None
        self._lock = threading.Lock()  # writes on the up socket
        self._broken = False  # no write on the up socket any more
        self._closing = False
        self._may_attach = threading.Event()  # the comm channel is attached: this one may take over (``attach``)
        self.thread = threading.Thread(target=self._run, name=f"monarch-{session_tag(session_id)}-socket-r{rank}",
                                       daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        error = None
        try:
            self._accept()
            if not self._may_attach.wait(ACCEPT_TIMEOUT) or self._closing:
                raise ConnectionAbortedError("the comm channel did not start")
            self.outbox.attach(self)
            inbox, outbox, down = self.inbox, self.outbox, self._down
            while True:
                msg = recv_frame(down)
                if "b" in msg:
                    inbox.put(msg["b"], msg["s"])
                elif "r" in msg:  # a host's relay connected (``worker/relay.py``): answers go through it alone
                    outbox.relayed = True
                for chunk in msg.get("a", ()):
                    outbox.acked(chunk)
        except Exception as e:  # closed, broken, or never connected
            error = e.with_traceback(None)  # no frame -> traceback -> frame cycle (the GC may be off)
        finally:
            self._end(error)

    def _accept(self) -> None:
        """Accept the down and up sockets, each presenting the token (after the TLS handshake, with TLS), within
        ``ACCEPT_TIMEOUT``; other connections are closed and ignored. Raises ``TimeoutError`` at the deadline."""
        deadline = time.monotonic() + ACCEPT_TIMEOUT
        while self._down is None or self._up is None:
            left = deadline - time.monotonic()
            if self._closing:
                raise ConnectionAbortedError("closed before the controller connected")
            if left <= 0:
                raise TimeoutError(f"the controller did not connect its answer sockets within {ACCEPT_TIMEOUT} s")
            self._listener.settimeout(left)
            conn, _ = self._listener.accept()
            try:
                conn.settimeout(left)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._ssl is not None:
                    conn = self._ssl.wrap_socket(conn, server_side=True)
                presented = bytes(recv_exact(conn, TOKEN_BYTES + 1))
                token, direction = presented[:TOKEN_BYTES], presented[TOKEN_BYTES:]
                slot = {DOWN: "_down", UP: "_up"}.get(direction)
                if not hmac.compare_digest(token, self._token) or slot is None or getattr(self, slot) is not None:
                    raise ConnectionRefusedError("a connection without this session's token")
                conn.sendall(ACCEPTED)
                conn.settimeout(None)
                setattr(self, slot, conn)
            except Exception as e:
                logger.debug("dask_monarch: refused a connection to an answer socket: %s", e)
                conn.close()
        shutdown(self._listener)
        self._listener.close()

    def _end(self, error: BaseException | None) -> None:
        """On the thread, last: detach from the outbox, wait for a write under way, close everything, and tell
        ``on_lost`` unless ``close()`` ended it."""
        self.outbox.detach(self)
        with self._lock:
            self._broken = True
        for sock in (self._listener, self._down, self._up):
            if sock is not None:
                shutdown(sock)
                sock.close()
        if not self._closing:
            logger.debug("dask_monarch: answer sockets closed (%s: %s); the comm channel takes over",
                         type(error).__name__, error)
            self._on_lost(error)
        self._on_lost = None

    # ------------------------------------------------------------------------------------ the outbox's channel
    def wake(self, closed: bool = False) -> None:
        """Write the outbox's next chunks on the up socket, from this thread (``Outbox.put``); with ``closed``, then
        say that the session ended here and close. A broken socket hands the wake to the comm channel."""
        error = None
        with self._lock:
            if self._broken:
                stale = True
            else:
                stale = False
                try:
                    for chunk, blob in self.outbox.push():
                        send_frame(self._up, {"c": chunk, "d": blob}, SEND_TIMEOUT)
                    if closed:
                        send_frame(self._up, {"x": True}, SEND_TIMEOUT)
                except OSError as e:
                    error = e.with_traceback(None)  # no frame -> traceback -> frame cycle (the GC may be off)
                    self._broken = True
        if stale or error is not None:
            if error is not None:
                shutdown(self._down)  # the thread ends and hands over to the comm channel
            self.outbox.stale(self, closed)
        elif closed:
            self.close()

    def attach(self) -> None:
        """Let the outbox push here once both sockets are up (after the comm channel was attached: this one takes
        over from it)."""
        self._may_attach.set()

    def close(self) -> None:
        """End it (any thread): the sockets shut down, the thread closes them and ends."""
        self._closing = True
        self._may_attach.set()
        for sock in (self._listener, self._down, self._up):
            shutdown(sock)
