"""Time series of bounded length that cover a whole session (issue 18 "History since the session started").

A ``Series`` keeps at most ``limit`` points however long the session runs: when it is full, each pair of
neighbouring points becomes one (``combine``: the mean for a rate, the maximum for a queue or a memory size, so
that a peak stays visible), and from then on every two new samples make one point. A series of a multi-hour job
so keeps its start, at a coarser step the longer it runs (with 512 points and a heartbeat every 0.5 s: 0.5 s steps
for the first 4 minutes, 1 s for the next 4, 2 s for the next 8, ...).
"""

from __future__ import annotations

__all__ = ["Series", "SERIES_POINTS"]

#: points kept per series
SERIES_POINTS = 512


def _mean(values):
    return sum(values) / len(values)


class Series:
    """Points ``(time, value)`` in time order; ``combine`` is ``"mean"`` or ``"max"``; ``limit`` >= 4 points."""

    __slots__ = ("limit", "combine", "points", "step", "_pending")

    def __init__(self, combine: str = "mean", limit: int = SERIES_POINTS):
        if combine not in ("mean", "max"):
            raise ValueError(f"combine must be 'mean' or 'max', got {combine!r}")
        if type(limit) is not int or limit < 4:
            raise ValueError(f"limit must be an int of at least 4 points, got {limit!r}")
        self.limit = limit
        self.combine = _mean if combine == "mean" else max
        self.points: list[tuple[float, float]] = []
        self.step = 1  # samples per point
        self._pending: list[tuple[float, float]] = []

    def add(self, t: float, value: float) -> None:
        """Add a sample taken at ``t`` (seconds); it becomes a point once ``step`` samples have come."""
        self._pending.append((t, value))
        if len(self._pending) < self.step:
            return
        self.points.append(self._merge(self._pending))
        self._pending = []
        if len(self.points) >= self.limit:
            points = self.points
            self.points = [self._merge(points[i:i + 2]) for i in range(0, len(points), 2)]
            self.step *= 2

    def _merge(self, samples) -> tuple[float, float]:
        return samples[-1][0], self.combine([v for _, v in samples])

    def view(self) -> tuple[list, list]:
        """``(times, values)``, the samples not yet merged into a point included."""
        points = self.points + self._pending[-1:] if self._pending else self.points
        return [t for t, _ in points], [v for _, v in points]

    def __len__(self) -> int:
        return len(self.points) + (1 if self._pending else 0)
