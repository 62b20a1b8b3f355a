"""The objects that ``OpaqueRef`` s name on this worker (``dask_monarch/opaque_ref.py``): one table per session.

A remote function that makes ``OpaqueRef(obj)`` puts ``obj`` in the table of the session whose stream runs it,
under the ref's key, a 0-d int64 tensor that travels like any result tensor (the controller holds it as a remote
``Tensor``). The table holds its keys weakly (``torch.utils.weak.WeakTensorKeyDictionary``): when the controller
drops its handle, ``DeleteRefs`` removes the key from the stream's ref table, the key tensor is freed and the
object with it. When the session ends (``TensorWorker.close``) its whole table goes, objects the controller still
holds included: nothing waits for Python's cyclic garbage collector, and no other session sees them.
"""

from __future__ import annotations

import threading

from torch.utils.weak import WeakTensorKeyDictionary

from .context import current_stream

__all__ = ["is_key", "live_objects", "release_session", "session_table"]

_tables: dict = {}  # session id -> WeakTensorKeyDictionary (key tensor -> object)
_lock = threading.Lock()


def session_table(create: bool = True):
    """The table of the session whose stream thread calls this, None outside a stream's thread. ``create``: make
    it if the session has none yet; ``RuntimeError`` once the session is ending (a function still running after
    the end may not leave objects behind)."""
    stream = current_stream()
    if stream is None:
        return None
    tw = stream.tw
    with _lock:
        table = _tables.get(tw.session_id)
        if table is None:
            if not create:
                return WeakTensorKeyDictionary()
            if tw._closing:
                raise RuntimeError(f"OpaqueRef: session {tw.session_id} has ended on this worker; no object can be "
                                   "kept for it")
            table = _tables[tw.session_id] = WeakTensorKeyDictionary()
    return table


def live_objects() -> int:
    """How many objects ``OpaqueRef`` s of the calling stream's session hold on this worker (0 outside a stream)."""
    table = session_table(create=False)
    return 0 if table is None else len(table)


def is_key(tensor) -> bool:
    """Whether ``tensor`` is the key of an ``OpaqueRef`` of the calling stream's session."""
    table = session_table(create=False)
    return bool(table) and tensor in table


def release_session(session_id: str) -> None:
    """Forget every object of session ``session_id`` on this worker (its end); idempotent."""
    with _lock:
        table = _tables.pop(session_id, None)
    if table is not None:
        table.clear()
