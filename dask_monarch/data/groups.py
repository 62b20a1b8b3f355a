"""``iter_from_dask``: a Dask collection too large for one ``from_dask``, into the mesh a group of partitions at a
time, read ahead (issue 15 item 6: batch inference at the rate of the workers, not of the controller's waits).

Each group is one ``from_dask`` (``collections.py``; the same placement, padding and errors) of the next
``partitions`` partitions per rank. The controller begins the ``ahead`` groups after the one it hands out
(``start_from_dask``: persisted on the workers of the ranks that will read them, their rows counted there, and each
rank's block assembled as soon as the counts are in) before it waits for that one, so while the program sends the mesh its work on group k, the workers' Dask threads already
read and convert group k + 1: reading overlaps the mesh's streams, and no group waits for the controller's round
trips of the one before. At most ``ahead + 1`` groups are held on the workers beside what the mesh holds.
"""

from __future__ import annotations

from collections import deque

from ..controller.mesh import DeviceMesh
from .collections import _is_array, _is_dataframe, mesh_dim, start_from_dask

__all__ = ["iter_from_dask"]


def iter_from_dask(collection, mesh: DeviceMesh, dim: str | None = None, *, partitions: int = 4, ahead: int = 1,
                   columns=None, dtype=None, drop_remainder: bool = False, pad=None, timeout: float = 300.0):
    """Yield ``collection``'s rows as remote ``Tensor``s, one per group of ``partitions * S`` consecutive partitions
    (S ranks along mesh dimension ``dim``; the last group may have fewer), in row order: group g is
    ``from_dask(collection.partitions[g * partitions * S:(g + 1) * partitions * S], mesh, dim, ...)`` with the same
    keyword arguments (``columns``, ``dtype``, ``drop_remainder``, ``pad``, ``timeout``; a 2-D ``(rows, columns)``
    tensor per rank for a DataFrame, ``(rows, *rest)`` for an array; each group's rows split over the ranks on their
    own: use ``pad=`` or ``drop_remainder=True`` unless every group's rows divide by S).

    ``ahead`` groups after the one yielded are already being read on the workers (persisted where they will be
    read, ``from_dask``'s placement), so the mesh's work on one group overlaps the reading of the next; ``ahead=0``
    reads each group only when it is asked for. Stopping early (``break``) releases the groups read ahead.

    Raises ``TypeError`` for a collection that is not a Dask array or DataFrame, ``ValueError`` for ``partitions``
    below 1 or ``ahead`` below 0 (each named), ``KeyError`` for an unknown ``dim``; a group raises ``from_dask``'s
    errors when it is reached (its rows do not split, the collection's own failure, ``TimeoutError`` after
    ``timeout`` seconds)."""
    what = "iter_from_dask"
    if not (_is_array(collection) or _is_dataframe(collection)):
        raise TypeError(f"{what}: expected a dask.array.Array or a dask.dataframe.DataFrame, got "
                        f"{type(collection).__module__}.{type(collection).__name__}")
    for name, value, low in (("partitions", partitions, 1), ("ahead", ahead, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{what}: {name} must be an integer >= {low}, got {value!r}")
    dim = mesh_dim(mesh, dim, what)
    step = partitions * mesh.size(dim)
    total = collection.numblocks[0] if _is_array(collection) else collection.npartitions
    kwargs = dict(columns=columns, dtype=dtype, drop_remainder=drop_remainder, pad=pad, timeout=timeout, what=what)
    return _groups(collection, mesh, dim, range(0, total, step), step, ahead, kwargs)


def _groups(collection, mesh, dim, firsts, step: int, ahead: int, kwargs: dict):
    firsts = iter(firsts)
    started = deque()  # PendingBlocks of the groups begun, in order

    def begin() -> None:
        first = next(firsts, None)
        if first is not None:
            index = slice(first, first + step)
            part = collection.blocks[index] if _is_array(collection) else collection.partitions[index]
            started.append(start_from_dask(part, mesh, dim, early=True, **kwargs))

    try:
        while True:
            for _ in range(ahead + 1 - len(started)):
                begin()  # this group and the ``ahead`` after it: those are read while the program works on it
            if not started:
                return
            yield started.popleft().result()
    finally:
        for pending in started:  # the groups read ahead: their persisted partitions go with their futures
            pending.cancel()
        started.clear()
