"""Frames on a blocking socket: the wire format of a session's answer sockets (issue 13 item 1; issue 26 items 4
and 6; ``controller/sockets.py``, ``worker/sockets.py``).

A frame is a 12-byte little-endian header (``<QI``: the length of a pickled dict, pickle protocol 5, and the number
of its out-of-band buffers), one 8-byte length per buffer, the pickle, then the buffers' bytes. The keys are those
of the comm channel's messages (``worker/channel.py``): ``{"b": batch, "s": segments, "a": [chunk, ...]}``
controller -> worker, ``{"c": chunk, "d": answer chunk}`` and ``{"x": True}`` worker -> controller. An answer chunk
that holds a large tensor (``protocol/tensor_bytes.py``) gives its memory as a ``pickle.PickleBuffer``: it is
written from the tensor itself, ``CHUNK`` bytes per ``sendall``, and read into one buffer of its size that becomes
the received tensor's memory (no copy at either end; ``bench/fetch_memory.py``).

A frame's declared size is checked against ``limit``, what the receiving session can hold (``receivable``), before
anything is allocated, and memory is taken as the bytes arrive (at most ``CHUNK`` ahead of them): a header that
claims more, or a peer that stops mid-frame, costs nothing.

Before any frame, the connecting side (the controller) presents ``TOKEN_BYTES`` of the one-time token that the
worker gave it over the Dask comm (which carries the client's ``Security``), then one byte naming the socket's
direction (``DOWN`` or ``UP``); the worker answers ``ACCEPTED`` (one byte) or closes the connection.
"""

from __future__ import annotations

import pickle
import socket
import ssl
import struct
import time

__all__ = ["ACCEPTED", "CHUNK", "DOWN", "UP", "TOKEN_BYTES", "FrameReader", "FrameTooLarge", "connect", "connect_pair",
           "receivable", "recv_exact", "recv_frame", "send_frame", "shutdown"]

HEADER = struct.Struct("<QI")
LENGTH = struct.Struct("<Q")
TOKEN_BYTES = 32
DOWN = b"d"  # controller -> worker: batches and acknowledgements
UP = b"u"  # worker -> controller: answer chunks and the session's end
ACCEPTED = b"\x01"
#: bytes per second below which a send counts as stalled: a frame of n bytes may take ``timeout + n / MIN_RATE`` s
MIN_RATE = 32 * 2**20
#: bytes written by one ``sendall``, and the most a read allocates ahead of the bytes that arrived
CHUNK = 64 * 2**20
_SMALL = 64 * 1024  # frames up to this size go out in one ``sendall`` (header and body copied together)
_SCRATCH = 16 * 1024  # what ``FrameReader`` reads at once between frames, for the small ones in it


class FrameTooLarge(ValueError):
    """A frame's header declares more bytes than the receiving session can hold."""


def receivable(memory_limit: int | None = None) -> int:
    """The most bytes one frame may declare in a process: its memory limit (a Dask worker's ``memory_limit``) if
    set, else the machine's physical memory (``psutil.virtual_memory().total``)."""
    import psutil

    total = psutil.virtual_memory().total
    return min(total, memory_limit) if memory_limit else total


def send_frame(sock: socket.socket, obj, timeout: float) -> None:
    """Write ``obj`` (picklable) as one frame on ``sock``, within ``timeout`` seconds plus one second per
    ``MIN_RATE`` bytes. Raises ``OSError`` (``TimeoutError`` included) if the socket broke or the peer stopped
    reading; the caller holds the socket's write lock, and a frame cut short leaves the socket unusable."""
    buffers: list = []
    blob = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    if not buffers and len(blob) <= _SMALL:
        data = HEADER.pack(len(blob), 0) + blob
        if type(sock) is socket.socket and sock.gettimeout() is None:
            # a blocking plain socket with room for the frame (the usual case) takes it in one ``send`` syscall:
            # with a timeout set, CPython adds a ``poll`` before it and ``settimeout`` an ``ioctl``, and each of the
            # three releases and retakes the GIL of a busy process (a relay's, a rank's; bench/fetch_costs.py)
            try:
                sent = sock.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            if sent == len(data):
                return
            data = data[sent:]
        sock.settimeout(timeout + len(blob) / MIN_RATE)
        sock.sendall(data)
        sock.settimeout(None)  # blocking again: the next frame may take the one-syscall way
        return
    views = [b.raw() for b in buffers]
    total = len(blob) + sum(v.nbytes for v in views)
    allowed = timeout + total / MIN_RATE
    deadline = time.monotonic() + allowed
    head = HEADER.pack(len(blob), len(views)) + b"".join(LENGTH.pack(v.nbytes) for v in views)
    for part in (head, blob, *views):
        view = memoryview(part)
        for start in range(0, len(view), CHUNK):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"a frame of {total} bytes was not written within {allowed:.1f} s")
            sock.settimeout(left)
            sock.sendall(view[start:start + CHUNK])


def recv_exact(sock: socket.socket, n: int, idle=None) -> bytearray:
    """Exactly ``n`` bytes from ``sock``, in a buffer that grows as they arrive (at most ``CHUNK`` ahead). Raises
    ``EOFError`` if the peer closed it first. With ``idle``, a read that times out (the socket's own timeout) calls
    ``idle()`` and goes on reading."""
    buf = bytearray(min(n, CHUNK))
    got = 0
    while got < n:
        if got == len(buf):  # realloc: a large buffer grows in place (mremap), nothing copied
            buf.extend(bytes(min(n - got, CHUNK)))
        try:
            k = sock.recv_into(memoryview(buf)[got:])
        except TimeoutError:
            if idle is None:
                raise
            idle()
            continue
        if k == 0:
            raise EOFError("the peer closed the connection")
        got += k
    return buf


def recv_frame(sock: socket.socket, limit: int, idle=None):
    """The next frame's object (``recv_exact`` raises). Raises ``FrameTooLarge`` before reading further if the
    header declares more than ``limit`` bytes in all."""
    n, count = HEADER.unpack(recv_exact(sock, HEADER.size, idle))
    if n + count * LENGTH.size > limit:
        raise FrameTooLarge(f"a frame declares {n + count * LENGTH.size} bytes, more than this session can receive "
                            f"({limit} bytes)")
    sizes = [size for (size,) in LENGTH.iter_unpack(recv_exact(sock, count * LENGTH.size, idle))] if count else []
    if n + sum(sizes) > limit:
        raise FrameTooLarge(f"a frame declares {n + sum(sizes)} bytes, more than this session can receive "
                            f"({limit} bytes)")
    body = recv_exact(sock, n, idle)
    buffers = [recv_exact(sock, size, idle) for size in sizes]
    return pickle.loads(body, buffers=buffers)


def _check(declared: int, limit: int) -> None:
    if declared > limit:
        raise FrameTooLarge(f"a frame declares {declared} bytes, more than this session can receive ({limit} bytes)")


class FrameReader:
    """``recv_frame`` for a non-blocking socket served by a selector (``worker/relay.py`` reads all of a host's ranks
    on one thread): ``read(out)`` takes what ``sock`` has now and appends to ``out`` the frames it completed, keeping
    a partial frame for the next call. The same checks as ``recv_frame``: a frame that declares more than ``limit``
    bytes raises ``FrameTooLarge`` before anything is allocated for it, and memory is taken as the bytes arrive (at
    most ``CHUNK`` ahead of them); out-of-band buffers are read into their own memory. Raises ``EOFError`` if the peer
    closed the socket (after the frames completed before it are in ``out``), ``OSError`` if it broke."""

    def __init__(self, sock: socket.socket, limit: int):
        self.sock = sock
        self.limit = limit
        self._scratch = bytearray(_SCRATCH)
        self._plain = type(sock) is socket.socket
        self._start()

    def _start(self) -> None:
        self._stage = "header"
        self._sizes: list = []
        self._body = None
        self._buffers: list = []
        self._want(HEADER.size)

    def _want(self, n: int) -> None:
        self._n = n
        self._got = 0
        self._buf = bytearray(min(n, CHUNK))

    def read(self, out: list) -> None:
        sock = self.sock
        while True:
            while self._got == self._n:  # a part is complete (or empty: an empty tensor's buffer)
                self._next(out)
            if self._stage == "header" and self._got == 0:  # between frames: what arrived, in one ``recv``
                try:
                    k = sock.recv_into(self._scratch)
                except (BlockingIOError, ssl.SSLWantReadError):
                    return
                if k == 0:
                    raise EOFError("the peer closed the connection")
                self._feed(memoryview(self._scratch)[:k], out)
                if k < _SCRATCH and self._plain:
                    return  # all that had arrived: the selector says when more does (not so under TLS, which
                    # may hold decrypted bytes that the socket no longer shows)
                continue
            if self._got == len(self._buf):  # realloc: a large buffer grows in place (mremap), nothing copied
                self._buf.extend(bytes(min(self._n - self._got, CHUNK)))
            try:
                k = sock.recv_into(memoryview(self._buf)[self._got:])
            except (BlockingIOError, ssl.SSLWantReadError):  # all that arrived is read (a TLS record's rest too)
                return
            if k == 0:
                raise EOFError("the peer closed the connection")
            self._got += k

    def _feed(self, data: memoryview, out: list) -> None:
        """Take ``data`` (read between frames): each whole small frame in it (no out-of-band buffers) is unpickled
        from it at once, the same checks made; from the first that is not whole, the bytes go through the parts."""
        pos, end, size = 0, len(data), HEADER.size
        while pos < end:
            if self._stage == "header" and self._got == 0 and end - pos >= size:
                n, count = HEADER.unpack_from(data, pos)
                if count == 0 and end - pos - size >= n:
                    _check(n, self.limit)
                    out.append(pickle.loads(data[pos + size:pos + size + n]))
                    pos += size + n
                    continue
            if self._got == len(self._buf):  # realloc: a large buffer grows in place (mremap), nothing copied
                self._buf.extend(bytes(min(self._n - self._got, CHUNK)))
            take = min(end - pos, len(self._buf) - self._got)
            self._buf[self._got:self._got + take] = data[pos:pos + take]
            self._got += take
            pos += take
            while self._got == self._n:
                self._next(out)

    def _next(self, out: list) -> None:
        """The part being read is complete: go on to the next one, or append the frame it completed."""
        buf, stage = self._buf, self._stage
        if stage == "header":
            n, count = HEADER.unpack(buf)
            _check(n + count * LENGTH.size, self.limit)
            self._body_size = n
            if count:
                self._stage = "lengths"
                self._want(count * LENGTH.size)
                return
        elif stage == "lengths":
            self._sizes = [size for (size,) in LENGTH.iter_unpack(buf)]
            _check(self._body_size + sum(self._sizes), self.limit)
        elif stage == "body":
            self._body = buf
        else:
            self._buffers.append(buf)
        if stage in ("header", "lengths"):
            self._stage = "body"
            self._want(self._body_size)
        elif len(self._buffers) < len(self._sizes):
            self._stage = "buffer"
            self._want(self._sizes[len(self._buffers)])
        else:
            body, buffers = self._body, self._buffers
            self._start()
            out.append(pickle.loads(body, buffers=buffers))


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
