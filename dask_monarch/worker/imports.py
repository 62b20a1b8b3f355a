"""Blocks of rows handed to a mesh by ``dask_monarch.from_dask``: the worker side.

The ``assemble`` task (``dask_monarch.data.tasks``), pinned to a rank's worker, builds the rank's block (a new
numpy array) and leaves it here under ``(session id, token, rank)``; the controller waits for every rank's
``assemble`` and then sends a ``CallFunction`` of ``take_block``, which the rank's stream runs in the mesh's
order and which takes the block from here as a tensor. Dask itself holds only the task's row count, so nothing
has to keep Dask's copy alive until the stream took it (no wait for that at the controller). Blocks nobody took
are dropped when their session ends on this worker (``release_session``). The counterpart of ``exports.py``.
"""

from __future__ import annotations

import threading

__all__ = ["put", "take", "release_session"]

#: (session id, token, global rank) -> the rank's block, a numpy array
_blocks: dict = {}
_lock = threading.Lock()


def put(session_id: str, token: str, rank: int, block) -> None:
    """Leave ``block`` for ``take_block`` of ``(session_id, token, rank)``."""
    with _lock:
        _blocks[(session_id, token, rank)] = block


def take(session_id: str, token: str, rank: int):
    """The block left for ``(session_id, token, rank)``, forgotten here; None if there is none."""
    with _lock:
        return _blocks.pop((session_id, token, rank), None)


def release_session(session_id: str) -> None:
    """The session ended on this worker: drop the blocks its streams never took."""
    with _lock:
        for key in [k for k in _blocks if k[0] == session_id]:
            del _blocks[key]
