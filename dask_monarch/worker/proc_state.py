"""Whether a process of this host is running: the state letter of ``/proc/<pid>/stat`` (proc(5)), read again on a
descriptor kept open (about 1 us a read on the 2-core development machine, against about 5 us to open it each
time). A host's relay answers a barrier for a quiet rank only while the rank's process runs (``worker/relay.py``,
"Quiet ranks"): a stopped (SIGSTOP), traced, zombie or gone process is asked instead, and the fetch waits for it as
the heartbeat bound expects.

A process is named by ``identity()``: its pid and its start time (field 22 of ``stat``, in clock ticks since boot),
so that a pid reused by another process is not taken for it. Where ``/proc`` does not show it (another pid
namespace, no ``/proc``), ``ProcState`` knows nothing and says so (``running()`` False).
"""

from __future__ import annotations

import os

__all__ = ["ProcState", "identity"]

#: the states of a process that runs: running, sleeping, disk sleep (proc(5)); not T, t, Z, X
_RUNNING = frozenset(b"RSD")
_identity: tuple | None = None


def _fields(data: bytes) -> list[bytes]:
    """The fields of a ``stat`` line after the command name (which may hold spaces and parentheses): the state
    first."""
    return data[data.rindex(b")") + 2:].split()


def identity() -> tuple[int, int] | None:
    """``(pid, start time)`` of this process, or None where ``/proc`` cannot tell."""
    global _identity
    if _identity is None:
        try:
            with open(f"/proc/{os.getpid()}/stat", "rb") as f:
                _identity = (os.getpid(), int(_fields(f.read())[19]))
        except (OSError, ValueError, IndexError):
            return None
    return _identity


class ProcState:
    """The state of the process ``ident`` (``identity()`` of it, or None): ``running()`` reads it again; ``close()``
    gives the descriptor back. This process itself always runs."""

    def __init__(self, ident: tuple | None):
        self._fd = None
        self.own = ident is not None and tuple(ident) == identity()
        if ident is None or self.own:
            return
        pid, start = ident
        try:
            fd = os.open(f"/proc/{int(pid)}/stat", os.O_RDONLY)
        except (OSError, TypeError, ValueError):
            return
        try:
            if int(_fields(os.pread(fd, 1024, 0))[19]) == start:
                self._fd, fd = fd, None
        except (OSError, ValueError, IndexError):
            pass
        finally:
            if fd is not None:
                os.close(fd)

    def running(self) -> bool:
        """Whether the process runs now (not stopped, traced, a zombie, gone, or unknown here)."""
        if self.own:
            return True
        if self._fd is None:
            return False
        try:
            data = os.pread(self._fd, 1024, 0)
            return data[data.rindex(b")") + 2] in _RUNNING
        except (OSError, ValueError, IndexError):  # gone (ESRCH)
            return False

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
