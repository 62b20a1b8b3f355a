"""The worker's half of Monarch's debugger: ``breakpoint()`` (or ``pdb.set_trace()``) in a remote function opens
pdb on that rank, driven from the controller's terminal (``controller/debugger.py`` has the other half).

A remote function runs on a stream thread of a Dask worker process whose standard input is ``/dev/null``, so
plain pdb would read end-of-file at once and quit (a bare ``bdb.BdbQuit``). Here, on a stream thread, both calls
start a ``RankPdb`` instead: pdb whose output goes to the controller as Dask events (``Worker.log_event`` on the
topic ``monarch-debugger-<session id>``: ``{"rank", "worker", "kind", "text"}`` with kind ``"write"``, ``"read"``:
pdb waits for a command, or ``"detach"``: it let the function go on) and whose input is what the controller sends
back with ``Client.run(feed, ...)``. Only that stream's thread stops; the worker's other threads, heartbeats
included, and the other ranks go on. Frames of dask_monarch, torch and Dask are skipped when stepping.

Every wait for a command is bounded by the session: when it ends (``mesh.exit()``, a failure, a controller that
left), pdb reads end-of-file, quits, and the function fails with ``BdbQuit``. Elsewhere in the process (ordinary
Dask tasks, the worker's own threads) ``breakpoint()`` and ``pdb.set_trace()`` do what they did before, and
``PYTHONBREAKPOINT=0`` in the worker's environment still turns ``breakpoint()`` off.
"""

from __future__ import annotations

import os
import pdb
import queue
import sys
import threading

from .context import current_stream

__all__ = ["RankPdb", "feed", "install", "topic"]

_lock = threading.Lock()
_installed = False
#: (session id, rank) -> the commands the controller sent, not yet read by pdb
_commands: dict = {}

#: seconds between checks that the session still runs, while pdb waits for a command
POLL = 0.2
#: modules whose frames pdb does not stop in when stepping
SKIP = ("dask_monarch", "dask_monarch.*", "torch", "torch.*", "distributed", "distributed.*", "threading",
        "concurrent.*")


def topic(session_id: str) -> str:
    """The Dask event topic of a session's debugger messages."""
    return f"monarch-debugger-{session_id}"


def _queue(session_id: str, rank: int) -> queue.Queue:
    with _lock:
        return _commands.setdefault((session_id, rank), queue.Queue())


def feed(session_id: str, rank: int, line: str) -> None:
    """Run by the controller on the rank's worker (``Client.run``): ``line`` is pdb's next command there."""
    _queue(session_id, rank).put(line)


class _Relay:
    """pdb's stdin and stdout on a rank: output is buffered and sent as a ``"write"`` event when pdb waits for a
    command (or detaches); ``readline`` sends ``"read"`` and waits for the controller's line."""

    encoding = "utf-8"

    def __init__(self, tw):
        self.tw = tw
        self._buffer: list[str] = []

    def send(self, kind: str, text: str = "") -> None:
        self.tw.worker.log_event(topic(self.tw.session_id), {
            "rank": self.tw.rank, "worker": self.tw.worker.address, "kind": kind, "text": text})

    def write(self, text: str) -> int:
        self._buffer.append(text)
        return len(text)

    def flush(self) -> None:
        if self._buffer:
            text, self._buffer = "".join(self._buffer), []
            self.send("write", text)

    def detach(self) -> None:
        """pdb let the function go on: send what it wrote and ``"detach"``; forget the commands' queue."""
        self.flush()
        self.send("detach")
        with _lock:
            _commands.pop((self.tw.session_id, self.tw.rank), None)

    def isatty(self) -> bool:
        return False

    def readline(self) -> str:
        self.flush()
        lines = _queue(self.tw.session_id, self.tw.rank)
        self.send("read")
        while True:
            try:
                return lines.get(timeout=POLL) + "\n"
            except queue.Empty:
                if getattr(self.tw, "_closing", False) or getattr(self.tw, "failure", None) is not None:
                    return ""  # the session ends: end-of-file, pdb quits


class RankPdb(pdb.Pdb):
    """pdb on the stream thread of a rank, its input and output relayed to the controller (``_Relay``); the prompt
    names the rank."""

    def __init__(self, tw):
        self.relay = _Relay(tw)
        super().__init__(stdin=self.relay, stdout=self.relay, skip=SKIP, nosigint=True, readrc=False)
        self.prompt = f"(Pdb rank {tw.rank}) "

    def set_continue(self):
        super().set_continue()
        self.relay.detach()

    def set_quit(self):
        super().set_quit()
        self.relay.detach()


def _stop_here(frame) -> None:
    tw = current_stream().tw
    RankPdb(tw).set_trace(frame)


def install() -> None:
    """Wrap ``sys.breakpointhook`` and ``pdb.set_trace`` of this process (once; idempotent) so that on a stream
    thread they open a ``RankPdb`` at their caller's frame, and elsewhere call what they called before."""
    global _installed
    with _lock:
        if _installed:
            return
        hook, set_trace = sys.breakpointhook, pdb.set_trace

        def breakpointhook(*args, **kwargs):
            if current_stream() is None:
                return hook(*args, **kwargs)
            if os.environ.get("PYTHONBREAKPOINT") == "0":
                return None
            _stop_here(sys._getframe(1))

        def guarded_set_trace(*args, header=None, **kwargs):
            if current_stream() is None:
                return set_trace(*args, header=header, **kwargs)
            _stop_here(sys._getframe(1))

        sys.breakpointhook = breakpointhook
        pdb.set_trace = guarded_set_trace
        _installed = True
