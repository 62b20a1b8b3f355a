"""ndslice ``Slice``: a strided, rectangular set of ranks (spec §6; Monarch's ``ndslice::Slice``/``NDSlice``).

``location(coord) = offset + sum(coord[i] * strides[i])``; iteration yields locations in row-major coordinate
order; ``index(v)`` is the row-major linear index of rank ``v`` and ``get(i)`` its inverse.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

__all__ = ["Slice", "SliceError"]


class SliceError(ValueError):
    """A ``Slice`` is malformed, or a rank is not in it (spec §6 messages)."""


class Slice:
    """``Slice(offset, sizes, strides)``: ``offset`` int >= 0, ``sizes`` and ``strides`` equal-length int lists.

    Validation (spec §6), sorted by stride: each stride must be a multiple of the previous ("nonrectangular
    shape"), strides must be unique unless a size is 1 ("nonunique strides"), and each stride must be at least
    the previous size x stride ("stride ... must be larger than size of previous space"). Raises ``SliceError``.
    """

    __slots__ = ("offset", "sizes", "strides")

    def __init__(self, offset: int = 0, sizes: Sequence[int] = (), strides: Sequence[int] = ()):
        sizes = list(sizes)
        strides = list(strides)
        for name, values in (("sizes", sizes), ("strides", strides)):
            for v in values:
                if type(v) is not int or v < 0:
                    raise SliceError(f"Slice.{name} must hold non-negative ints, got {values!r}")
        if type(offset) is not int or offset < 0:
            raise SliceError(f"Slice.offset must be a non-negative int, got {offset!r}")
        if len(sizes) != len(strides):
            raise SliceError(f"Slice: {len(sizes)} sizes but {len(strides)} strides: sizes={sizes} strides={strides}")
        dims = sorted(zip(strides, sizes))
        prev_stride, prev_size = None, None
        for stride, size in dims:
            if prev_stride is not None:
                if prev_stride == stride and size != 1 and prev_size != 1:
                    raise SliceError(f"Slice: nonunique strides {strides}")
                if prev_stride and stride % prev_stride != 0:
                    raise SliceError(f"Slice: nonrectangular shape, stride {stride} is not a multiple of {prev_stride}")
                if stride < prev_stride * prev_size:
                    raise SliceError(
                        f"Slice: stride {stride} must be larger than size of previous space "
                        f"{prev_stride} x {prev_size} = {prev_stride * prev_size}"
                    )
            prev_stride, prev_size = stride, size
        self.offset = offset
        self.sizes = sizes
        self.strides = strides

    @classmethod
    def new_row_major(cls, sizes: Sequence[int], offset: int = 0) -> "Slice":
        """A dense slice whose last dimension varies fastest."""
        strides = []
        step = 1
        for size in reversed(list(sizes)):
            strides.append(step)
            step *= size
        return cls(offset, list(sizes), strides[::-1])

    @classmethod
    def single(cls, rank: int) -> "Slice":
        """The slice holding only ``rank`` (``Slice(offset=rank, sizes=[], strides=[])``)."""
        return cls(rank, [], [])

    def __len__(self) -> int:
        return math.prod(self.sizes)

    def location(self, coord: Sequence[int]) -> int:
        """``offset + sum(coord[i] * strides[i])``; ``SliceError`` if a coordinate is out of range."""
        if len(coord) != len(self.sizes):
            raise SliceError(f"coordinate {list(coord)} has {len(coord)} dims, slice has {len(self.sizes)}")
        for c, size in zip(coord, self.sizes):
            if not 0 <= c < size:
                raise SliceError(f"coordinate {list(coord)} out of range for sizes {self.sizes}")
        return self.offset + sum(c * s for c, s in zip(coord, self.strides))

    nditem = location

    def __iter__(self) -> Iterator[int]:
        for i in range(len(self)):
            yield self.get(i)

    def coordinates(self, value: int) -> list[int]:
        """Coordinates of rank ``value``: decompose ``value - offset`` from the largest stride down (size-1 dims get
        0). Raises ``SliceError`` "value v not in slice" on a remainder or an out-of-range index."""
        rest = value - self.offset
        coords = [0] * len(self.sizes)
        if rest < 0:
            raise SliceError(f"value {value} not in slice {self}")
        for i in sorted(range(len(self.sizes)), key=lambda i: self.strides[i], reverse=True):
            if self.sizes[i] == 1 or self.strides[i] == 0:
                continue
            c, rest = divmod(rest, self.strides[i])
            if c >= self.sizes[i]:
                raise SliceError(f"value {value} not in slice {self}")
            coords[i] = c
        if rest != 0:
            raise SliceError(f"value {value} not in slice {self}")
        return coords

    def index(self, value: int) -> int:
        """Row-major linear index of rank ``value`` (``SliceError``, a ``ValueError``, if absent)."""
        index = 0
        for c, size in zip(self.coordinates(value), self.sizes):
            index = index * size + c
        return index

    def get(self, index: int) -> int:
        """The rank at row-major linear ``index``; ``IndexError`` "index i out of range total" otherwise."""
        total = len(self)
        if not 0 <= index < total:
            raise IndexError(f"index {index} out of range {total}")
        coord = []
        for size in reversed(self.sizes):
            index, c = divmod(index, size)
            coord.append(c)
        return self.offset + sum(c * s for c, s in zip(reversed(coord), self.strides))

    def __getitem__(self, index):
        """``s[i]``: the rank at row-major position ``i`` (negative from the end); ``s[a:b:c]``: those ranks as a
        tuple (Monarch's ``NDSlice`` indexing). ``IndexError`` out of range, ``TypeError`` for another index."""
        if isinstance(index, slice):
            return tuple(self.get(i) for i in range(*index.indices(len(self))))
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"Slice indices must be integers or slices, not {type(index).__name__}")
        return self.get(index + len(self) if index < 0 else index)

    def __contains__(self, value: int) -> bool:
        try:
            self.coordinates(value)
        except SliceError:
            return False
        return True

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Slice)
            and (self.offset, self.sizes, self.strides) == (other.offset, other.sizes, other.strides)
        )

    def __hash__(self) -> int:
        return hash((self.offset, tuple(self.sizes), tuple(self.strides)))

    def __reduce__(self):
        return (Slice, (self.offset, self.sizes, self.strides))

    def __repr__(self) -> str:
        return f"Slice(offset={self.offset}, sizes={self.sizes}, strides={self.strides})"
