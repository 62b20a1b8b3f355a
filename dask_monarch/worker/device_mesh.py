"""The worker-side ``DeviceMesh`` (spec §6 "Worker DeviceMesh::new" and ``get_ranks_for_dim_slice``).

Remote functions that take a mesh receive this object: ``mesh.dims[name].rank / .size / .members``,
``mesh.ranks()``, ``mesh.sizes()``, ``mesh.dim(name)``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..protocol import Slice, SliceError

__all__ = ["Dim", "DeviceMesh", "MeshError"]


class MeshError(ValueError):
    """A ``CreateDeviceMesh`` or a dimension lookup is inconsistent with this rank (spec §2: fatal)."""


@dataclass(frozen=True)
class Dim:
    """One dimension as seen from this rank: its ``name``, this rank's coordinate ``rank``, its ``size``, and the
    global ranks along it through this rank (``members``, ascending coordinate order; a list, as Monarch's)."""

    name: str
    rank: int
    size: int
    members: list


class DeviceMesh:
    """Mesh ``names`` over the global ``ranks`` (a ``Slice``) seen from global rank ``me``:
    ``DeviceMesh(names, ranks, me)``, or as Monarch's worker builds it, ``DeviceMesh(def_id, names, ranks, rank=me)``
    (``def_id``, the mesh's id, is kept as ``id``; None in the first form).

    Raises ``MeshError`` if ``me`` is not in ``ranks`` or the number of names differs from the number of dims;
    ``TypeError`` for another number of arguments.
    """

    def __init__(self, *args, rank: int | None = None):
        if len(args) == 4 and rank is None:
            self.id, names, ranks, me = args
        elif len(args) == 3 and rank is not None:
            self.id, names, ranks, me = (*args, rank)
        elif len(args) == 3:
            self.id = None
            names, ranks, me = args
        else:
            raise TypeError("DeviceMesh takes (names, ranks, me) or Monarch's (def_id, names, ranks, rank=me), got "
                            f"{len(args)} positional arguments" + (" and rank=" if rank is not None else ""))
        names = list(names)
        if len(names) != len(ranks.sizes):
            raise MeshError(f"CreateDeviceMesh: {len(names)} names {names} for {len(ranks.sizes)} dims of {ranks}")
        try:
            coords = ranks.coordinates(me)
        except SliceError:
            raise MeshError(f"CreateDeviceMesh: rank {me} is not in the mesh's ranks {ranks}") from None
        self.names = names
        self.ranks_slice = ranks
        self.me = me
        self.dims: dict[str, Dim] = {}
        for name, size, stride, c in zip(names, ranks.sizes, ranks.strides, coords):
            start = me - stride * c
            members = [start + k * stride for k in range(size)]
            assert members[c] == me
            self.dims[name] = Dim(name, c, size, members)
        self.all_ranks = list(ranks)
        #: (stream id, sorted dims) -> (group size, communicator); filled by ``SplitComm``.
        self.comms: dict = {}

    def dim(self, name: str) -> Dim:
        try:
            return self.dims[name]
        except KeyError:
            raise MeshError(f"unknown mesh dimension {name!r}; this mesh has {self.names}") from None

    def ranks(self) -> dict:
        """This rank's coordinate along every dimension, by name."""
        return {name: d.rank for name, d in self.dims.items()}

    def sizes(self) -> dict:
        return {name: d.size for name, d in self.dims.items()}

    def get_ranks_for_dim_slice(self, names) -> list:
        """Global ranks of the sub-mesh through this rank spanned by ``names`` (spec §6): ``[]`` for no names, a
        dim's members for one, else the Cartesian product with the last listed name varying fastest."""
        names = list(names)
        if not names:
            return []
        dims = [self.dim(n) for n in names]
        if len(dims) == 1:
            return list(dims[0].members)
        strides = [d.members[1] - d.members[0] if d.size > 1 else 0 for d in dims]
        start = self.me - sum(s * d.rank for s, d in zip(strides, dims))
        return [
            start + sum(i * s for i, s in zip(index, strides))
            for index in itertools.product(*(range(d.size) for d in dims))
        ]

    def __repr__(self) -> str:
        return f"DeviceMesh(names={self.names}, ranks={self.ranks_slice}, me={self.me})"


def rank_tensor(mesh: DeviceMesh, dims) -> "torch.Tensor":
    """This rank's coordinate along ``dims`` (names combined row-major) as a 0-d int64 tensor (spec §1 ``rank``)."""
    import torch

    index = 0
    for name in dims:
        d = mesh.dim(name)
        index = index * d.size + d.rank
    return torch.tensor(index, dtype=torch.int64)


def mesh_rank(mesh: DeviceMesh, dim: str) -> int:
    """This rank's coordinate along ``dim`` as an int (lib.rs test ``test_utils.mesh_rank``)."""
    return mesh.dim(dim).rank
