"""``Tensor``: the controller's handle to a tensor that lives on every rank of a mesh (Monarch's ``Tensor``).

It knows its ``Ref``, its mesh and stream, and a fake tensor (``torch._subclasses.FakeTensor``) with the shape,
dtype and strides every rank's tensor has. It pickles as its ``Ref``, so passing it to a remote function sends
the reference, and when the handle is garbage-collected the ref is freed on the workers (``DeleteRefs``).
"""

from __future__ import annotations

import torch

from ..protocol import Ref

__all__ = ["Tensor"]


class Tensor:
    """A remote tensor: ``ref`` on ``mesh``'s ranks, on ``stream``; ``shape``/``dtype``/``device`` come from the
    controller's fake tensor ``_fake``. Fetch its value with ``dask_monarch.fetch_shard`` or ``inspect``."""

    __slots__ = ("ref", "mesh", "stream", "_fake", "__weakref__")

    def __init__(self, ref: Ref, fake: torch.Tensor, mesh, stream):
        self.ref = ref
        self._fake = fake
        self.mesh = mesh
        self.stream = stream
        mesh._session.track(self)

    # ---------------------------------------------------------------------------------------------- metadata
    @property
    def shape(self) -> torch.Size:
        return self._fake.shape

    def size(self, dim: int | None = None):
        return self._fake.size() if dim is None else self._fake.size(dim)

    @property
    def dtype(self) -> torch.dtype:
        return self._fake.dtype

    @property
    def device(self) -> torch.device:
        return self._fake.device

    @property
    def ndim(self) -> int:
        return self._fake.ndim

    def dim(self) -> int:
        return self._fake.dim()

    def numel(self) -> int:
        return self._fake.numel()

    def stride(self, dim: int | None = None):
        return self._fake.stride() if dim is None else self._fake.stride(dim)

    @property
    def requires_grad(self) -> bool:
        return self._fake.requires_grad

    # ---------------------------------------------------------------------------------------------- reductions
    def reduce(self, dims, reduction: str = "sum", scatter: bool = False, mesh=None, out: "Tensor | None" = None):
        """``dask_monarch.reduce`` of this tensor; see there (spec §1 ``t.reduce``)."""
        from .reduce import reduce_one

        return reduce_one(self, dims, reduction, scatter, mesh, False, out)

    def reduce_(self, dims, reduction: str = "sum", scatter: bool = False, mesh=None) -> "Tensor":
        """In-place ``reduce``: this tensor holds the result afterwards, and is returned (spec §1)."""
        from .reduce import reduce_one

        return reduce_one(self, dims, reduction, scatter, mesh, True, None)

    # ---------------------------------------------------------------------------------------------- plumbing
    def __monarch_ref__(self) -> int:
        return self.ref.id

    def __reduce_ex__(self, protocol):
        return (Ref, (self.ref.id,))

    def __del__(self):
        try:
            mesh = self.mesh
            mesh._session.drop_ref(self.ref.id, mesh._rank_list)
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"dask_monarch.Tensor({self.ref!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}, mesh={self.mesh.names})"
        )

    def __bool__(self):
        raise TypeError(
            "the value of a remote dask_monarch.Tensor is not known on the controller; "
            "fetch it with dask_monarch.inspect(t) or fetch_shard(t).result()"
        )
