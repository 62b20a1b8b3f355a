"""Snapshots of remote tensors for Dask (``dask_monarch.to_dask``): the worker side.

``to_dask`` sends a ``CallFunction`` of :func:`export` in the mesh's order, so the snapshot is the tensor's value
at that point of the program (later mesh work does not change it); a Dask task pinned to the same worker
(``dask_monarch.data.tasks.take_export``) waits for it and returns it as its result, so Dask holds the chunk there
from then on. Exports nobody took are dropped when their session ends on this worker (``release_session``).
"""

from __future__ import annotations

import concurrent.futures
import threading

import torch

from .context import current_stream
from ..protocol.session_id import session_tag

__all__ = ["RawRef", "export", "slot", "take", "release_session"]


class RawRef:
    """A ref that the worker does not resolve (spec §8: refs inside non-pytree containers stay raw), so that
    ``export`` itself can tell a value from an error."""

    __slots__ = ("id",)

    def __init__(self, ref_id: int):
        self.id = ref_id

    def __reduce__(self):
        return (RawRef, (self.id,))

#: (session id, token, global rank) -> concurrent.futures.Future of the numpy array
_slots: dict = {}
_lock = threading.Lock()


def slot(session_id: str, token: str, rank: int) -> concurrent.futures.Future:
    """The future that ``export`` fills for ``(session_id, token, rank)``, made if it is not there yet."""
    with _lock:
        future = _slots.get((session_id, token, rank))
        if future is None:
            future = _slots[(session_id, token, rank)] = concurrent.futures.Future()
        return future


def take(session_id: str, token: str, rank: int) -> None:
    """Forget the slot once its task has the value."""
    with _lock:
        _slots.pop((session_id, token, rank), None)


def export(token: str, mesh, ref: RawRef, ranks) -> None:
    """On a stream's thread: a CPU numpy copy of the tensor ``ref`` of this stream for the ``take_export`` task of
    this rank, if this rank (global) is one of ``ranks``. The task raises instead if the ref holds an error (the
    computation of the tensor failed), is missing, or has a dtype numpy lacks (bfloat16, float8)."""
    if mesh.me not in ranks:
        return
    stream = current_stream()
    future = slot(stream.tw.session_id, token, mesh.me)
    value = stream.env.get(ref.id)
    if value is None:
        future.set_exception(RuntimeError(f"to_dask: tensor r{ref.id} is not on rank {mesh.me}"))
    elif not isinstance(value, torch.Tensor):  # a SeqError: the computation of the tensor failed
        future.set_exception(RuntimeError(f"to_dask: the tensor r{ref.id} holds an error on rank {mesh.me}: "
                                          f"{value}"))
    else:
        try:
            future.set_result(value.detach().to("cpu", copy=True).numpy())
        except TypeError as e:
            future.set_exception(TypeError(
                f"to_dask: a {value.dtype} tensor has no numpy dtype ({e}); cast it first, e.g. t.float()"
            ))


def fail(session_id: str, token: str, rank: int, text: str) -> None:
    """The export of ``(session_id, token, rank)`` cannot happen (its tensor holds an error)."""
    future = slot(session_id, token, rank)
    if not future.done():
        future.set_exception(RuntimeError(text))


def release_session(session_id: str) -> None:
    """The session ended on this worker: fail the exports still waited for, forget the rest."""
    with _lock:
        keys = [k for k in _slots if k[0] == session_id]
        futures = [_slots.pop(k) for k in keys]
    for future in futures:
        if not future.done():
            future.set_exception(RuntimeError(
                f"session {session_tag(session_id)} ended on this worker before the export"))
