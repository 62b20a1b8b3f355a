"""Frames on a blocking socket: the wire format of a session's answer sockets (issue 13 item 1;
``controller/sockets.py``, ``worker/sockets.py``).

A frame is an 8-byte little-endian length and that many bytes of a pickled dict (pickle protocol 5). The keys are
those of the comm channel's messages (``worker/channel.py``): ``{"b": batch, "s": segments, "a": [chunk, ...]}``
controller -> worker, ``{"c": chunk, "d": bytes}`` and ``{"x": True}`` worker -> controller.

Before any frame, the connecting side (the controller) presents ``TOKEN_BYTES`` of the one-time token that the
worker gave it over the Dask comm (which carries the client's ``Security``), then one byte naming the socket's
direction (``DOWN`` or ``UP``); the worker answers ``ACCEPTED`` (one byte) or closes the connection.
"""

from __future__ import annotations

import pickle
import socket
import struct

__all__ = ["ACCEPTED", "DOWN", "UP", "TOKEN_BYTES", "connect", "connect_pair", "recv_exact", "recv_frame", "send_frame", "shutdown"]

HEADER = struct.Struct("<Q")
TOKEN_BYTES = 32
DOWN = b"d"  # controller -> worker: batches and acknowledgements
UP = b"u"  # worker -> controller: answer chunks and the session's end
ACCEPTED = b"\x01"
#: bytes per second below which a send counts as stalled: a frame of n bytes may take ``timeout + n / MIN_RATE`` s
MIN_RATE = 32 * 2**20
_SMALL = 64 * 1024  # frames up to this size go out in one ``sendall`` (header and body copied together)


def send_frame(sock: socket.socket, obj, timeout: float) -> None:
    """Write ``obj`` (picklable) as one frame on ``sock``, within ``timeout`` seconds plus one second per
    ``MIN_RATE`` bytes. Raises ``OSError`` (``TimeoutError`` included) if the socket broke or the peer stopped
    reading; the caller holds the socket's write lock, and a frame cut short leaves the socket unusable."""
    blob = pickle.dumps(obj, protocol=5)
    n = len(blob)
    sock.settimeout(timeout + n / MIN_RATE)
    if n <= _SMALL:
        sock.sendall(HEADER.pack(n) + blob)
    else:
        sock.sendall(HEADER.pack(n))
        sock.sendall(blob)


def recv_exact(sock: socket.socket, n: int, idle=None) -> bytearray:
    """Exactly ``n`` bytes from ``sock``. Raises ``EOFError`` if the peer closed it first. With ``idle``, a read
    that times out (the socket's own timeout) calls ``idle()`` and goes on reading."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            if idle is None:
                raise
            idle()
            continue
        if k == 0:
            raise EOFError("the peer closed the connection")
        got += k
    return buf


def recv_frame(sock: socket.socket, idle=None):
    """The next frame's object (``recv_exact`` raises)."""
    (n,) = HEADER.unpack(recv_exact(sock, HEADER.size, idle))
    return pickle.loads(recv_exact(sock, n, idle))


def shutdown(sock: socket.socket | None) -> None:
    """Shut ``sock`` down both ways, from any thread: a thread blocked reading it gets EOF, one writing gets an
    error. Never raises. A TLS socket is shut down on its file descriptor, not through OpenSSL, so that the thread
    reading it is not disturbed; its owner closes it once that thread has ended (closing a descriptor that another
    thread is reading could hand the number to a new file meanwhile)."""
    if sock is None:
        return
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def connect(offer: dict, direction: bytes, ssl_context, timeout: float) -> socket.socket:
    """One socket to a worker's offer (``{"host", "port", "token", "tls"}``), the token presented and accepted,
    within ``timeout`` seconds; ``direction`` is ``DOWN`` or ``UP``. Used by the controller (``controller/sockets.py``)
    and by a host's relay (``worker/relay.py``). Raises ``OSError``, ``ssl.SSLError``, ``EOFError``, or
    ``ConnectionRefusedError`` if the worker refused the token."""
    raw = socket.create_connection((offer["host"], offer["port"]), timeout=timeout)
    sock = raw
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ssl_context is not None:
            sock = ssl_context.wrap_socket(raw, server_hostname=offer["host"])
        sock.sendall(offer["token"] + direction)
        if bytes(recv_exact(sock, 1)) != ACCEPTED:
            raise ConnectionRefusedError("the worker refused the token")
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


def connect_pair(offer: dict, ssl_context, timeout: float) -> tuple[socket.socket, socket.socket]:
    """The ``(down, up)`` sockets to a worker's offer (``connect`` twice); nothing left open if either fails."""
    down = connect(offer, DOWN, ssl_context, timeout)
    try:
        return down, connect(offer, UP, ssl_context, timeout)
    except BaseException:
        down.close()
        raise
