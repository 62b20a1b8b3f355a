"""``breakpoint()`` and ``pdb.set_trace()`` inside a remote function: a clear error instead of a silent quit.

Monarch relays a remote function's pdb session to the controller's terminal over its actor messages. Here a remote
function runs on a stream thread of a Dask worker process whose standard input is ``/dev/null`` (the nanny's
``multiprocessing`` child closes it), so plain pdb reads end-of-file at its first prompt, quits, and the function
fails with a bare ``bdb.BdbQuit``; on a worker started by hand with a terminal, several ranks would read the same
terminal at once. Neither is a debugger. So on a stream thread both calls raise ``RuntimeError`` naming the rank
and saying what to do instead; that one call fails (``RemoteException`` at the controller, with this text), the
session and the worker go on. Elsewhere in the process (ordinary Dask tasks, the worker's own threads) they do what
they did before. ``PYTHONBREAKPOINT=0`` in the worker's environment still turns ``breakpoint()`` off.
"""

from __future__ import annotations

import os
import pdb
import sys
import threading

from .context import current_stream

__all__ = ["install", "refuse"]

_lock = threading.Lock()
_installed = False

#: what to do instead, said by the error
ADVICE = (
    "dask_monarch cannot open pdb on a rank: the worker process has no terminal to read commands from, and the "
    "controller's terminal is not relayed to it. Instead: run the function locally under dask_monarch.no_mesh."
    "activate() with local tensors, e.g. dm.inspect(x) of its inputs (and debug it there with pdb); fetch values "
    "from the rank with dm.call_on_shard_and_fetch(fn, *args, shard={...}); or log from it "
    "(dask_monarch.builtins.log.log_remote). The RemoteException of a failing call carries the rank's traceback."
)


def refuse(what: str) -> None:
    """Raise the ``RuntimeError`` for ``what`` (``"breakpoint()"``) called on the current stream's thread."""
    stream = current_stream()
    tw = getattr(stream, "tw", None)
    where = f"rank {tw.rank} (worker {tw.worker.address})" if tw is not None and hasattr(tw, "rank") else "a rank"
    raise RuntimeError(f"{what} in a remote function on {where}: {ADVICE}")


def install() -> None:
    """Wrap ``sys.breakpointhook`` and ``pdb.set_trace`` of this process (once; idempotent) so that on a stream
    thread they ``refuse``, and elsewhere call what they called before."""
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
            refuse("breakpoint()")

        def guarded_set_trace(*args, **kwargs):
            if current_stream() is None:
                return set_trace(*args, **kwargs)
            refuse("pdb.set_trace()")

        sys.breakpointhook = breakpointhook
        pdb.set_trace = guarded_set_trace
        _installed = True
