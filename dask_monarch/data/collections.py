"""Dask collections into a mesh: ``from_dask`` (issue 15;
DESIGN.md "Decisions": ``from_dask`` / ``to_dask`` move Dask arrays and data frames in place, nothing through the
controller).

Into the mesh, the controller only plans: it persists the collection (the partitions Dask has yet to compute are
computed on the workers of the ranks that will read them: a strict ``dask.annotate(workers=...)`` per output
key), learns each partition's row count (an ``nrows`` task pinned to each holder) and holder, and submits one
``assemble`` task per rank pinned to that rank's worker (``workers=[address]``, ``allow_other_workers=False``),
whose inputs are the partitions (or the pieces of them a ``rows`` task cut on their holder): Dask itself moves
what is held elsewhere worker to worker, and a partition already on the rank's worker does not move. The block
is left on the worker (``worker/imports.py``, not Dask's data) for a ``CallFunction`` of ``take_block``, which
makes it a tensor in the mesh's order. ``start_from_dask`` is the first half of that, which waits for nothing (the
persist and the counts asked for); ``PendingBlocks.result()`` the rest (``iter_from_dask``, ``groups.py``, begins the
next groups while the program works on one). Out of the mesh: ``to_dask.py``.
"""

from __future__ import annotations

import threading
import uuid
import warnings

import numpy as np
import torch
from distributed import futures_of

from ..controller.mesh import DeviceMesh
from ..controller.remote import call_on_mesh, function_of
from ..controller.tensor import Tensor
from .tasks import TORCH_DTYPES, PartitionHomes, assemble, nrows, numpy_dtype_of, rows
from .waits import wait_futures

__all__ = ["from_dask", "start_from_dask", "PendingBlocks", "partitions_of", "mesh_dim"]

_TAKE_BLOCK = function_of("dask_monarch.data.tasks.take_block")


def mesh_dim(mesh: DeviceMesh, dim, what: str) -> str:
    """``dim``, checked against ``mesh``; None means the mesh's only dimension."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what}: mesh must be a dask_monarch DeviceMesh, got {type(mesh).__name__}")
    if dim is None:
        if len(mesh.names) != 1:
            raise ValueError(f"{what}: the mesh has dimensions {list(mesh.names)}; name one with dim=")
        return mesh.names[0]
    if dim not in mesh.names:
        raise KeyError(f"{what}: dim {dim!r} is not a dimension of the mesh; its dimensions are {list(mesh.names)}")
    return dim


def _is_array(collection) -> bool:
    import dask.array as da

    return isinstance(collection, da.Array)


def _is_dataframe(collection) -> bool:
    import dask.dataframe as dd

    return isinstance(collection, dd.DataFrame)


def frame_columns(frame, columns, what: str) -> list:
    """The columns to take from a Dask DataFrame: ``columns`` (each checked: present, numeric or bool) or, if
    None, every numeric or bool column in order. Raises ``KeyError``/``TypeError`` naming the column."""
    import pandas as pd

    dtypes = frame.dtypes
    if columns is None:
        chosen = [c for c in frame.columns if pd.api.types.is_numeric_dtype(dtypes[c])]
        if not chosen:
            raise TypeError(f"{what}: the DataFrame has no numeric columns ({dict(dtypes.astype(str))}); name some "
                            "with columns=")
        return chosen
    if isinstance(columns, str):
        columns = [columns]
    columns = list(columns)
    for c in columns:
        if c not in frame.columns:
            raise KeyError(f"{what}: column {c!r} is not in the DataFrame; its columns are {list(frame.columns)}")
        if not pd.api.types.is_numeric_dtype(dtypes[c]):
            raise TypeError(f"{what}: column {c!r} has dtype {dtypes[c]}, which has no torch dtype (numeric and "
                            "bool columns only)")
    return columns


def column_dtype(frame, columns, dtype, what: str) -> np.dtype:
    """The numpy dtype of the tensor made of ``columns``: ``dtype`` (a torch dtype) if given, else the columns'
    common numpy type (``numpy.result_type``; a nullable pandas dtype counts as its numpy dtype)."""
    if dtype is not None:
        return torch_to_numpy(dtype, what)
    kinds = [np.dtype(getattr(frame.dtypes[c], "numpy_dtype", frame.dtypes[c])) for c in columns]
    result = np.result_type(*kinds)
    if result not in TORCH_DTYPES:
        raise TypeError(f"{what}: columns {columns} have the common dtype {result}, which has no torch dtype")
    return result


def torch_to_numpy(dtype, what: str) -> np.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what}: dtype must be a torch.dtype, got {dtype!r}")
    try:
        return numpy_dtype_of(dtype)
    except TypeError as e:
        raise TypeError(f"{what}: {e}") from None


def partitions_of(collection, mesh: DeviceMesh, what: str, timeout: float, homes: list | None = None):
    """``(persisted, futures, row_counts, holders)``: the collection persisted on the cluster (a no-op for one
    already persisted), its partitions' futures in row order, their row counts (from the array's chunks, or an
    ``nrows`` task per holder, pinned there: only the counts reach the controller), and the workers
    holding each partition's key (``Client.who_has``'s answer, or the placement below).

    ``homes`` (the workers of the positions that will read the rows, in order) places the partitions Dask has yet
    to compute: partition j of P is computed on ``homes[(2j + 1) * S // (2P)]`` for S positions (the position
    holding its middle row when the partitions are of one size), a strict ``dask.annotate(workers=...)``
    restriction so that work stealing does not move it away: the rows are made where they are read instead of
    moving there. Raises the first partition's failure, and ``TimeoutError`` after ``timeout`` seconds."""
    return finish_partitions(start_partitions(collection, mesh, homes), mesh, what, timeout)


def start_partitions(collection, mesh: DeviceMesh, homes: list | None = None) -> tuple:
    """The first half of ``partitions_of``, which waits for nothing: the collection persisted (placed by
    ``homes``) and, where the holders are known already, the ``nrows`` tasks submitted. Returns what
    ``finish_partitions`` takes."""
    client = mesh.client
    persisted, holders = _persist(collection, client, homes)
    futures = sorted(futures_of(persisted), key=lambda f: f.key[1:])
    if _is_array(persisted) and not any(np.isnan(c) for c in persisted.chunks[0]):
        return persisted, futures, holders, [int(c) for c in persisted.chunks[0]], None
    counts = None if holders is None else _count_rows(client, futures, holders)
    return persisted, futures, holders, None, counts


def finish_partitions(started: tuple, mesh: DeviceMesh, what: str, timeout: float) -> tuple:
    """The second half of ``partitions_of``: waits (at most ``timeout`` seconds each) for the partitions of
    ``start_partitions`` and their row counts; returns ``(persisted, futures, row_counts, holders)``."""
    persisted, futures, holders, known, counts = started
    client = mesh.client
    if known is not None:
        _wait_all(mesh, futures, what, timeout)
        return persisted, futures, known, holders
    if counts is None:
        _wait_all(mesh, futures, what, timeout)
        holders = client.who_has(futures)
        counts = _count_rows(client, futures, holders)
    return persisted, futures, _gather_counts(mesh, counts, len(futures), what, timeout), holders


def _count_rows(client, futures: list, holders: dict) -> list:
    """``(task, indices, worker)`` triples: an ``nrows`` task per worker holding partitions, pinned there, counting
    the rows of those (``futures[i]`` for i in ``indices``; only the counts move)."""
    on = {}
    for i, f in enumerate(futures):
        on.setdefault(sorted(holders[f.key])[0], []).append(i)
    return [(client.submit(nrows, *(futures[i] for i in indices), workers=[worker], allow_other_workers=False,
                           pure=False, key=f"monarch-nrows-{uuid.uuid4().hex[:12]}"), indices, worker)
            for worker, indices in on.items()]


def _gather_counts(mesh: DeviceMesh, counts: list, n: int, what: str, timeout: float) -> list:
    """The row count of each of the ``n`` partitions, from ``_count_rows``'s tasks (waited for at most
    ``timeout`` seconds: a partition's failure fails its task with that error)."""
    tasks = [task for task, _, _ in counts]

    def names(pending):
        late = sorted(i for task, indices, _ in counts if task in pending for i in indices)
        where = sorted({worker for task, _, worker in counts if task in pending})
        return f"partitions {late} (of {n}) were not computed and counted (on {', '.join(where)})"

    wait_futures(mesh, tasks, timeout, what, names)
    found = [0] * n
    values = mesh.client.gather(tasks)  # all done: raises the first partition's own error
    for (_, indices, _), answer in zip(counts, values):
        for i, value in zip(indices, answer):
            found[i] = int(value)
    return found


def _wait_all(mesh: DeviceMesh, futures: list, what: str, timeout: float) -> None:
    """Wait for ``futures`` (partitions, or tasks of one each) for at most ``timeout`` seconds; raises the first
    one's failure, or ``TimeoutError`` saying how many were not done."""
    wait_futures(mesh, futures, timeout, what,
                 lambda pending: f"{len(pending)} of {len(futures)} partitions were not computed")
    for f in futures:
        if f.status == "error":
            f.result()  # raises the partition's own error


def _persist(collection, client, homes: list | None):
    """``(persisted, holders)``: ``collection`` persisted, with each output partition's task restricted to its
    position's worker when ``homes`` is given (``partitions_of``); ``holders`` maps each output key to that
    worker (a list of one), or is None when Dask placed them (no ``homes``, or output partitions already
    computed: a persisted collection stays where it is). A DataFrame is optimized first (``optimize()``: its
    partitions fused into the tasks whose keys are restricted, so the reading itself happens there)."""
    import dask
    from dask.core import flatten

    if not homes:
        return client.persist(collection), None
    if _is_dataframe(collection):
        collection = collection.optimize()
    keys = list(flatten(collection.__dask_keys__()))
    if {f.key for f in futures_of(collection)} & set(keys):
        return client.persist(collection), None
    size, n = len(homes), len(keys)
    where = {key: [homes[min(size - 1, (2 * j + 1) * size // (2 * n))]] for j, key in enumerate(keys)}
    with dask.annotate(workers=PartitionHomes(where), allow_other_workers=False), warnings.catch_warnings():
        # dask-expr warns that a DataFrame made under annotations ignores them (persist makes one of the futures);
        # the Client does send them with the graph (Client._graph_to_futures), and the scheduler applies them
        warnings.filterwarnings("ignore", message="Dask annotations .* detected", category=UserWarning)
        persisted = client.persist(collection)
    if {f.key for f in futures_of(persisted)} != set(keys):  # Dask renamed them: it placed them itself
        return persisted, None
    return persisted, where


def _ranks_along(mesh: DeviceMesh, dim: str) -> dict:
    """Global rank -> its coordinate along ``dim``."""
    axis = mesh.names.index(dim)
    return {r: mesh.processes.coordinates(r)[axis] for r in mesh._rank_list}


def position_homes(mesh: DeviceMesh, dim: str) -> list:
    """The worker of each position along ``dim``, in order: that of the position's first rank (where a
    partition of the position's rows is best computed; the position's other ranks, over the mesh's other
    dimensions, get a copy)."""
    homes = {}
    for rank, position in _ranks_along(mesh, dim).items():
        homes.setdefault(position, mesh.workers[rank])
    return [homes[p] for p in range(mesh.size(dim))]


def project(collection, columns):
    """A DataFrame not yet computed, narrowed to ``columns`` (so that a reader such as ``read_parquet`` reads only
    those); a persisted one (or one already of those columns) as it is, not copied."""
    if columns is None or list(collection.columns) == list(columns) or futures_of(collection):
        return collection
    return collection[list(columns)]


def from_dask(collection, mesh: DeviceMesh, dim: str | None = None, *, columns=None, dtype=None,
              drop_remainder: bool = False, pad=None, timeout: float = 300.0) -> Tensor:
    """A remote ``Tensor`` holding ``collection``'s rows, sharded along mesh dimension ``dim`` (issue 15).

    ``collection`` is a ``dask.array.Array`` (rows along axis 0; chunks along other axes are merged first) or a
    ``dask.dataframe.DataFrame`` (its numeric and bool columns, or ``columns``, as a 2-D ``rows x columns``
    tensor). With N rows and S ranks along ``dim``, the rank at position i of ``dim`` holds rows
    ``[i * N // S, (i + 1) * N // S)`` (replicated over the mesh's other dimensions): every rank's tensor has
    shape ``(N // S, *rest)``. N must divide by S (``ValueError`` naming both), unless ``drop_remainder=True``
    drops the last ``N % S`` rows, or ``pad=`` a number keeps them all: every rank then holds ``P = ceil(N / S)``
    rows, position i rows ``[i * P, min((i + 1) * P, N))`` and, after them, rows of ``pad`` (in every column) up to
    P (so a pad value the data never holds, e.g. a label of -1, tells the padding apart; ``ValueError`` if
    ``dtype`` cannot hold it). dtype: the array's, or the columns' common numpy dtype (``dtype=`` a torch
    dtype casts); one torch lacks (strings, datetimes, objects) raises ``TypeError`` naming the column.

    Nothing passes through the controller: partitions Dask already holds on a rank's worker are taken there; others
    move worker to worker (Dask's own transfers). The collection is persisted (computed on the cluster) first,
    a DataFrame narrowed to the columns taken; partitions not computed yet are computed on the worker of the
    position holding their middle row (the rows split as if the partitions were of one size), so they need not
    move. The tensor owns its memory (a copy of Dask's chunks, made on the rank's worker and handed to its
    stream outside Dask's data, ``worker/imports.py``). Raises the collection's own
    errors, and ``TimeoutError`` if Dask has not placed the rows within ``timeout`` seconds.
    """
    return start_from_dask(collection, mesh, dim, columns=columns, dtype=dtype, drop_remainder=drop_remainder,
                           pad=pad, timeout=timeout).result()


def start_from_dask(collection, mesh: DeviceMesh, dim: str | None = None, *, columns=None, dtype=None,
                    drop_remainder: bool = False, pad=None, timeout: float = 300.0,
                    what: str = "from_dask", early: bool = False) -> "PendingBlocks":
    """``from_dask`` begun and not waited for: the arguments checked (the same errors), the collection persisted
    where its rows will be read and its row counts asked for. ``.result()`` of the returned ``PendingBlocks``
    waits for them and returns ``from_dask``'s tensor (``dask_monarch.iter_from_dask`` reads ahead with this;
    ``early``: the blocks are assembled as soon as the counts are in, see ``PendingBlocks``)."""
    dim = mesh_dim(mesh, dim, what)
    if pad is not None and drop_remainder:
        raise TypeError(f"{what}: pass drop_remainder=True or pad=, not both")
    if _is_array(collection):
        if columns is not None:
            raise TypeError(f"{what}: columns= is for DataFrames; got a dask array")
        if collection.ndim == 0:
            raise ValueError(f"{what}: a 0-d array has no rows")
        if any(len(c) > 1 for c in collection.chunks[1:]):
            collection = collection.rechunk({axis: -1 for axis in range(1, collection.ndim)})
        np_dtype = torch_to_numpy(dtype, what) if dtype is not None else np.dtype(collection.dtype)
        if np_dtype not in TORCH_DTYPES:
            raise TypeError(f"{what}: the array's dtype {np_dtype} has no torch dtype")
        rest = tuple(int(s) for s in collection.shape[1:])
        columns_sent = None
    elif _is_dataframe(collection):
        columns_sent = frame_columns(collection, columns, what)
        np_dtype = column_dtype(collection, columns_sent, dtype, what)
        rest = (len(columns_sent),)
    else:
        raise TypeError(f"{what}: expected a dask.array.Array or a dask.dataframe.DataFrame, got "
                        f"{type(collection).__module__}.{type(collection).__name__}")
    if pad is not None:
        _check_pad(pad, np_dtype, what)
    collection = project(collection, columns_sent)
    started = start_partitions(collection, mesh, homes=position_homes(mesh, dim))
    return PendingBlocks(mesh, dim, started, np_dtype, rest, columns_sent, pad, drop_remainder, timeout, what,
                         early)


class PendingBlocks:
    """A ``from_dask`` call under way (``start_from_dask``): its partitions persisted and counted on the cluster.
    With ``early`` (``iter_from_dask``'s groups read ahead), a thread of its own (``monarch-<what>-plan``) waits for
    the counts (at most ``timeout`` seconds) and then submits each rank's ``assemble`` (pinned to the rank's worker, ahead of other queued work there: Dask
    ``priority=1``) without waiting for the program; ``result()`` (once) does what is left of that, waits for the
    blocks and returns the tensor. ``cancel()`` gives the call up (nothing more is submitted)."""

    def __init__(self, mesh, dim, started, np_dtype, rest, columns_sent, pad, drop_remainder, timeout, what,
                 early: bool = False):
        self.mesh, self.dim, self.started, self.what = mesh, dim, started, what
        self.np_dtype, self.rest, self.columns_sent = np_dtype, rest, columns_sent
        self.pad, self.drop_remainder, self.timeout = pad, drop_remainder, timeout
        self._lock = threading.Lock()
        self._planned = None  # (token, shape, the assemble futures by rank), once submitted
        if early and started[4]:  # the counts are asked for: plan as soon as they are in
            tasks = [task for task, _, _ in started[4]]
            threading.Thread(target=self._plan_when_counted, args=(tasks,), daemon=True,
                             name=f"monarch-{what}-plan").start()

    def _plan_when_counted(self, tasks: list) -> None:
        """Wait for the count ``tasks``, then submit the assembly, unless a count failed, the call was given up or
        ``result()`` got there first (it then plans itself and raises what is wrong). Never raises."""
        try:
            wait_futures(self.mesh, tasks, self.timeout, self.what, lambda pending: "row counts")
            if all(task.status == "finished" for task in tasks):
                with self._lock:
                    if self._planned is None and self.started is not None:
                        self._planned = self._plan()
        except Exception:
            pass

    def cancel(self) -> None:
        """Give the call up: nothing more is submitted; its partitions go with the last reference to this."""
        with self._lock:
            self.started = None

    def _plan(self) -> tuple:
        """``(token, shape, assemble futures by rank)``: the counts waited for, the rows laid out, the assembly
        submitted. Raises ``from_dask``'s errors."""
        mesh, dim, what, client = self.mesh, self.dim, self.what, self.mesh.client
        _, futures, counts, holders = finish_partitions(self.started, mesh, what, self.timeout)
        total = sum(counts)
        size = mesh.size(dim)
        if total % size and not self.drop_remainder and self.pad is None:
            raise ValueError(
                f"{what}: {total} rows do not split evenly over the {size} ranks of dimension {dim!r}; pass "
                f"drop_remainder=True to drop the last {total % size} rows, pad= a value to pad the last ranks' "
                f"blocks, or give the collection a multiple of {size}"
            )
        per_rank = -(-total // size) if self.pad is not None else total // size
        if per_rank == 0:
            raise ValueError(f"{what}: {total} rows are fewer than the {size} ranks of dimension {dim!r}")
        if holders is None:
            holders = client.who_has(futures)
        token = uuid.uuid4().hex[:12]
        pieces_of = _pieces(client, futures, counts, holders, size, per_rank, token)
        shape = (per_rank, *self.rest)
        session = mesh._session
        blocks = {
            rank: client.submit(assemble, session.id, token, rank, pieces_of[position], self.columns_sent,
                                self.np_dtype, shape, self.pad, workers=[mesh.workers[rank]],
                                allow_other_workers=False, pure=False, priority=1,
                                key=f"monarch-from_dask-{token}-{rank}")
            for rank, position in _ranks_along(mesh, dim).items()
        }
        return token, shape, blocks

    def result(self) -> Tensor:
        """The tensor ``from_dask`` returns; raises its errors (``ValueError`` for rows that do not split,
        the collection's own errors, ``TimeoutError``)."""
        with self._lock:
            if self.started is None:
                raise RuntimeError(f"{self.what}: result() was called already")
            try:
                planned = self._planned or self._plan()
            finally:
                self.started = None
        token, shape, blocks = planned
        mesh, what = self.mesh, self.what

        def names(pending):
            late = ", ".join(f"rank {r} ({mesh.workers[r]})" for r, f in blocks.items() if f in pending)
            return f"the blocks of {late} were not assembled on their workers"

        wait_futures(mesh, list(blocks.values()), self.timeout, what, names)
        for rank, f in blocks.items():
            if f.status == "error":
                f.result()
        torch_dtype = TORCH_DTYPES[self.np_dtype]

        def shapes(mesh, token):
            return torch.empty(shape, dtype=torch_dtype)

        # each block waits on its worker (worker/imports.py, not Dask's data) for this call, which takes it
        return call_on_mesh(_TAKE_BLOCK, "from_dask", shapes, (mesh, token), {}, mesh=mesh)


def _pieces(client, futures, counts, holders, size: int, per_rank: int, token: str) -> dict:
    """Position -> the pieces of its rows ``[i * per_rank, (i + 1) * per_rank)``: futures of whole partitions, or
    of ``rows`` tasks cutting a partition on its holder (only that piece moves)."""
    total = sum(counts)
    starts = np.concatenate([[0], np.cumsum(counts)])
    pieces_of = {}
    for position in range(size):
        lo, hi = position * per_rank, min((position + 1) * per_rank, total)
        pieces = []
        for j, future in enumerate(futures):
            a, b = max(lo, starts[j]), min(hi, starts[j + 1])
            if a >= b:
                continue
            a, b = int(a - starts[j]), int(b - starts[j])
            if (a, b) == (0, counts[j]):
                pieces.append(future)
            else:
                where = list(holders.get(future.key, ())) or None
                pieces.append(client.submit(rows, future, a, b, workers=where, allow_other_workers=True, pure=False,
                                            key=f"monarch-from_dask-rows-{token}-{position}-{j}"))
        pieces_of[position] = pieces
    return pieces_of


def _check_pad(pad, np_dtype: np.dtype, what: str) -> None:
    """``pad`` must be a number (or bool) that ``np_dtype`` holds exactly (NaN for a float dtype)."""
    if not isinstance(pad, (bool, int, float, complex, np.number, np.bool_)):
        raise TypeError(f"{what}: pad must be a number, got {pad!r}")
    try:
        with np.errstate(all="ignore"):
            held = np.array(pad).astype(np_dtype)
    except (TypeError, ValueError, OverflowError):
        held = None
    same = held is not None and (held == pad or (pad != pad and held != held))
    if not same:
        raise ValueError(f"{what}: pad={pad!r} is not a value of the tensor's dtype {np_dtype}")
