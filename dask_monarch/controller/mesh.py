"""``DeviceMesh``: the controller's view of a mesh of Dask workers (spec §1 "DeviceMesh", §6).

A mesh has named dimensions over a ``Slice`` of the session's global ranks. The mesh returned by
``dask_monarch.attach`` owns the session: ``exit()`` (or leaving its ``with`` block) ends it. ``slice`` gives
sub-meshes that share the session (and, as in Monarch, its ``exit``; ``mesh(host=0)`` is Monarch's deprecated
spelling of ``mesh.slice(host=0)``).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings

import torch

from ..protocol import CreateDeviceMesh, Ref, Slice
from .table import Table, grid

__all__ = ["DeviceMesh", "Frontend", "frontend", "get_active_mesh", "no_mesh", "select", "spawn_tensor_engine"]


class Frontend:
    """The operations of the frontend modules above this one and ``tensor.py`` that ``DeviceMesh`` and ``Tensor``
    call. Each module fills in its own when imported (``controller/__init__`` imports them all), so that imports
    run one way: frontend -> mesh -> session -> protocol (DESIGN.md "Layout")."""

    #: ``dispatch.MeshDispatchMode``, entered by ``DeviceMesh.activate``
    dispatch_mode = None
    #: ``dispatch.run_op(func, args, kwargs)``: every torch op on a remote tensor (``Tensor.__torch_dispatch__``)
    run_op = None
    #: ``dispatch.operator_call(op, tensor, other)``: ``Tensor``'s ``+``, ``-``, ``*``, ``/`` without torch's dispatcher
    operator_call = None
    #: ``dispatch.assign_data(tensor, value)``: ``tensor.data = value``
    assign_data = None
    #: ``reduce.reduce_one``: ``Tensor.reduce`` and ``Tensor.reduce_``
    reduce_one = None
    #: ``remote.remote``: ``DeviceMesh.rank``
    remote = None
    #: ``actors.spawn``: ``DeviceMesh.spawn``
    spawn = None
    #: ``to_mesh.send(tensor, slicing, mesh, stream)``: ``Tensor.to_mesh``
    to_mesh = None
    #: ``to_mesh.MeshSliceTensor(tensor, sub_mesh)``: ``Tensor.slice_mesh``
    slice_mesh = None
    #: ``fetch.fetch_call(fn, args, kwargs, shard, every)``: ``Remote.call``, ``.call_one``, ``.call_on_shard_and_fetch``
    fetch_call = None
    #: ``cached_propagation.learn_outputs``: ``remote`` learns a call's outputs on the mesh's first rank
    learn_outputs = None


#: the frontend's operations (``Frontend``)
frontend = Frontend()

_active: contextvars.ContextVar = contextvars.ContextVar("dask_monarch_active_mesh", default=None)


def spawn_tensor_engine(mesh: "DeviceMesh") -> "DeviceMesh":
    """Monarch's ``monarch.mesh_controller.spawn_tensor_engine(proc_mesh)``: the tensor engine of a process mesh.
    A dask_monarch mesh (``dm.attach``) already is one, so this returns ``mesh`` itself; ``TypeError`` for
    anything but a ``DeviceMesh``."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"spawn_tensor_engine: expected a dask_monarch DeviceMesh (made by dm.attach), got "
                        f"{type(mesh).__name__}")
    return mesh


def get_active_mesh() -> "DeviceMesh | None":
    """The mesh set by the innermost ``mesh.activate()``, or None."""
    return _active.get()


class _NoMesh:
    """``no_mesh.activate()`` clears the active mesh inside its block (spec §1)."""

    @contextlib.contextmanager
    def activate(self):
        token = _active.set(None)
        try:
            yield
        finally:
            _active.reset(token)


no_mesh = _NoMesh()


def select(names, ranks: Slice, selection: dict, what: str) -> tuple:
    """``(names, Slice)`` of the part of ``ranks`` (dims ``names``) that ``selection`` picks: ``dim=int`` removes the
    dim at that coordinate, ``dim=slice(...)`` keeps a range (step 1 or more); ``what`` names the thing sliced in
    errors. Raises ``KeyError`` for an unknown dim, ``IndexError`` for an out-of-range coordinate, ``TypeError``
    for another kind of selection."""
    selection = dict(selection)
    offset = ranks.offset
    kept, sizes, strides = [], [], []
    for name, size, stride in zip(names, ranks.sizes, ranks.strides):
        if name not in selection:
            kept.append(name)
            sizes.append(size)
            strides.append(stride)
            continue
        sel = selection.pop(name)
        if isinstance(sel, int):
            if not -size <= sel < size:
                raise IndexError(f"{what} dimension {name!r} has size {size}, index {sel} is out of range")
            offset += (sel % size) * stride
        elif isinstance(sel, slice):
            start, stop, step = sel.indices(size)
            count = len(range(start, stop, step))
            if count == 0:
                raise IndexError(f"empty selection {sel} of {what} dimension {name!r}")
            offset += start * stride
            kept.append(name)
            sizes.append(count)
            strides.append(stride * step)
        else:
            raise TypeError(f"{what} selection for {name!r} must be an int or a slice, got {type(sel).__name__}")
    if selection:
        raise KeyError(f"{sorted(selection)} not dimensions of this {what}; its dimensions are {list(names)}")
    return kept, Slice(offset, sizes, strides)


class DeviceMesh:
    """Mesh ``names`` over global ranks ``ranks`` (a ``Slice``) of ``session``.

    ``names`` are the dimension names in order; ``sizes`` maps each to its size; ``processes`` is the ``Slice``
    of global ranks. Use as a context manager, or call ``exit()`` when done.
    """

    def __init__(self, session, names, ranks: Slice, *, owner: bool = False):
        if len(names) != len(ranks.sizes):
            raise ValueError(f"DeviceMesh: {len(names)} names {list(names)} for {len(ranks.sizes)} dims")
        if len(set(names)) != len(names):
            raise ValueError(f"DeviceMesh: Duplicate dimension names in {list(names)}: each dimension needs its own")
        self._session = session
        self.names = tuple(names)
        self.processes = ranks
        self._rank_list = tuple(ranks)
        self._owner = owner
        #: the mesh ``attach`` returned, whose ``exit`` a mesh made from it (slice, split, ...) calls, as Monarch's do
        self._root = self if owner else None
        self._ref: Ref | None = None

    # ------------------------------------------------------------------------------------------------ shape
    @property
    def sizes(self) -> dict:
        return dict(zip(self.names, self.processes.sizes))

    def size(self, dims=None) -> int:
        """Number of ranks along ``dims`` (a name or a sequence of names; all dims if None)."""
        if dims is None:
            return len(self._rank_list)
        if isinstance(dims, str):
            dims = (dims,)
        sizes = self.sizes
        for d in dims:
            if d not in sizes:
                raise KeyError(f"{d!r} is not a dimension of this mesh; its dimensions are {list(self.names)}")
        return math.prod(sizes[d] for d in dims)

    @property
    def session_id(self) -> str:
        return self._session.id

    @property
    def client(self):
        """The ``distributed.Client`` of this mesh's session (the embedded cluster's, or the one given to
        ``attach``), for ordinary Dask work beside the mesh."""
        return self._session.client

    @property
    def dashboard_link(self) -> str | None:
        """The URL of this session's view of the ``/monarch`` page on the scheduler's dashboard,
        ``.../monarch?session=<tag>`` (Dask's ``client.dashboard_link``, whose page is ``/status``, with the last path
        part replaced; the tag names the session everywhere: repr, logs, task keys, ``protocol/session_id.py``), or
        None if the scheduler has no dashboard. ``/monarch`` alone shows every session of the cluster."""
        try:
            link = self._session.client.dashboard_link
        except (KeyError, AttributeError, TypeError):
            return None
        if not link:
            return None
        return link.rsplit("/", 1)[0] + f"/monarch?session={self._session.tag}"

    @property
    def workers(self) -> dict:
        """Dask worker address of every rank of this mesh, by global rank."""
        return {r: self._session.workers[r] for r in self._rank_list}

    def to_table(self) -> Table:
        """Which Dask worker each rank of this mesh is, laid out over the mesh's dimensions (Monarch's
        ``to_table``): a ``str`` (``print(mesh.to_table())``) whose cells read ``<global rank>: <worker address>``,
        the last dimension across, the one before it down, a section per coordinate of any others; a notebook
        shows it as an HTML table (``controller/table.py``)."""
        workers = self._session.workers
        cells = [f"{r}: {workers[r].removeprefix('tcp://')}" for r in self._rank_list]
        return grid(self.names, self.processes.sizes, cells)

    def seen_from(self, rank: int | None = None):
        """This mesh as a remote function receives it on global rank ``rank`` (default: the mesh's first): the
        worker's ``DeviceMesh`` (``worker/device_mesh.py``: ``dims[name].rank / .size / .members``). Raises
        ``ValueError`` if ``rank`` is not in the mesh."""
        from ..worker.device_mesh import DeviceMesh as WorkerMesh, MeshError

        try:
            return WorkerMesh(self.names, self.processes, self._rank_list[0] if rank is None else rank)
        except MeshError as e:
            raise ValueError(str(e)) from None

    # ----------------------------------------------------------------------------------------------- sub-meshes
    def slice(self, **selection) -> "DeviceMesh":
        """Sub-mesh: ``dim=int`` removes the dim at that coordinate; ``dim=slice(...)`` keeps a range (step 1 or
        more). Raises ``KeyError`` for an unknown dim, ``IndexError`` for an out-of-range coordinate."""
        names, ranks = select(self.names, self.processes, selection, "mesh")
        return self._derived(names, ranks)

    def __call__(self, **selection) -> "DeviceMesh":
        """``mesh(host=0)``: Monarch's deprecated spelling of ``mesh.slice(host=0)``; the same sub-mesh, with a
        ``DeprecationWarning``."""
        warnings.warn("mesh(...) is deprecated, as in Monarch: use mesh.slice(...)", DeprecationWarning, stacklevel=2)
        return self.slice(**selection)

    def _derived(self, names, ranks: Slice) -> "DeviceMesh":
        """A mesh of the same session over ``ranks`` (dims ``names``) that exits as this one does."""
        mesh = DeviceMesh(self._session, names, ranks)
        mesh._root = self._root
        return mesh

    def split(self, **splits) -> "DeviceMesh":
        """Split dimensions: ``split(host=("dp", "pp"), pp=4)`` replaces ``host`` by ``dp`` x ``pp`` (row-major),
        with the sizes given as keywords and at most one size inferred. Raises ``KeyError``/``ValueError``."""
        sizes_given = {k: v for k, v in splits.items() if not isinstance(v, (tuple, list))}
        targets = {k: tuple(v) for k, v in splits.items() if isinstance(v, (tuple, list))}
        unknown = sorted(set(targets) - set(self.names))
        if unknown:
            raise KeyError(f"split: {unknown} are not dimensions of this mesh; its dimensions are {list(self.names)}")
        names, sizes, strides = [], [], []
        used = set()
        for name, size, stride in zip(self.names, self.processes.sizes, self.processes.strides):
            if name not in targets:
                names.append(name)
                sizes.append(size)
                strides.append(stride)
                continue
            parts = targets[name]
            known = [sizes_given[p] for p in parts if p in sizes_given]
            missing = [p for p in parts if p not in sizes_given]
            if len(missing) > 1:
                raise ValueError(f"split: Cannot infer sizes of {missing}: give the sizes of all but one of {parts}, "
                                 f"e.g. {missing[-1]}=...")
            product = 1
            for k in known:
                product *= k
            if product == 0 or size % product:
                given = {p: sizes_given[p] for p in parts if p in sizes_given}
                raise ValueError(f"split: {name} has size {size}, which cannot be evenly divided by {given}")
            part_sizes = [sizes_given.get(p, size // product) for p in parts]
            if _product(part_sizes) != size:
                raise ValueError(f"split: sizes {dict(zip(parts, part_sizes))} do not multiply to {name}'s size {size}")
            step = stride
            part_strides = []
            for part_size in reversed(part_sizes):
                part_strides.append(step)
                step *= part_size
            names.extend(parts)
            sizes.extend(part_sizes)
            strides.extend(reversed(part_strides))
            used.update(parts)
        extra = sorted(set(sizes_given) - used)
        if extra:
            raise ValueError(f"split: unused size constraints {extra}: no split produces these dimensions")
        return self._derived(names, Slice(self.processes.offset, sizes, strides))

    def rename(self, **renames) -> "DeviceMesh":
        """The same mesh with dimensions renamed: ``rename(host="dp")``. Raises ``KeyError``/``ValueError``."""
        unknown = sorted(set(renames) - set(self.names))
        if unknown:
            raise KeyError(f"rename: {unknown} are not dimensions of this mesh; its dimensions are {list(self.names)}")
        return self._derived([renames.get(n, n) for n in self.names], self.processes)

    def flatten(self, name: str) -> "DeviceMesh":
        """All dimensions as one named ``name``, row-major. ``ValueError`` "cannot flatten sparse mesh" unless the
        ranks are dense (a contiguous row-major block)."""
        dense = Slice.new_row_major(self.processes.sizes, self.processes.offset)
        if dense.strides != self.processes.strides:
            raise ValueError(f"cannot flatten sparse mesh {self!r}")
        return self._derived([name], Slice(self.processes.offset, [len(self._rank_list)], [1]))

    @property
    def ranks(self) -> dict:
        """``{dim: mesh.rank(dim)}``: each rank's coordinate along every dimension, as remote 0-d int64 tensors."""
        return {name: self.rank(name) for name in self.names}

    def rank(self, dims):
        """This rank's coordinate along ``dims`` (a name, or names combined row-major) as a remote 0-d int64
        tensor (spec §1 ``rank``)."""
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        self.size(names)
        return frontend.remote("dask_monarch.worker.device_mesh.rank_tensor", propagate=_rank_fake)(self, names)

    def rank_tensor(self, dims):
        """``mesh.rank(dims)`` under Monarch's ``ProcMesh`` name."""
        return self.rank(dims)

    def spawn(self, cls, *args, **kwargs):
        """One actor ``cls(*args, **kwargs)`` per rank of this mesh, a Dask actor on that rank's worker (Monarch's
        ``proc_mesh.spawn``; spec §2 ``SendResultOfActorCall``/``CallActorMethod``). Returns an ``ActorMesh``
        whose ``actors.method.call(...)``, ``.call_one(...)``, ``.rref(...)``, ... run the method on the ranks'
        streams in order with the tensor messages around it (``controller/actors.py``). Remote tensors (or meshes)
        among the constructor's arguments reach each rank's constructor as that rank's local tensors (the worker's
        ``DeviceMesh``): it then runs on the active stream, after what was sent before. ``spawn("name", cls, ...)``
        (Monarch's ``proc_mesh.spawn``) names the actors. Waits until every constructor ran; raises the
        constructor's error (``RuntimeError``, naming the rank) if it raised."""
        return frontend.spawn(self, cls, *args, **kwargs)

    def process_group(self, dims) -> "RemoteProcessGroup":  # noqa: F821
        """A process group over ``dims`` (a name or a tuple of names; ``()`` for all) of this mesh, for remote
        functions: passed to one, it arrives on each rank as a ``torch.distributed.ProcessGroup`` over that
        rank's peers along ``dims`` (``RemoteProcessGroup``; spec §1 "UDF process groups"). Raises ``KeyError``
        for an unknown dim, ``ValueError`` for a repeated one."""
        from .process_group import RemoteProcessGroup

        return RemoteProcessGroup(self, dims)

    # ---------------------------------------------------------------------------------------------- activation
    @contextlib.contextmanager
    def activate(self):
        """Run every torch operation on this mesh inside the block, factories included (spec §1 "Dispatch"), and
        make it the mesh of remote calls without remote-tensor arguments. ``no_mesh.activate()`` undoes it."""
        token = _active.set(self)
        try:
            with frontend.dispatch_mode():
                yield self
        finally:
            _active.reset(token)

    def define_remotely(self) -> Ref:
        """Send ``CreateDeviceMesh`` to this mesh's ranks on first use and return the mesh's ref."""
        if self._ref is None:
            session = self._session
            with session.lock:
                if self._ref is None:
                    ref = session.new_ref()
                    session.send(CreateDeviceMesh(ref, list(self.names), self.processes), self._rank_list)
                    self._ref = ref
        return self._ref

    def __reduce_ex__(self, protocol):
        if self._ref is None:
            raise RuntimeError("a DeviceMesh must be defined remotely before it is sent (define_remotely())")
        return (Ref, (self._ref.id,))

    # ---------------------------------------------------------------------------------------------- lifetime
    def exit(self, timeout: float | None = None) -> None:
        """End the session: drain every rank, stop the tensor workers, and close the embedded cluster if ``attach``
        started one. A mesh made from the one ``attach`` returned (``slice``, ``split``, ``rename``, ``flatten``)
        ends the same session, as a Monarch sub-mesh shares its parent's ``exit``; once ended, ``exit()`` returns at
        once. Work still running on a rank (a long remote
        function) is waited for as long as its worker keeps its heartbeat, up to ``timeout`` seconds (default: the
        session's ``exit_timeout``, ``attach(exit_timeout=...)`` or Dask config ``monarch.exit-timeout``, else 600
        s); after 5 s a WARNING (logger ``dask_monarch.controller``, on stderr by default) says once which rank it
        waits for and on what. Raises the first remote failure nobody fetched (spec §3), or ``SessionError`` (a
        failure nobody reported, or a rank that failed, left or went silent while draining: within
        ``heartbeat_timeout``). If the ranks have not drained within ``timeout`` seconds it raises
        ``TimeoutError`` naming them and what they were busy on, and the session still ends on the workers: work
        still queued there is dropped."""
        if not self._owner:
            if self._root is not None:
                return self._root.exit(timeout)
            raise RuntimeError("this mesh was not made from the mesh dask_monarch.attach() returned: it cannot exit")
        try:
            self._session.close(timeout=timeout)
        finally:
            closer = self.__dict__.pop("_closer", None)  # atomic: exit() from several threads closes once
            if closer is not None:
                closer()

    def __enter__(self) -> "DeviceMesh":
        """The mesh's client is Dask's current client inside the block (as in ``with Client():``), so a plain
        ``compute()`` / ``persist()`` of a Dask collection runs on the mesh's cluster."""
        as_current = self._session.client.as_current()
        as_current.__enter__()
        self.__dict__.setdefault("_as_current", []).append(as_current)
        return self

    #: seconds leaving the ``with`` block on an exception waits for work still running on a rank (``exit``'s bound)
    EXIT_ON_ERROR_TIMEOUT = 30.0

    def __exit__(self, exc_type, exc, tb) -> None:
        stack = self.__dict__.get("_as_current")
        if stack:
            try:
                stack.pop().__exit__(None, None, None)
            except ValueError:  # left in another context than it was entered in (a generator, a thread)
                pass
        if exc_type is None:
            self.exit()
        else:  # the block raised (Ctrl-C too): the program's error matters, not work still running on a rank
            try:
                self.exit(timeout=min(self._session.exit_timeout, self.EXIT_ON_ERROR_TIMEOUT))
            except Exception:
                pass

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in self.sizes.items())
        return f"DeviceMesh({dims}; ranks={list(self._rank_list)}; session={self._session.tag})"


def _product(values) -> int:
    result = 1
    for v in values:
        result *= v
    return result


def _rank_fake(mesh, names):
    return torch.empty((), dtype=torch.int64)
