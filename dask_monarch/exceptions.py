"""Errors the controller raises (spec §3 "Controller"; DESIGN.md "Decisions")."""

from __future__ import annotations

import re
import traceback

__all__ = ["RemoteException", "SessionError"]

#: a frame line of a formatted Python traceback, and the source line after it, if any
_FRAME = re.compile(r'^  File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<name>.*)\n(?:    (?P<code>.*)\n)?', re.M)


class RemoteException(Exception):
    """A remote invocation failed. Raised when a value that depends on it is fetched, or at ``mesh.exit()`` if
    nobody fetched one (spec §3).

    Attributes: ``seq`` (the failing invocation), ``rank`` (the first rank that reported it), ``worker`` (its
    Dask worker address), ``backtrace`` (the remote traceback text; also ``worker_error_string``, Monarch's name),
    ``worker_frames`` (its frames, ``traceback.FrameSummary`` s, innermost last, as Monarch's), ``function`` (what
    was called), ``others`` (raised by ``mesh.exit()``: the other failures nobody fetched, ``RemoteException``
    objects in seq order; the message counts them and names their seqs).
    """

    def __init__(self, seq: int, rank: int, worker: str, backtrace: str, function: str = "", others=()):
        self.seq = seq
        self.rank = rank
        self.worker = worker
        self.backtrace = backtrace
        self.function = function
        self.others = list(others)
        what = f" {function}" if function else ""
        text = f"remote invocation{what} (seq {seq}) failed on rank {rank} ({worker}):\n{backtrace}"
        if self.others:
            listed = ", ".join(
                f"seq {e.seq}" + (f" ({e.function})" if e.function else "") + f" on rank {e.rank}" for e in self.others
            )
            n = len(self.others)
            text += f"\n... and {n} other remote failure{'s' if n > 1 else ''} nobody fetched: {listed}"
        super().__init__(text)

    def __reduce__(self):
        return (RemoteException, (self.seq, self.rank, self.worker, self.backtrace, self.function, self.others))

    @property
    def worker_error_string(self) -> str:
        """The error as the worker reported it: its traceback text (Monarch's ``RemoteException`` attribute)."""
        return self.backtrace

    @property
    def worker_frames(self) -> list:
        """The frames of the worker's traceback, outermost first, as ``traceback.FrameSummary`` s (``.name``,
        ``.filename``, ``.lineno``, ``.line``); [] if the text holds none."""
        return [traceback.FrameSummary(m["file"], int(m["line"]), m["name"], line=m["code"])
                for m in _FRAME.finditer(self.backtrace or "")]


class SessionError(RuntimeError):
    """The session can no longer run: a fatal (class F) error on a worker, a worker that left the cluster, or a
    wait that ran out of time. The message names the rank and worker. Other sessions are not affected."""
