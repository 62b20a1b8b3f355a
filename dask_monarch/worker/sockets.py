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

Nothing waits unbounded: the controller has ``ACCEPT_TIMEOUT`` seconds to connect, and a write ``SEND_TIMEOUT``
seconds plus one per ``frames.MIN_RATE`` bytes (a stopped controller). Connections are accepted meanwhile without
waiting on any of them (issue 26 item 6: a port scanner's idle connection once made the controller give up on the
sockets): each has ``TOKEN_TIMEOUT`` seconds to finish its TLS handshake and present the token, read as it arrives
with a selector, and at most ``MAX_PENDING`` may be presenting at once (more are closed at once); one that presents
anything else is closed. A frame that declares more than the worker can hold (``frames.receivable``: its Dask
``memory_limit``, else the machine's memory) ends the sockets before anything is allocated for it. When a socket
breaks, both close, and ``on_lost`` puts the comm channel back in charge of the outbox (which re-sends the chunks
not yet acknowledged); the batches come with their tasks. At the session's end
the up socket says so (``{"x": True}``) and both close; the reader thread ends on its own.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import selectors
import socket
import ssl
import threading
import time

from ..protocol.frames import ACCEPTED, DOWN, TOKEN_BYTES, UP, recv_frame, send_frame, shutdown
from ..protocol.session_id import session_tag
from .gloo import LISTENING
from .proc_state import identity

__all__ = ["SocketEnd", "ACCEPT_TIMEOUT", "MAX_PENDING", "SEND_TIMEOUT", "TOKEN_TIMEOUT"]

logger = logging.getLogger("dask_monarch.worker")

#: seconds the controller has to connect both sockets once they are offered
ACCEPT_TIMEOUT = 10.0
#: seconds a connection has to finish its TLS handshake and present the token
TOKEN_TIMEOUT = 2.0
#: connections that may be presenting their token at once; one more is closed at once
MAX_PENDING = 16
#: seconds a frame's write may take (plus one per ``frames.MIN_RATE`` bytes) before the socket counts as broken
SEND_TIMEOUT = 10.0


class SocketEnd:
    """One session's answer sockets on this worker: ``offer`` is what the controller needs to connect; the outbox
    is attached to it once both sockets are up (``wake`` is the outbox's channel interface); ``close()`` (any
    thread) ends it. ``on_lost(error)`` is called (on its thread) if it breaks before ``close()``. ``limit``: the
    most bytes a frame from the controller may declare (``frames.receivable``)."""

    def __init__(self, session_id: str, rank: int, inbox, outbox, host: str, ssl_context, on_lost, limit: int):
        self.limit = limit
        self.inbox = inbox
        self.outbox = outbox
        self._ssl = ssl_context
        self._on_lost = on_lost
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with LISTENING:  # a gloo device being made meanwhile must not take it for its own (``worker/gloo.py``)
            self._listener = socket.create_server((host, 0), family=family)
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self.offer = {"host": host, "port": self._listener.getsockname()[1], "token": self._token,
                      "tls": ssl_context is not None, "proc": identity()}  # "proc": for a relay (``proc_state.py``)
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
            inbox, outbox, down, limit = self.inbox, self.outbox, self._down, self.limit
            while True:
                msg = recv_frame(down, limit)
                if "b" in msg:
                    if "q" in msg:  # to a relay: a sync flush, whose quiet ranks it may answer for
                        inbox.put(msg["b"], msg["s"], msg["q"])
                    else:
                        inbox.put(msg["b"], msg["s"])
                elif "d" in msg:  # lone RequestStatus batches that a relay answered for this rank (``worker/relay.py``)
                    inbox.noted(msg["d"])
                elif "r" in msg:  # a host's relay connected (``worker/relay.py``): answers go through it alone
                    outbox.relayed = True
                for chunk in msg.get("a", ()):
                    outbox.acked(chunk)
                msg = None  # a batch's arguments are the inbox's now: not kept here until the next batch
        except Exception as e:  # closed, broken, or never connected
            error = e.with_traceback(None)  # no frame -> traceback -> frame cycle (the GC may be off)
        finally:
            self._end(error)

    def _accept(self) -> None:
        """Accept the down and up sockets, each presenting the token (after the TLS handshake, with TLS), within
        ``ACCEPT_TIMEOUT``, all connections served at once by one selector; one that presents anything else, or
        nothing within ``TOKEN_TIMEOUT``, is closed. Raises ``TimeoutError`` at the deadline."""
        deadline = time.monotonic() + ACCEPT_TIMEOUT
        listener = self._listener
        listener.setblocking(False)
        pending: dict[socket.socket, _Pending] = {}
        with selectors.DefaultSelector() as selector:
            selector.register(listener, selectors.EVENT_READ)
            try:
                while self._down is None or self._up is None:
                    now = time.monotonic()
                    if self._closing:
                        raise ConnectionAbortedError("closed before the controller connected")
                    if now >= deadline:
                        raise TimeoutError(
                            f"the controller did not connect its answer sockets within {ACCEPT_TIMEOUT} s")
                    for p in [p for p in pending.values() if p.deadline <= now]:
                        self._refuse(selector, pending, p, f"no token within {TOKEN_TIMEOUT} s")
                    wake = min([deadline, *(p.deadline for p in pending.values())])
                    for key, _ in selector.select(max(0.0, wake - now)):
                        if key.fileobj is listener:
                            self._take(selector, pending, deadline)
                        else:
                            self._read_token(selector, pending, key.data)
            finally:
                for p in list(pending.values()):
                    p.sock.close()
        shutdown(listener)
        listener.close()

    def _take(self, selector, pending: dict, deadline: float) -> None:
        """Accept one connection (the listener is readable) and start reading its token."""
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        except OSError:
            if self._closing:  # ``close()`` shut the listener down
                raise ConnectionAbortedError("closed before the controller connected") from None
            raise
        if len(pending) >= MAX_PENDING:
            logger.debug("dask_monarch: refused a connection to an answer socket: %d already presenting", MAX_PENDING)
            conn.close()
            return
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        except OSError as e:
            logger.debug("dask_monarch: refused a connection to an answer socket: %s", e)
            conn.close()
            return
        p = pending[conn] = _Pending(conn, min(deadline, time.monotonic() + TOKEN_TIMEOUT), self._ssl is not None)
        selector.register(conn, selectors.EVENT_READ, p)
        self._read_token(selector, pending, p)

    def _read_token(self, selector, pending: dict, p: "_Pending") -> None:
        """Go on with ``p``'s TLS handshake and token as far as what arrived allows; take the socket, or close it,
        once it presented ``TOKEN_BYTES + 1`` bytes."""
        sock = p.sock
        try:
            if p.handshake:
                sock.do_handshake()
                p.handshake = False
            while len(p.got) < TOKEN_BYTES + 1:
                data = sock.recv(TOKEN_BYTES + 1 - len(p.got))
                if not data:
                    raise EOFError("closed before presenting a token")
                p.got += data
        except ssl.SSLWantWriteError:
            selector.modify(sock, selectors.EVENT_WRITE, p)
            return
        except (ssl.SSLWantReadError, BlockingIOError):
            selector.modify(sock, selectors.EVENT_READ, p)
            return
        except Exception as e:
            self._refuse(selector, pending, p, f"{type(e).__name__}: {e}")
            return
        token, direction = bytes(p.got[:TOKEN_BYTES]), bytes(p.got[TOKEN_BYTES:])
        slot = {DOWN: "_down", UP: "_up"}.get(direction)
        if not hmac.compare_digest(token, self._token) or slot is None or getattr(self, slot) is not None:
            self._refuse(selector, pending, p, "a connection without this session's token")
            return
        selector.unregister(sock)
        del pending[sock]
        try:
            sock.settimeout(TOKEN_TIMEOUT)
            sock.sendall(ACCEPTED)
            sock.settimeout(None)
        except OSError as e:
            logger.debug("dask_monarch: an answer socket broke as it was accepted: %s", e)
            sock.close()
            return
        setattr(self, slot, sock)

    @staticmethod
    def _refuse(selector, pending: dict, p: "_Pending", why: str) -> None:
        logger.debug("dask_monarch: refused a connection to an answer socket: %s", why)
        selector.unregister(p.sock)
        del pending[p.sock]
        p.sock.close()

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


class _Pending:
    """A connection to the answer port that has not yet presented its token: the bytes it sent so far, and the
    moment it is closed unless it has presented it."""

    __slots__ = ("sock", "deadline", "handshake", "got")

    def __init__(self, sock: socket.socket, deadline: float, handshake: bool):
        self.sock = sock
        self.deadline = deadline
        self.handshake = handshake  # a TLS handshake to finish first
        self.got = bytearray()
