"""``ValueMesh``: one value per rank of a mesh, as a call of every rank answers (Monarch's ``ValueMesh``; spec §9
test_remote_functions.py ``value_mesh``).

``remote(f).call(*args)`` and an actor endpoint's ``.call(*args)`` give a future of one: ``.item(**coords)`` is one
rank's value, iterating gives ``(point, value)`` pairs in rank order (the mesh's row-major order), ``.values()``
the values alone; ``slice``/``flatten`` select or reshape it as they do a ``DeviceMesh``.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

from ..protocol import Slice
from .mesh import select

__all__ = ["Point", "ValueMesh"]


class Point(Mapping):
    """A place in a ``ValueMesh``: a mapping of dimension name -> coordinate (``point["dp"]``), and ``rank``, its
    index in the value mesh's rank order (Monarch's ``Point``)."""

    def __init__(self, rank: int, names: tuple, sizes: list):
        self.rank = rank
        coords = []
        for size in reversed(sizes):
            rank, c = divmod(rank, size)
            coords.append(c)
        self._coords = dict(zip(names, reversed(coords)))

    def __getitem__(self, name: str) -> int:
        return self._coords[name]

    def __iter__(self):
        return iter(self._coords)

    def __len__(self) -> int:
        return len(self._coords)

    def __repr__(self) -> str:
        return f"Point({self.rank}, {self._coords})"


class ValueMesh:
    """The values of the ranks of a mesh with dimensions ``names`` (Monarch's ``ValueMesh``). ``values`` are given
    in the mesh's rank order; ``_places`` is the ``Slice`` of their positions (a sub-mesh of a sliced one)."""

    def __init__(self, names, sizes, values: list, _places: Slice | None = None):
        self.names = tuple(names)
        self._places = Slice.new_row_major(list(sizes)) if _places is None else _places
        self._values = list(values)
        if len(self._values) < len(self._places):
            raise ValueError(f"ValueMesh: {len(self._values)} values for a mesh of sizes {list(sizes)}")

    @property
    def sizes(self) -> dict:
        """``{dim: size}``."""
        return dict(zip(self.names, self._places.sizes))

    def size(self, dims=None) -> int:
        """The number of values along ``dims`` (a name or names; all if None). ``KeyError`` for an unknown dim."""
        if dims is None:
            return len(self)
        sizes = self.sizes
        n = 1
        for d in (dims,) if isinstance(dims, str) else dims:
            if d not in sizes:
                raise KeyError(f"{d!r} is not a dimension of this value mesh; its dimensions are {list(self.names)}")
            n *= sizes[d]
        return n

    def item(self, **coords):
        """The value at ``coords``, one int per dimension (none for a mesh of one value). ``KeyError`` for a missing
        or unknown dimension, ``IndexError`` for a coordinate out of range, ``TypeError`` for one that is no int."""
        missing = [d for d in self.names if d not in coords]
        extra = sorted(set(coords) - set(self.names))
        if missing or extra:
            raise KeyError(f"ValueMesh.item needs one coordinate for each of {list(self.names)}"
                           + (f"; missing {missing}" if missing else "") + (f"; not dimensions: {extra}" if extra else ""))
        place = []
        for name, size in zip(self.names, self._places.sizes):
            try:
                c = operator.index(coords[name])
            except TypeError:
                raise TypeError(f"ValueMesh.item: coordinate {name}={coords[name]!r} must be an int") from None
            if not 0 <= c < size:
                raise IndexError(f"ValueMesh.item: coordinate {name}={c} out of range for size {size}")
            place.append(c)
        return self._values[self._places.location(place)]

    def items(self):
        """``(Point, value)`` for every rank, in rank order."""
        sizes = self._places.sizes
        for i, place in enumerate(self._places):
            yield Point(i, self.names, sizes), self._values[place]

    def values(self):
        """The values, in rank order."""
        for place in self._places:
            yield self._values[place]

    def __iter__(self):
        return self.items()

    def __len__(self) -> int:
        return len(self._places)

    def slice(self, **selection) -> "ValueMesh":
        """The values of a sub-mesh, as ``DeviceMesh.slice`` selects it: ``dim=int`` removes the dim, ``dim=slice``
        keeps a range. Raises ``KeyError``/``IndexError``/``TypeError`` as ``DeviceMesh.slice``."""
        names, places = select(self.names, self._places, selection, "value mesh")
        return ValueMesh(names, places.sizes, self._values, places)

    def flatten(self, name: str) -> "ValueMesh":
        """The same values along one dimension ``name``, in rank order."""
        return ValueMesh([name], [len(self)], list(self.values()))

    def __repr__(self) -> str:
        return f"ValueMesh({self.sizes}, {list(self.values())!r})"
