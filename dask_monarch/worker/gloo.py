"""Aborting a gloo process group: what ``ProcessGroupGloo.abort()`` does not do (DESIGN.md "Decisions": a
session's end releases its process groups at once).

In torch 2.13 neither ``abort()`` nor ``shutdown()`` of a ``ProcessGroupGloo`` interrupts a collective that
waits on a stopped or hung peer, and the group's destructor joins its worker threads, so whoever drops the last
reference waits until the op's timeout (``comm_timeout``, 300 s by default; seen as
``ProcessGroupGloo::~ProcessGroupGloo -> std::thread::join``). A gloo group talks over one TCP connection per
pair of ranks (its full mesh): per pair one rank listens on its device's port and the other connects to it.
Shutting those connections down (``shutdown(SHUT_RDWR)``) fails every pending op of the group at once with
"Connection closed by peer", after which the destructor returns in milliseconds (measured: a 16 MiB all-reduce
with a SIGSTOPped peer ended 0.5 ms after the shutdown instead of at its 60 s timeout).

``create_device`` makes a group's device and tells its listening port; the ranks of a group exchange ports
through the group's store (``Comms._new_group``), and ``shutdown_connections`` then finds the group's own
sockets among the process's file descriptors: connected TCP sockets whose local port is this rank's listening
port (the peers that connected to it) or whose remote port is a peer's (the connections this rank made). Each
candidate is checked on a duplicate of its descriptor, so a descriptor closed and reused meanwhile is never
touched; the listening socket is left alone (gloo's listener thread aborts the process on an accept error).
Linux (``/proc/self/fd``) and other systems with ``/dev/fd``; elsewhere the abort finds nothing to shut down.
"""

from __future__ import annotations

import os
import socket
import threading

import torch.distributed as dist

__all__ = ["LISTENING", "closed_sockets", "create_device", "group_sockets", "shutdown_connections", "shutdown_sockets"]

#: held while a listening socket is opened in this process (one gloo device at a time, and the session's answer
#: sockets, ``worker/sockets.py``), so that the one new listening socket ``create_device`` finds is that device's
LISTENING = threading.Lock()


def _fd_dir() -> str | None:
    for path in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(path):
            return path
    return None


def _socket_fds() -> set[tuple[int, str | None]]:
    """This process's socket descriptors, each with what it refers to (``socket:[inode]``, so that a descriptor
    closed and reused by another socket meanwhile counts as new); every descriptor, with None, where that cannot be
    told (without /proc)."""
    path = _fd_dir()
    if path is None:
        return set()
    fds = set()
    for name in os.listdir(path):
        if not name.isdigit():
            continue
        identity = None
        if path == "/proc/self/fd":
            try:
                identity = os.readlink(f"{path}/{name}")
            except OSError:  # closed meanwhile
                continue
            if not identity.startswith("socket:"):
                continue
        fds.add((int(name), identity))
    return fds


def _address(addr) -> tuple[str, int]:
    """``(ip, port)`` of a socket address (IPv4-mapped IPv6 addresses as IPv4)."""
    ip, port = addr[0], addr[1]
    if ip.startswith("::ffff:"):
        ip = ip[7:]
    return ip, port


def _inspect(fd: int):
    """``(listening, local address, remote address or None, socket duplicate)`` of TCP socket ``fd``, or None."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if dup.type != socket.SOCK_STREAM or dup.family not in (socket.AF_INET, socket.AF_INET6):
            dup.close()
            return None
        listening = bool(dup.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        local = _address(dup.getsockname())
        try:
            remote = _address(dup.getpeername())
        except OSError:
            remote = None
        return listening, local, remote, dup
    except OSError:
        dup.close()
        return None


def create_device(hostname: str):
    """A gloo device on ``hostname`` (``ProcessGroupGloo.create_device``) and the ``(ip, port)`` it listens on,
    or None if that could not be told (then ``shutdown_connections`` finds only the connections to peers)."""
    with LISTENING:
        before = _socket_fds()
        device = dist.ProcessGroupGloo.create_device(hostname=hostname)
        found = []
        for fd, _ in _socket_fds() - before:
            info = _inspect(fd)
            if info is None:
                continue
            listening, local, _, dup = info
            dup.close()
            if listening:
                found.append(local)
    return device, (found[0] if len(found) == 1 else None)


def shutdown_connections(own, peers) -> int:
    """Shut down (both ways) every connected TCP socket of this process whose local address is ``own`` (a
    ``(ip, port)``: a peer connected to this rank's listener) or whose remote address is one of ``peers`` (this
    rank connected to theirs): the pairs of one gloo group. Returns how many were shut down."""
    count = 0
    for _, dup in _group_connections(own, peers):
        try:
            dup.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            dup.close()
    return count


def _group_connections(own, peers):
    """``(fd, dup)`` for each connected TCP socket of this process that belongs to the gloo group of ``own`` and
    ``peers`` (see ``shutdown_connections``); ``dup`` is a duplicate of it that the caller closes."""
    peers = {tuple(p) for p in peers if p}
    for fd, _ in _socket_fds():
        info = _inspect(fd)
        if info is None:
            continue
        listening, local, remote, dup = info
        if not listening and remote is not None and (local == own or remote in peers):
            yield fd, dup
        else:
            dup.close()


def _identity(fd: int) -> str | None:
    """What descriptor ``fd`` refers to now (``socket:[inode]`` on Linux), or None."""
    path = _fd_dir()
    if path != "/proc/self/fd":
        return None
    try:
        return os.readlink(f"{path}/{fd}")
    except OSError:
        return None


def group_sockets(own, peers) -> list[tuple[int, str]]:
    """The connected sockets of one gloo group, found as ``shutdown_connections`` finds them, as ``(fd, identity)``
    pairs, taken right after the group is built (gloo connects every pair then). ``shutdown_sockets`` shuts them
    down later even once their peer is gone: a socket whose peer reset it has no remote address left, so
    ``shutdown_connections`` no longer recognizes it, while an op posted on it may wait until the group's
    timeout. Linux only (elsewhere empty)."""
    found = []
    for fd, dup in _group_connections(own, peers):
        dup.close()
        identity = _identity(fd)
        if identity is not None:
            found.append((fd, identity))
    return found


def shutdown_sockets(sockets) -> int:
    """Shut down (both ways) each ``(fd, identity)`` of ``group_sockets`` whose descriptor still refers to the same
    socket (a descriptor closed and reused meanwhile is left alone). Returns how many were shut down."""
    count = 0
    for fd, identity in sockets:
        if _identity(fd) != identity:
            continue
        try:
            dup = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if _identity(fd) == identity:
                dup.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass
        finally:
            dup.close()
    return count


def closed_sockets(sockets) -> int:
    """How many ``(fd, identity)`` of ``group_sockets`` no longer refer to their socket (gloo closed the pair)."""
    return sum(1 for fd, identity in sockets if _identity(fd) != identity)
