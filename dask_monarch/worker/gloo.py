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
through the group's store (``Comms._new_group``), and ``group_sockets`` then records the group's own sockets among
the process's file descriptors: connected TCP sockets whose local port is this rank's listening port (the peers
that connected to it) or whose remote port is a peer's (the connections this rank made), opened while the group
was built (a port is reused once its listener closed, so an older socket of another group may match by address),
each with its identity (``socket:[inode]``). ``shutdown_sockets`` shuts down those whose descriptor still refers
to the same socket, so a descriptor closed and reused meanwhile is never touched; the listening socket is left
alone (gloo's listener thread aborts the process on an accept error). Where descriptors cannot be identified
(no ``/proc``), ``shutdown_connections`` finds them by address when the group is aborted.
Linux (``/proc/self/fd``) and other systems with ``/dev/fd``; elsewhere the abort finds nothing to shut down.

Shutting the connections down is not enough for a point-to-point transfer already under way (``to_mesh``): gloo
fails the send and receive operations a pair still holds in its queues when the pair closes, but not the one it is
writing or reading at that moment (``tcp::Pair::signalException`` skips the unbound buffer of its ``tx_`` and
``rx_`` operations), so a ``SendWork``/``RecvWork`` whose peer died mid-transfer, or whose pair was shut down
then, waits in ``UnboundBuffer::waitSend``/``waitRecv`` until the group's timeout (measured with torch 2.13: a
256 MiB ``recv`` whose sender was SIGKILLed mid-transfer, and a send whose pair was shut down under it, each waited
its whole 60 s timeout). Torch's ``Work.abort()`` (``ProcessGroupGloo::SendWork::abort``: ``abortWaitSend``) ends
that wait, but torch does not bind it in Python; ``abort_work`` calls it: the ``Work``'s C++ pointer comes from
pybind11's cross-module interface (``_pybind11_conduit_v1_``, pybind11 >= 2.11.2), its dynamic type is checked
against the vtables of gloo's ``SendWork`` and ``RecvWork`` (exported by ``libtorch_cpu``), and only then is that
class's ``abort`` called (``ctypes``). Anything else (another backend, another build, a missing symbol) is left
alone and reported as not aborted.
"""

from __future__ import annotations

import ctypes
import functools
import os
import socket
import threading

import torch.distributed as dist

__all__ = ["LISTENING", "abort_work", "closed_sockets", "create_device", "group_sockets", "identities",
           "shutdown_connections", "shutdown_sockets", "socket_fds"]

#: held while a listening socket is opened in this process (one gloo device at a time, and the session's answer
#: sockets, ``worker/sockets.py``), so that the one new listening socket ``create_device`` finds is that device's
LISTENING = threading.Lock()


def _fd_dir() -> str | None:
    for path in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(path):
            return path
    return None


def socket_fds() -> set[tuple[int, str | None]]:
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
    or None if that could not be told (then ``group_sockets`` finds only the connections to peers)."""
    with LISTENING:
        before = socket_fds()
        device = dist.ProcessGroupGloo.create_device(hostname=hostname)
        found = []
        for fd, _ in socket_fds() - before:
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
    for fd, _ in socket_fds():
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


def identities() -> bool:
    """Whether this system tells what a descriptor refers to (``/proc/self/fd``): then a group's sockets are the ones
    ``group_sockets`` recorded, else they are found by address when it is aborted (``shutdown_connections``)."""
    return _fd_dir() == "/proc/self/fd"


def group_sockets(own, peers, since=None) -> list[tuple[int, str]]:
    """The connected sockets of one gloo group, found as ``shutdown_connections`` finds them, as ``(fd, identity)``
    pairs, taken right after the group is built (gloo connects every pair then). ``shutdown_sockets`` shuts them
    down later even once their peer is gone: a socket whose peer reset it has no remote address left, so
    ``shutdown_connections`` no longer recognizes it, while an op posted on it may wait until the group's
    timeout. With ``since`` (``socket_fds()`` taken before the group was built), only sockets opened after it:
    a port is reused once its listener closed, so another session's older connection to a peer's previous gloo
    port matches this group's peers by address (seen in a suite run beside a CPU hog, 2026-12-05: a failed
    session's abort then shut down a healthy session's all-reduce). Linux only (elsewhere empty)."""
    found = []
    for fd, dup in _group_connections(own, peers):
        dup.close()
        identity = _identity(fd)
        if identity is not None and (since is None or (fd, identity) not in since):
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


_CONDUIT = "_pybind11_conduit_v1_"
#: gloo's point-to-point works and their ``abort`` (Itanium C++ ABI names, exported by libtorch_cpu)
_WORKS = {
    "send": ("_ZTVN4c10d16ProcessGroupGloo8SendWorkE", "_ZN4c10d16ProcessGroupGloo8SendWork5abortEv"),
    "recv": ("_ZTVN4c10d16ProcessGroupGloo8RecvWorkE", "_ZN4c10d16ProcessGroupGloo8RecvWork5abortEv"),
}


def _abi_ids() -> list[bytes]:
    """The pybind11 ABI ids (``PYBIND11_PLATFORM_ABI_ID``) of the pybind11 builds loaded in this interpreter, from
    the names under which they keep their internals (``__pybind11_internals_v<N>_<id>__``: pybind11 >= 3 in the
    interpreter's state dict, older ones in ``builtins``); the conduit answers only to its own build's id.

    ``PyInterpreterState_GetDict`` returns a borrowed reference: it is read through a ``c_void_p`` and
    ``ctypes.cast`` (which takes a reference of its own), never as a ``py_object`` result, which ctypes takes to be
    a new reference and releases: that dropped the interpreter's dict (its only reference) to 0 and freed it while
    the interpreter still held it, and the interpreter's release of it at exit then decremented whatever had
    reused that memory; processes that had aborted a gloo transfer crashed with SIGSEGV in the collector's last
    run (``Py_FinalizeEx -> interpreter_clear -> gc_collect_main``; the test process, 2026-12-05)."""
    import builtins

    names = list(vars(builtins))
    try:
        api = ctypes.PyDLL(None)  # the interpreter's C API, with our own function objects (not ctypes.pythonapi's)
        api.PyInterpreterState_Get.restype = ctypes.c_void_p
        api.PyInterpreterState_GetDict.restype = ctypes.c_void_p
        api.PyInterpreterState_GetDict.argtypes = [ctypes.c_void_p]
        state_dict = api.PyInterpreterState_GetDict(api.PyInterpreterState_Get())
        if state_dict:
            names += list(ctypes.cast(state_dict, ctypes.py_object).value)
    except (OSError, AttributeError, ValueError):
        pass
    found = []
    for name in names:
        if isinstance(name, str) and name.startswith("__pybind11_internals_v") and name.endswith("__"):
            parts = name[2:-2].split("_", 3)  # pybind11, internals, v<N>, <id>
            if len(parts) == 4 and parts[3].encode() not in found:
                found.append(parts[3].encode())
    return found


class _Conduit:
    """What ``abort_work`` needs, found once: the pybind11 ABI ids, a capsule of ``std::type_info`` for
    ``c10d::Work``, the capsule functions of the C API, and ``{vtable address: abort function}``."""

    __slots__ = ("abis", "type_info", "aborts", "name", "pointer")


@functools.lru_cache(maxsize=1)
def _conduit() -> _Conduit | None:
    """The ``_Conduit`` of this process, or None where this torch build does not offer what it needs."""
    import torch

    c = _Conduit()
    try:
        api = ctypes.PyDLL(None)
        new_capsule = api.PyCapsule_New
        new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                                        ctypes.c_void_p]
        c.name = api.PyCapsule_GetName
        c.name.restype, c.name.argtypes = ctypes.c_char_p, [ctypes.py_object]
        c.pointer = api.PyCapsule_GetPointer
        c.pointer.restype, c.pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        cpu = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        type_info = ctypes.addressof(ctypes.c_void_p.in_dll(cpu, "_ZTIN4c10d4WorkE"))
        aborts = {}
        for vtable_name, abort_name in _WORKS.values():
            # a vtable's address point follows its offset-to-top and its type_info pointer
            vtable = ctypes.addressof(ctypes.c_void_p.in_dll(cpu, vtable_name)) + 2 * ctypes.sizeof(ctypes.c_void_p)
            fn = getattr(cpu, abort_name)
            fn.argtypes, fn.restype = [ctypes.c_void_p], None
            aborts[vtable] = fn
        c.aborts = aborts
        c.type_info = new_capsule(type_info, b"St9type_info", None)  # typeid(std::type_info).name()
    except (OSError, AttributeError, ValueError):
        return None
    c.abis = _abi_ids()
    return c


def _work_pointer(work, c: _Conduit) -> int | None:
    """The C++ ``c10d::Work*`` behind the Python ``work``, through pybind11's conduit, or None."""
    conduit = getattr(work, _CONDUIT, None)
    if conduit is None:
        return None
    for abi in c.abis:
        try:
            capsule = conduit(abi, c.type_info, b"raw_pointer_ephemeral")
        except Exception:
            return None
        if capsule is not None:
            return c.pointer(capsule, c.name(capsule))
    return None


def abort_work(work) -> bool:
    """End a wait on gloo point-to-point ``work`` (a ``SendWork`` or ``RecvWork`` of ``ProcessGroupGloo.send`` /
    ``recv``, as ``torch.distributed.batch_isend_irecv`` returns them), now or, if nobody waits yet, at its next
    ``wait()``, which then returns False (torch's ``Work::abort``: gloo's ``abortWaitSend``/``abortWaitRecv``).
    The caller keeps ``work`` alive meanwhile. Returns whether it was aborted: False for any other kind of work,
    or where this torch build does not offer what is needed (see the module's docstring)."""
    c = _conduit()
    if c is None:
        return False
    pointer = _work_pointer(work, c)
    if not pointer:
        return False
    abort = c.aborts.get(ctypes.c_void_p.from_address(pointer).value)
    if abort is None:
        return False
    abort(pointer)
    return True
