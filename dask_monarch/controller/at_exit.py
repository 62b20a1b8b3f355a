"""Sessions still open when the program ends (no ``with``, no ``exit()``: a notebook's last cell, a script that
just stops) are ended then as ``mesh.exit()`` ends them, so that they count as ended on the workers
(``dask_monarch_sessions_ended{outcome="exited"}``), not failed, and print nothing. ``attach`` remembers each mesh
it returns; ``mesh.exit()`` forgets it.
"""

from __future__ import annotations

import atexit
import sys
import threading

__all__ = ["remember", "forget", "live_meshes"]

_lock = threading.Lock()
_live: dict = {}  # id -> owner mesh not yet exited
_registered = False


def remember(mesh) -> None:
    """End ``mesh`` (the one ``attach`` returned) at interpreter exit unless it is exited before."""
    global _registered
    with _lock:
        _live[id(mesh)] = mesh
        if not _registered:
            _at_interpreter_exit(_exit_live_meshes)
            _registered = True


def forget(mesh) -> None:
    with _lock:
        _live.pop(id(mesh), None)


def live_meshes() -> list:
    """The meshes ``attach`` returned that are not exited yet (``dask_monarch.report``'s default session)."""
    with _lock:
        return list(_live.values())


def _at_interpreter_exit(fn) -> None:
    """Run ``fn`` when the interpreter exits, before ``concurrent.futures`` stops its thread pools: those hooks
    (``threading._register_atexit``, run last-registered first, before ``atexit``'s) come first, and Dask's
    future callbacks, which carry a session's answers, need those pools (at ``atexit`` time every wait of
    ``mesh.exit()`` ran into its timeout). Plain ``atexit`` where that hook is missing."""
    try:
        threading._register_atexit(fn)
    except (AttributeError, RuntimeError):
        atexit.register(fn)


def _exit_live_meshes() -> None:
    """End every session still open as ``mesh.exit()`` does; print only a real failure (one nobody fetched)."""
    with _lock:
        meshes = list(_live.values())
    for mesh in meshes:
        if getattr(mesh.client, "status", None) in ("closing", "closed"):
            # the program closed its Client (or cluster) first: the session ended with it, nothing to drain
            mesh._session.stop()
            closer = mesh.__dict__.pop("_closer", None)
            if closer is not None:
                closer()
            continue
        try:
            mesh.exit()
        except BaseException as e:
            print(f"dask_monarch: session {mesh.session_id} at interpreter exit: {type(e).__name__}: {e}",
                  file=sys.stderr)
