"""``create_pipe``: a data feed into a mesh, read one batch per ``recv`` (``PipeRecv``; seed ``worker.rs``;
DESIGN.md "Decisions": pipes return as a data feed from Dask).

The pipe is an object in a stream's ref table on every rank (``worker/pipe.py``), made by one ``CallFunction``;
each ``recv`` is one ``PipeRecv`` whose results are the batch's tensors and a 0-d bool flag. The workers load
ahead while the mesh computes: a generator source runs on a thread of its own per rank with a queue of
``prefetch`` batches; a collection source is fed by Dask tasks pinned to the rank's worker, which the controller
keeps ``prefetch`` batches ahead of the ``recv`` calls (Dask moves and converts the partitions meanwhile). No
batch passes through the controller.
"""

from __future__ import annotations

import uuid

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..controller.fetch import fetch_shard
from ..controller.local import propagating
from ..controller.mesh import DeviceMesh, no_mesh
from ..controller.remote import function_of, pack_leaves
from ..controller.stream import get_active_stream
from ..controller.tensor import Tensor
from ..protocol import ArgsKwargs, CallFunction, FunctionPath, PipeRecv
from .collections import _is_array, _is_dataframe, _ranks_along, column_dtype, frame_columns, mesh_dim
from .collections import partitions_of, position_homes, project, torch_to_numpy
from .tasks import TORCH_DTYPES, feed_partition

__all__ = ["Pipe", "create_pipe"]

_OPEN_GENERATOR = FunctionPath("dask_monarch.worker.pipe.open_generator")
_OPEN_COLLECTION = FunctionPath("dask_monarch.worker.pipe.open_collection")
_CLOSE = FunctionPath("dask_monarch.worker.pipe.close_source")

#: feed tasks not finished yet: held here, not by the pipe, because recvs already sent need them even when the
#: pipe is closed or garbage-collected meanwhile (the controller runs ahead of the workers)
_inflight: set = set()


def _hold(future) -> None:
    _inflight.add(future)
    future.add_done_callback(_inflight.discard)


class Pipe:
    """A data feed on a mesh (``create_pipe``). ``recv()`` returns the next batch as remote tensors (a pytree of
    them, as the source yields). ``len(pipe)`` and iteration (ending with ``StopIteration``) for a source of
    known length (a Dask collection, or ``length=``); ``exhausted()`` for one of unknown length. ``close()``
    (or the session's end) stops the feed on the workers."""

    def __init__(self, mesh: DeviceMesh, specs: list, spec, length, stream, name: str):
        self.mesh = mesh
        self.length = length
        self.received = 0
        self._specs = specs  # (shape, dtype) of each leaf of a batch
        self._spec = spec
        self._stream = stream
        self._name = name
        self._flag = None
        self._ref = None
        self._feeder = None
        self.closed = False

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError(f"pipe {self._name} has no known length (a generator source without length=); "
                            "use pipe.exhausted()")
        return self.length

    def __iter__(self):
        while True:
            try:
                yield self.recv()
            except StopIteration:
                return

    def recv(self):
        """The next batch: one ``PipeRecv`` on every rank of the mesh, on the stream the pipe was made on. Returns
        the batch with every tensor a remote ``Tensor`` of the shapes the pipe was made with (on the CPU, or on
        ``device``). Raises ``StopIteration`` once ``len(pipe)`` batches were received (a collection source, or
        ``length=``); ``RuntimeError`` after ``close()``. A source that raised fails this batch on the ranks
        where it did: fetching it raises ``RemoteException`` with the source's traceback. Past the end of a
        source of unknown length the batch holds an error saying so and ``exhausted()`` is True."""
        if self.closed:
            raise RuntimeError(f"pipe {self._name} is closed")
        if self.length is not None and self.received >= self.length:
            raise StopIteration(f"pipe {self._name} has given all its {self.length} batches")
        if self._feeder is not None:
            self._feeder.top_up(self.received + 1)
        mesh = self.mesh
        session = mesh._session
        with session.lock:
            session.check_ok()
            stream_ref = self._stream.ref_for(session)
            with propagating(), no_mesh.activate(), session.fake_mode:
                fakes = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in self._specs]
                flag_fake = torch.empty((), dtype=torch.bool)
            tensors = [Tensor(session.new_ref(), f, mesh, self._stream) for f in fakes]
            flag = Tensor(session.new_ref(), flag_fake, mesh, self._stream)
            seq = session.new_seq()
            session.record(seq, defs=tensors + [flag], uses=[], what=f"pipe {self._name}.recv")
            session.send(PipeRecv(seq, [t.ref for t in tensors] + [flag.ref], self._ref, stream_ref), mesh._rank_list)
        self.received += 1
        self._flag = flag
        return tree_unflatten(tensors, self._spec)

    def exhausted(self, **coords) -> bool:
        """Whether the last ``recv`` found the source ended, on the rank of ``coords`` (default the mesh's first):
        a fetch of that recv's flag (it waits for the recv to run there). False before the first ``recv``."""
        if self._flag is None:
            return False
        return not bool(fetch_shard(self._flag, **coords).result())

    def close(self) -> None:
        """Stop the feed: the pipe object is deleted on every rank (a generator's thread ends; queued batches and
        fed partitions are let go), and pending feed tasks are released. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._feeder is not None:
            self._feeder.release(self.received)
        session = self.mesh._session
        if self._ref is not None and not session.closed and session.failure is None:
            with session.lock:  # after the recvs sent so far, the workers let go of what the pipe holds
                stream_ref = self._stream.ref_for(session)
                seq = session.new_seq()
                session.record(seq, defs=[], uses=[], what=f"pipe {self._name}.close")
                session.send(CallFunction(seq, [None], (), _CLOSE, ArgsKwargs((self._ref,), {}), stream_ref, ()),
                             self.mesh._rank_list)
            session.drop_ref(self._ref.id, self.mesh._rank_list)

    def __repr__(self) -> str:
        return f"Pipe({self._name}; {self.received} of {self.length if self.length is not None else '?'} batches)"

    def _open(self, function, args: tuple) -> None:
        mesh = self.mesh
        session = mesh._session
        leaves, spec = tree_flatten(args)
        packed = pack_leaves(leaves, "create_pipe")
        if packed is not None:
            args = tree_unflatten(packed, spec)
        for leaf in leaves:
            if isinstance(leaf, DeviceMesh):
                leaf.define_remotely()
        with session.lock:
            session.check_ok()
            stream_ref = self._stream.ref_for(session)
            self._ref = session.new_ref()
            seq = session.new_seq()
            session.record(seq, defs=[], uses=[], what=f"create_pipe {self._name}")
            session.send(CallFunction(seq, [self._ref], (), function, ArgsKwargs(tuple(args), {}), stream_ref, ()),
                         mesh._rank_list)


class _Feeder:
    """Keeps each rank's feed tasks ``prefetch`` batches ahead of the ``recv`` calls: partition j of rank r's
    list goes to its worker as a ``feed_partition`` task pinned there (Dask moves the partition if needed)."""

    def __init__(self, mesh, futures, counts, assignment, batch_size, prefetch, token, convert):
        self.mesh = mesh
        self.futures = futures
        self.counts = counts
        self.assignment = assignment  # global rank -> the partition indices it reads, in order
        self.batch_size = batch_size
        self.prefetch = prefetch
        self.token = token
        self.convert = convert  # (columns, dtype, label, label dtype)
        self.fed = {r: 0 for r in assignment}  # partitions fed so far, per rank
        self.rows = {r: 0 for r in assignment}
        self.tasks: dict = {}  # (rank, index) -> the feed task's future

    def top_up(self, upcoming: int) -> None:
        """Feed every rank enough partitions for ``upcoming + prefetch`` batches (or all it has)."""
        client = self.mesh.client
        session = self.mesh._session
        workers = self.mesh.workers
        goal = upcoming + self.prefetch
        for rank, parts in self.assignment.items():
            while self.fed[rank] < len(parts):
                have = self.fed[rank] if self.batch_size is None else self.rows[rank] // self.batch_size
                if have >= goal:
                    break
                index = self.fed[rank]
                j = parts[index]
                future = client.submit(
                    feed_partition, session.id, self.token, index, self.futures[j], *self.convert,
                    workers=[workers[rank]], allow_other_workers=False, pure=False, priority=-index,
                    key=f"monarch-pipe-{self.token}-{rank}-{index}",
                )
                _hold(future)
                self.tasks[rank, index] = future
                self.fed[rank] += 1
                self.rows[rank] += self.counts[j]

    def needed(self, rank: int, received: int) -> int:
        """How many of ``rank``'s partitions the first ``received`` batches use."""
        if self.batch_size is None:
            return received
        rows, want = 0, received * self.batch_size
        for k, j in enumerate(self.assignment[rank]):
            if rows >= want:
                return k
            rows += self.counts[j]
        return len(self.assignment[rank])

    def release(self, received: int) -> None:
        """The pipe is closed after ``received`` batches: cancel the feeds no sent recv needs (the others finish,
        held by ``_inflight``)."""
        for (rank, index), future in self.tasks.items():
            if index >= self.needed(rank, received):
                _inflight.discard(future)
                future.release()
        self.tasks = {}
        self.futures = []


def create_pipe(source, mesh: DeviceMesh, *args, dim: str | None = None, batch_size: int | None = None,
                columns=None, label: str | None = None, dtype=None, propagate=None, length: int | None = None,
                prefetch: int = 2, timeout: float = 300.0, device=None, **kwargs) -> Pipe:
    """A pipe feeding ``mesh`` (``pipe.recv()`` under ``mesh.activate()``, or anywhere), on the active stream.

    **A Dask collection** (``dask.array.Array`` chunked along axis 0, or ``dask.dataframe.DataFrame``): the
    collection is persisted (a DataFrame narrowed to the columns read; partitions not computed yet are computed on
    the worker of the position that reads them, as ``from_dask`` places them); the ranks at position i of ``dim`` (S ranks along it; every rank at a position reads
    the same partitions) read a contiguous run of partitions in order: those whose middle row lies in rows
    ``[i * N / S, (i + 1) * N / S)`` of the N rows. With ``batch_size=``, a collection of fewer than S partitions
    is first cut into S (``repartition(npartitions=S)``; an array: rechunked along axis 0), so that every
    position gets rows even from a collection of one partition. Each batch is
    ``batch_size`` rows, cut across partitions (without ``batch_size``: one batch per partition, which must then
    all have the same row count, else ``ValueError``). A batch is a tensor of the array's rows, or of the
    DataFrame's ``columns`` (default: its numeric columns except ``label``) as a ``(rows, columns)`` tensor of
    ``dtype`` (default their common dtype); with ``label=`` a column name, a batch is ``(x, y)``, ``y`` that
    column as a 1-D tensor. ``len(pipe)`` is the smallest number of full batches over the positions; rows past
    it are not delivered; ``recv`` past it raises ``StopIteration``; a position without one full batch raises
    ``ValueError`` naming it and its rows.

    **A generator function** ``source(*args, **kwargs)`` (an iterable of tensors or pytrees of them) runs on a
    thread of its own on every rank (a ``DeviceMesh`` argument arrives as the worker's mesh:
    ``mesh.dims["dp"].rank``). The controller learns a batch's shapes from ``propagate(*args, **kwargs)`` (the
    controller's mesh; a batch of tensors of the right shapes and dtypes, e.g. ``torch.empty``), or else from the
    first batch of ``source`` run on the controller with the mesh as its first rank sees it. Every batch must
    have those shapes (else that ``recv`` fails). ``length=`` makes ``recv`` raise ``StopIteration`` after that
    many; otherwise ``pipe.exhausted()`` tells the end.

    ``prefetch`` batches per rank load ahead while the mesh computes; ``timeout`` bounds each ``recv``'s wait on
    the worker (the ``recv`` fails, naming what it waited for); ``device`` (e.g. ``"cuda"``) puts a collection's
    batches there. Raises ``TypeError``/``KeyError``/``ValueError`` for bad arguments (naming them).
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"create_pipe: mesh must be a dask_monarch DeviceMesh, got {type(mesh).__name__}")
    if not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"create_pipe: prefetch must be an int >= 1, got {prefetch!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"create_pipe: batch_size must be an int >= 1, got {batch_size!r}")
    stream = get_active_stream()
    token = uuid.uuid4().hex[:12]
    if _is_array(source) or _is_dataframe(source):
        if args or kwargs or propagate is not None or length is not None:
            raise TypeError("create_pipe: args, propagate= and length= are for generator sources, not collections")
        return _collection_pipe(source, mesh, dim, batch_size, columns, label, dtype, prefetch, timeout, device,
                                stream, token)
    if not callable(source):
        raise TypeError(f"create_pipe: source must be a Dask collection or a generator function, got "
                        f"{type(source).__name__}")
    for name, value in (("batch_size", batch_size), ("columns", columns), ("label", label), ("dtype", dtype),
                        ("dim", dim), ("device", device)):
        if value is not None:
            raise TypeError(f"create_pipe: {name}= is for collection sources; a generator yields its own batches")
    if length is not None and (not isinstance(length, int) or length < 0):
        raise ValueError(f"create_pipe: length must be an int >= 0, got {length!r}")
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, Tensor):
            raise TypeError("create_pipe: a generator source runs beside the streams and cannot take remote tensors")
    example = _first_batch(source, propagate, args, kwargs)
    leaves, spec = tree_flatten(example)
    if not leaves or not all(isinstance(x, torch.Tensor) for x in leaves):
        raise TypeError(f"create_pipe: a batch must be a tensor or a pytree of tensors, got {type(example).__name__}")
    specs = [(tuple(x.shape), x.dtype, torch.device("cpu") if x.device.type == "meta" else x.device) for x in leaves]
    name = getattr(source, "__name__", "source")
    pipe = Pipe(mesh, specs, spec, length, stream, f"{name}-{token[:6]}")
    expect = [(shape, dt) for shape, dt, _ in specs]
    pipe._open(_OPEN_GENERATOR, (token, function_of(source), args, kwargs, prefetch, expect, float(timeout)))
    return pipe


def _first_batch(source, propagate, args, kwargs):
    """A batch of the source's shapes, computed on the controller (``propagate``, or the source's first item)."""
    def seen(x):
        return x.seen_from() if isinstance(x, DeviceMesh) else x

    with propagating(), no_mesh.activate():
        if propagate is not None:
            return propagate(*args, **kwargs)
        local_args = [seen(a) for a in args]
        local_kwargs = {k: seen(v) for k, v in kwargs.items()}
        try:
            return next(iter(source(*local_args, **local_kwargs)))
        except StopIteration:
            raise ValueError("create_pipe: the source gave no batch on the controller (pass propagate=)") from None


def assign(counts: list, size: int) -> dict:
    """Position -> the partitions it reads: contiguous runs in row order, partition j going to the position whose
    share of the rows (``N / size`` each) holds the middle row of j, so that the positions get about as many
    rows each (every position at least one partition when there are enough)."""
    total = sum(counts) or 1
    out = {p: [] for p in range(size)}
    start = 0
    for j, count in enumerate(counts):
        middle = start + count / 2
        out[min(size - 1, int(middle * size / total))].append(j)
        start += count
    return out


def _split_for(source, size: int):
    """``source`` cut into ``size`` partitions when it has fewer (``batch_size=`` only: batches are cut across
    partitions anyway), so that every position of a dimension of ``size`` ranks gets rows: a DataFrame by
    ``repartition(npartitions=size)``, an array of known length by rechunking axis 0. Others are left as they are."""
    if source.npartitions >= size:
        return source
    if _is_dataframe(source):
        return source.repartition(npartitions=size)
    n = source.shape[0]
    if isinstance(n, (int, np.integer)) and n >= size:
        return source.rechunk({0: -(-int(n) // size)})
    return source


def _collection_pipe(source, mesh, dim, batch_size, columns, label, dtype, prefetch, timeout, device, stream, token):
    what = "create_pipe"
    dim = mesh_dim(mesh, dim, what)
    label_dtype = None
    if _is_array(source):
        if columns is not None or label is not None:
            raise TypeError(f"{what}: columns= and label= are for DataFrames; got a dask array")
        if any(len(c) > 1 for c in source.chunks[1:]):
            source = source.rechunk({axis: -1 for axis in range(1, source.ndim)})
        np_dtype = torch_to_numpy(dtype, what) if dtype is not None else np.dtype(source.dtype)
        if np_dtype not in TORCH_DTYPES:
            raise TypeError(f"{what}: the array's dtype {np_dtype} has no torch dtype")
        rest = tuple(int(s) for s in source.shape[1:])
        columns_sent = None
    else:
        if label is not None:
            if label not in source.columns:
                raise KeyError(f"{what}: label column {label!r} is not in the DataFrame; its columns are "
                               f"{list(source.columns)}")
            frame_columns(source, [label], what)
            label_dtype = column_dtype(source, [label], None, what)
        columns_sent = frame_columns(source, columns, what)
        if columns is None and label is not None:
            columns_sent = [c for c in columns_sent if c != label]
        np_dtype = column_dtype(source, columns_sent, dtype, what)
        rest = (len(columns_sent),)
    if columns_sent is not None:
        source = project(source, columns_sent + ([label] if label is not None and label not in columns_sent else []))
    size = mesh.size(dim)
    if batch_size is not None:
        source = _split_for(source, size)
    _, futures, counts, _ = partitions_of(source, mesh, what, timeout, homes=position_homes(mesh, dim))
    positions = _ranks_along(mesh, dim)
    by_position = assign(counts, size)
    if batch_size is None:
        used = [counts[j] for p in range(size) for j in by_position[p]]
        if len(set(used)) > 1:
            raise ValueError(f"{what}: without batch_size= every partition is a batch and must have the same rows; "
                             f"the partitions have {sorted(set(used))} rows: pass batch_size=")
        length = min(len(by_position[p]) for p in range(size))
        rows = used[0] if used else 0
    else:
        length = min(sum(counts[j] for j in by_position[p]) // batch_size for p in range(size))
        rows = batch_size
    if length == 0:  # a pipe without a batch: recv() would end at once, which reads like a bug in the loop
        fewest = min(range(size), key=lambda p: sum(counts[j] for j in by_position[p]))
        have = sum(counts[j] for j in by_position[fewest])
        raise ValueError(
            f"{what}: position {fewest} of dimension {dim!r} gets {have} rows in {len(by_position[fewest])} "
            f"partition(s), " + (f"fewer than batch_size={batch_size}" if batch_size is not None else "no batch")
            + ": the pipe would have no batch (pass a smaller batch_size, or repartition the collection)"
        )
    device = None if device is None else torch.device(device)
    specs = [((rows, *rest), TORCH_DTYPES[np_dtype], device or torch.device("cpu"))]
    if label is not None:
        specs.append(((rows,), TORCH_DTYPES[label_dtype], device or torch.device("cpu")))
    spec = tree_flatten(tuple(range(len(specs))) if label is not None else 0)[1]
    pipe = Pipe(mesh, specs, spec, length, stream, f"collection-{token[:6]}")
    expect = [(shape, dt) for shape, dt, _ in specs]
    pipe._open(_OPEN_COLLECTION, (token, batch_size, expect, float(timeout), None if device is None else str(device)))
    assignment = {rank: by_position[p] for rank, p in positions.items()}
    pipe._feeder = _Feeder(mesh, futures, counts, assignment, batch_size, prefetch, token,
                           (columns_sent, np_dtype, label, label_dtype))
    pipe._feeder.top_up(0)
    return pipe
