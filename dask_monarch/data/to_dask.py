"""Remote tensors out of a mesh as Dask collections: ``to_dask``, ``to_dask_dataframe`` (issue 15; DESIGN.md
"Decisions": in place, nothing through the controller).

A ``CallFunction`` of ``dask_monarch.worker.exports.export`` snapshots each shard in the mesh's order, and a pinned
``take_export`` task per shard (``tasks.py``; it waits seceded from the worker's thread pool) makes it a Dask chunk
on the worker that holds it. The counterpart of ``collections.py``.
"""

from __future__ import annotations

import uuid

import numpy as np

from ..controller.remote import call_on_mesh, function_of
from ..controller.tensor import Tensor
from ..worker.exports import RawRef
from .collections import mesh_dim, torch_to_numpy
from .tasks import frame, take_export

__all__ = ["to_dask", "to_dask_dataframe"]

_EXPORT = function_of("dask_monarch.worker.exports.export")


def _no_tensors(*args, **kwargs):
    return None


def to_dask(tensor: Tensor, dim: str | None = None, *, timeout: float = 300.0):
    """A ``dask.array.Array`` whose chunks are ``tensor``'s shards along mesh dimension ``dim``, in order: chunk i
    is the tensor of the rank at position i of ``dim`` (coordinate 0 of the other dimensions), so the array has
    shape ``(S * tensor.shape[0], *tensor.shape[1:])`` for S ranks along ``dim``, and the numpy dtype of
    ``tensor.dtype`` (``TypeError`` for bfloat16 and others numpy lacks: cast first).

    Each chunk is a snapshot taken in the mesh's order (a ``CallFunction`` at this point of the program): later
    mesh work, in-place updates of ``tensor`` included, does not change it. It is made on, and held by Dask on, the
    worker of its rank (a Dask future; nothing passes through the controller) and lives as long as the array
    (or what was computed from it) is referenced, also after the session ends, while the mesh's client is open.
    A shard that cannot be taken (its computation failed) fails the chunk's task with that error when the
    array is computed; ``timeout`` bounds each task's wait for its snapshot, which holds none of the worker's Dask
    threads (the task secedes, ``distributed.secede``): Dask work sent later, a ``from_dask`` the snapshot comes
    after in the mesh's order included, runs meanwhile.
    """
    import dask.array as da

    shape, np_dtype, futures, _ = _shard_futures(tensor, dim, timeout, "to_dask")
    return da.concatenate([da.from_delayed(f, shape=shape, dtype=np_dtype) for f in futures], axis=0)


def _shard_futures(tensor, dim, timeout: float, what: str):
    """``(shard shape, numpy dtype, futures, ranks)``: the ``take_export`` tasks of ``tensor``'s shards along
    ``dim``, and the rank of each."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{what}: expected a remote dask_monarch Tensor, got {type(tensor).__module__}."
                        f"{type(tensor).__qualname__} (a local tensor: make it on the mesh, under mesh.activate())")
    tensor.check_usable()
    mesh = tensor.mesh
    dim = mesh_dim(mesh, dim, what)
    if tensor.dim() == 0:
        raise ValueError(f"{what}: a 0-d tensor has no rows to shard; reshape it to (1,) first")
    np_dtype = torch_to_numpy(tensor.dtype, what)
    session = mesh._session
    others = {d: 0 for d in mesh.names if d != dim}
    ranks = list(mesh.slice(**others)._rank_list) if others else list(mesh._rank_list)
    token = uuid.uuid4().hex[:12]
    with tensor.stream.activate():
        call_on_mesh(_EXPORT, "to_dask", _no_tensors, (token, mesh, RawRef(tensor.ref.id), ranks), {}, mesh=mesh)
    session.flush()
    client = mesh.client
    workers = mesh.workers
    futures = [
        client.submit(take_export, session.id, token, rank, timeout, workers=[workers[rank]],
                      allow_other_workers=False, pure=False, key=f"monarch-{what}-{token}-{position}")
        for position, rank in enumerate(ranks)
    ]
    return tuple(tensor.shape), np_dtype, futures, ranks


def to_dask_dataframe(tensor: Tensor, dim: str | None = None, columns=None, *, timeout: float = 300.0):
    """A ``dask.dataframe.DataFrame`` of ``tensor`` (1-D: one column; 2-D: one column per tensor column) whose
    partitions are the shards along ``dim``, made as ``to_dask`` makes its chunks (the same snapshot rule;
    each partition is built on the worker holding its shard, nothing through the controller). ``columns`` names
    the columns (default ``"0"``, ``"1"``, ...; ``ValueError`` if the count differs from the tensor's columns).
    The index runs 0 .. N-1 over the partitions in order."""
    import dask.dataframe as dd
    import pandas as pd

    what = "to_dask_dataframe"
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{what}: expected a remote dask_monarch Tensor, got {type(tensor).__module__}."
                        f"{type(tensor).__qualname__} (a local tensor: make it on the mesh, under mesh.activate())")
    if tensor.dim() not in (1, 2):
        raise ValueError(f"{what}: expected a 1-D or 2-D tensor, got shape {list(tensor.shape)}")
    width = 1 if tensor.dim() == 1 else tensor.shape[1]
    if columns is None:
        columns = [str(i) for i in range(width)]
    elif isinstance(columns, str):
        columns = [columns]
    columns = list(columns)
    if len(columns) != width:
        raise ValueError(f"{what}: {len(columns)} column names {columns} for a tensor of {width} columns")
    repeated = sorted({c for c in columns if columns.count(c) > 1}, key=str)
    if repeated:
        raise ValueError(f"{what}: column names must be unique; {repeated} repeated in {columns}")
    shape, np_dtype, futures, ranks = _shard_futures(tensor, dim, timeout, what)
    rows = shape[0]
    client = tensor.mesh.client
    workers = [tensor.mesh.workers[rank] for rank in ranks]  # each frame made where its shard is
    frames = [client.submit(frame, f, columns, i * rows, workers=[w], allow_other_workers=True, pure=False,
                            key=f"{f.key}-frame") for i, (f, w) in enumerate(zip(futures, workers))]
    meta = pd.DataFrame({c: np.empty(0, dtype=np_dtype) for c in columns})
    return dd.from_delayed(frames, meta=meta, divisions=[i * rows for i in range(len(frames))] + [len(frames) * rows - 1])
