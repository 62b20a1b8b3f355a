"""What the Dask workers run for ``dask_monarch.data``: Dask tasks (pinned to a rank's worker by the controller,
so Dask moves their inputs worker to worker, never through the controller) and the remote functions a mesh's
streams call. Nothing here imports the controller.

* from_dask: ``PartitionHomes`` (where the partitions are computed), ``nrows`` (the row counts of the partitions one
  worker holds, there), ``rows`` (a piece of a partition, cut on the worker that holds it), ``assemble`` (a rank's block of
  rows as one numpy array, on the rank's worker, left in ``worker/imports.py``), then the remote function
  ``take_block`` (that block as a tensor, on the rank's stream).
* to_dask: the remote function ``dask_monarch.worker.exports.export`` (a snapshot in the mesh's order), then
  ``take_export`` (the snapshot as the task's result, held by Dask on that worker).
* pipes: ``feed_partition`` (a partition into the rank's ``CollectionSource``, ``worker/pipe.py``).
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import torch

__all__ = ["TORCH_DTYPES", "PartitionHomes", "numpy_dtype_of", "rows", "block_of", "assemble", "to_numpy", "take_block", "take_export",
           "feed_partition", "frame", "nrows"]

#: numpy dtype -> torch dtype (what ``torch.from_numpy`` accepts)
TORCH_DTYPES = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.uint16): torch.uint16,
    np.dtype(np.uint32): torch.uint32,
    np.dtype(np.uint64): torch.uint64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.complex64): torch.complex64,
    np.dtype(np.complex128): torch.complex128,
}
_NUMPY_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}


def numpy_dtype_of(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of torch ``dtype``; ``TypeError`` for one numpy lacks (bfloat16, float8, ...)."""
    try:
        return _NUMPY_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"{dtype} has no numpy dtype, so no Dask array can hold it; cast the tensor first "
                        "(e.g. t.float())") from None


def nrows(*parts) -> list:
    """The number of rows of each partition (a numpy array or a pandas DataFrame), run where they all are."""
    return [len(part) for part in parts]


def rows(part, start: int, stop: int):
    """Rows ``start:stop`` of a partition, on the worker that holds it (only that piece then moves)."""
    return part[start:stop] if isinstance(part, np.ndarray) else part.iloc[start:stop]


def to_numpy(part, columns, dtype: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
    """A partition as a numpy array of ``dtype``: a pandas DataFrame's ``columns`` as a new C-ordered 2-D array
    (rows x columns; written into ``out`` if given; never the DataFrame's own memory), or a numpy chunk as it is.
    The columns convert in one pass (``DataFrame.to_numpy``, which interleaves pandas' column blocks); a column
    that does not convert (missing values in an integer column, strings) raises ``TypeError`` naming it."""
    if columns is None:
        return np.asarray(part, dtype=dtype)
    try:
        values = part[columns].to_numpy(dtype=dtype, copy=False)
    except (TypeError, ValueError):
        _check_columns(part, columns, dtype)  # raises naming the column
        raise
    if out is not None:
        out[...] = values
        return out
    if values.flags.owndata and values.flags.c_contiguous:
        return values  # made by the conversion (several blocks interleaved): nobody else holds it
    return np.array(values, dtype=dtype, order="C", copy=True)


def _check_columns(part, columns, dtype: np.dtype) -> None:
    """Convert ``part``'s ``columns`` one by one to ``dtype``: ``TypeError`` naming the first that fails."""
    for name in columns:
        try:
            part[name].to_numpy(dtype=dtype)
        except (TypeError, ValueError) as e:
            raise TypeError(f"column {name!r} (dtype {part[name].dtype}) does not convert to {dtype}: {e}") from None


def block_of(pieces: list, columns, dtype: np.dtype, shape: tuple | None = None, pad=None) -> np.ndarray:
    """A rank's block: its ``pieces`` (partitions or parts of them, in row order) as one new C-ordered numpy array
    of ``dtype`` (always a copy: Dask's own chunks are never handed to the mesh, which may write into what it
    holds); with ``shape`` (more rows than the pieces have), the rows after them are ``pad``."""
    rows = sum(len(p) for p in pieces)
    if shape is None:
        shape = (rows, len(columns)) if columns is not None else (rows, *np.shape(pieces[0])[1:])
    block = np.empty(shape, dtype=dtype)
    start = 0
    for p in pieces:  # each piece written straight into the block: one copy
        if columns is not None:
            to_numpy(p, columns, dtype, out=block[start:start + len(p)])
        else:
            block[start:start + len(p)] = p
        start += len(p)
    if start < len(block):
        block[start:] = pad
    return block


def assemble(session_id: str, token: str, rank: int, pieces: list, columns, dtype: np.dtype,
             shape: tuple | None = None, pad=None) -> int:
    """The Dask task (pinned to rank ``rank``'s worker, its ``pieces`` already moved here by Dask) that builds the
    rank's block (``block_of``; ``shape`` and ``pad`` for a padded one) and leaves it on this worker for
    ``take_block`` (``worker/imports.py``), if the session lives here. Returns the block's row count (all that
    Dask holds). Raises a conversion's ``TypeError`` naming the column."""
    from distributed import get_worker

    from ..worker import imports
    from ..worker.plugin import PLUGIN_NAME

    block = block_of(pieces, columns, dtype, shape, pad)
    plugin = get_worker().plugins.get(PLUGIN_NAME)
    if plugin is not None and session_id in plugin.sessions:  # else the session ended here: nobody will take it
        imports.put(session_id, token, rank, block)
    return len(block)


def take_block(mesh, token: str):
    """On a stream's thread: this rank's block of the ``from_dask`` call ``token`` (left by its ``assemble``
    task, which the controller saw finish before sending this), as a tensor owning that array's memory
    (``torch.from_numpy``). ``RuntimeError`` if it is not on this worker."""
    from ..worker import imports
    from ..worker.context import current_stream

    block = imports.take(current_stream().tw.session_id, token, mesh.me)
    if block is None:
        raise RuntimeError(f"from_dask: the block of rank {mesh.me} (call {token}) is not on this worker (its "
                           "assemble task ran elsewhere, or it was taken already)")
    return torch.from_numpy(block)


class PartitionHomes:
    """A ``workers`` annotation (``dask.annotate``; Dask calls it with each task's key, on the scheduler): the
    worker a partition's key is to be computed on (a list of one address), or ``[]`` (no restriction) for the
    graph's other keys."""

    def __init__(self, where: dict):
        self.where = where

    def __call__(self, key) -> list:
        return self.where.get(key, [])


def take_export(session_id: str, token: str, rank: int, timeout: float) -> np.ndarray:
    """The snapshot ``dask_monarch.worker.exports.export`` makes of rank ``rank``'s shard, waited for at most
    ``timeout`` seconds (``TimeoutError`` naming the rank). A task still waiting secedes from the worker's thread
    pool first (``distributed.secede``, as ``sync_batches`` does): it holds none of the worker's threads, so Dask
    work the snapshot waits behind (a later ``from_dask``'s reading on a worker of one thread) still runs."""
    from distributed import secede

    from ..worker import exports

    future = exports.slot(session_id, token, rank)
    try:
        if not future.done():
            secede()
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"to_dask: rank {rank} made no snapshot within {timeout} s (is the mesh still running? "
                           "the tensor's stream may be blocked)") from None
    finally:
        exports.take(session_id, token, rank)


def frame(chunk: np.ndarray, columns: list, start: int):
    """A shard (a numpy chunk from ``take_export``) as a pandas DataFrame with ``columns`` and the index
    ``start, start + 1, ...`` (run where Dask holds the chunk: it depends on that one chunk only)."""
    import pandas as pd

    values = chunk.reshape(len(chunk), -1)
    return pd.DataFrame(values, columns=columns, index=pd.RangeIndex(start, start + len(chunk)))


def feed_partition(session_id: str, token: str, index: int, part, columns, dtype, label, label_dtype) -> int:
    """Hand partition ``part`` to the pipe ``token`` of ``session_id`` on this worker as its ``index``-th: a
    tuple of tensors (features as ``dtype``, then the ``label`` column as ``label_dtype`` if given). A partition
    that does not convert is handed over as its error, for the ``recv`` that reaches it. Returns its rows."""
    from distributed import get_worker

    from ..worker import pipe
    from ..worker.plugin import PLUGIN_NAME

    plugin = get_worker().plugins.get(PLUGIN_NAME)
    if plugin is None or session_id not in plugin.sessions:
        return 0  # the session ended here: nothing to feed
    source = pipe.collection_source(session_id, token)
    try:
        array = to_numpy(part, columns, dtype)
        if columns is None:  # a chunk of a Dask array: a copy, never Dask's own memory
            array = np.array(array, copy=True, order="C")
        x = torch.from_numpy(array)
        if label is None:
            value = (x,)
        else:
            value = (x, torch.from_numpy(np.array(part[label].to_numpy(dtype=label_dtype), copy=True)))
    except Exception as e:
        source.put(index, error=f"partition {index} of this rank: {type(e).__name__}: {e}")
        return 0
    source.put(index, value)
    return len(x)
