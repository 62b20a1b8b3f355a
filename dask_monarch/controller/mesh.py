"""``DeviceMesh``: the controller's view of a mesh of Dask workers (spec §1 "DeviceMesh", §6).

A mesh has named dimensions over a ``Slice`` of the session's global ranks. The mesh returned by
``dask_monarch.attach`` owns the session: ``exit()`` (or leaving its ``with`` block) ends it. ``slice`` gives
sub-meshes that share the session.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import torch

from ..protocol import CreateDeviceMesh, Ref, Slice

__all__ = ["DeviceMesh", "get_active_mesh", "no_mesh"]

_active: contextvars.ContextVar = contextvars.ContextVar("dask_monarch_active_mesh", default=None)


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


class DeviceMesh:
    """Mesh ``names`` over global ranks ``ranks`` (a ``Slice``) of ``session``.

    ``names`` are the dimension names in order; ``sizes`` maps each to its size; ``ranks`` is the ``Slice`` of
    global ranks (Monarch's ``processes``). Use as a context manager, or call ``exit()`` when done.
    """

    def __init__(self, session, names, ranks: Slice, *, owner: bool = False):
        if len(names) != len(ranks.sizes):
            raise ValueError(f"DeviceMesh: {len(names)} names {list(names)} for {len(ranks.sizes)} dims")
        if len(set(names)) != len(names):
            raise ValueError(f"DeviceMesh: duplicate dimension names {list(names)}")
        self._session = session
        self.names = tuple(names)
        self.ranks = ranks
        self._rank_list = tuple(ranks)
        self._owner = owner
        self._ref: Ref | None = None

    # ------------------------------------------------------------------------------------------------ shape
    @property
    def sizes(self) -> dict:
        return dict(zip(self.names, self.ranks.sizes))

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
    def workers(self) -> dict:
        """Dask worker address of every rank of this mesh, by global rank."""
        return {r: self._session.workers[r] for r in self._rank_list}

    # ----------------------------------------------------------------------------------------------- sub-meshes
    def slice(self, **selection) -> "DeviceMesh":
        """Sub-mesh: ``dim=int`` removes the dim at that coordinate; ``dim=slice(...)`` keeps a range (step 1 or
        more). Raises ``KeyError`` for an unknown dim, ``IndexError`` for an out-of-range coordinate."""
        offset = self.ranks.offset
        names, sizes, strides = [], [], []
        for name, size, stride in zip(self.names, self.ranks.sizes, self.ranks.strides):
            if name not in selection:
                names.append(name)
                sizes.append(size)
                strides.append(stride)
                continue
            sel = selection.pop(name)
            if isinstance(sel, int):
                if not -size <= sel < size:
                    raise IndexError(f"mesh dimension {name!r} has size {size}, index {sel} is out of range")
                offset += (sel % size) * stride
            elif isinstance(sel, slice):
                start, stop, step = sel.indices(size)
                count = len(range(start, stop, step))
                if count == 0:
                    raise IndexError(f"empty selection {sel} of mesh dimension {name!r}")
                offset += start * stride
                names.append(name)
                sizes.append(count)
                strides.append(stride * step)
            else:
                raise TypeError(f"mesh selection for {name!r} must be an int or a slice, got {type(sel).__name__}")
        if selection:
            raise KeyError(f"{sorted(selection)} not dimensions of this mesh; its dimensions are {list(self.names)}")
        return DeviceMesh(self._session, names, Slice(offset, sizes, strides))

    def rank(self, dims) -> "Tensor":  # noqa: F821
        """This rank's coordinate along ``dims`` (a name, or names combined row-major) as a remote 0-d int64
        tensor (spec §1 ``rank``)."""
        from .remote import remote

        names = (dims,) if isinstance(dims, str) else tuple(dims)
        self.size(names)
        return remote("dask_monarch.worker.device_mesh.rank_tensor", propagate=_rank_fake)(self, names)

    # ---------------------------------------------------------------------------------------------- activation
    @contextlib.contextmanager
    def activate(self):
        """Make this the mesh that remote calls without remote-tensor arguments run on."""
        token = _active.set(self)
        try:
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
                    session.send(CreateDeviceMesh(ref, list(self.names), self.ranks), self._rank_list)
                    self._ref = ref
        return self._ref

    def __reduce_ex__(self, protocol):
        if self._ref is None:
            raise RuntimeError("a DeviceMesh must be defined remotely before it is sent (define_remotely())")
        return (Ref, (self._ref.id,))

    # ---------------------------------------------------------------------------------------------- lifetime
    def exit(self, timeout: float = 60.0) -> None:
        """End the session (only the mesh returned by ``attach`` may): drain every rank, stop the tensor workers,
        and close the embedded cluster if ``attach`` started one. Raises the first remote failure nobody fetched
        (spec §3), or ``SessionError`` (a failure nobody reported, or a rank that failed, left or went silent
        while draining). If the ranks have not drained within ``timeout`` seconds it raises ``TimeoutError``
        naming them, and the session still ends on the workers: work still queued there is dropped."""
        if not self._owner:
            raise RuntimeError("only the mesh returned by dask_monarch.attach() can exit the session")
        try:
            self._session.close(timeout=timeout)
        finally:
            closer = self.__dict__.pop("_closer", None)  # atomic: exit() from several threads closes once
            if closer is not None:
                closer()

    def __enter__(self) -> "DeviceMesh":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.exit()
        else:
            try:
                self.exit()
            except Exception:
                pass

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in self.sizes.items())
        return f"DeviceMesh({dims}; ranks={list(self._rank_list)}; session={self._session.id[:8]})"


def _rank_fake(mesh, names):
    return torch.empty((), dtype=torch.int64)
