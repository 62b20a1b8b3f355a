"""Time series of bounded length that cover a whole session (issue 18 "History since the session started").

A ``Series`` keeps at most ``limit`` points however long the session runs: when it is full, each pair of
neighbouring points becomes one (``combine``: the mean for a rate, the maximum for a queue or a memory size, so
that a peak stays visible), and from then on every two new samples make one point. A series of a multi-hour job
so keeps its start, at a coarser step the longer it runs (with 512 points and a heartbeat every 0.5 s: 0.5 s steps
for the first 4 minutes, 1 s for the next 4, 2 s for the next 8, ...).
"""

from __future__ import annotations

from collections import deque

__all__ = ["Series", "SERIES_POINTS", "WindowRate", "RATE_WINDOW", "PALETTE", "LINE_COLUMNS"]

#: points kept per series
SERIES_POINTS = 512
#: seconds a rate is measured over (issue 25 item 6: a rate from two successive heartbeats jumped between 0 and
#: about 1,200 messages per second, since batches arrive in bursts)
RATE_WINDOW = 5.0
#: the columns of a plot's lines (a Bokeh ``multi_line`` source): one row per line
LINE_COLUMNS = ("xs", "ys", "label", "color", "session")
#: line colors, by line
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")


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


class WindowRate:
    """The rate of a growing counter over the last ``window`` seconds: ``add(t, count)`` returns the counter's growth
    since the newest sample at least ``window`` seconds older (the oldest one, early on), over the time between; 0
    with a single sample. A counter that went down (it restarted) counts as no growth."""

    __slots__ = ("window", "samples")

    def __init__(self, window: float = RATE_WINDOW):
        self.window = window
        self.samples: deque = deque()

    def add(self, t: float, count: float) -> float:
        samples = self.samples
        samples.append((t, count))
        while len(samples) > 2 and samples[1][0] <= t - self.window:
            samples.popleft()
        t0, c0 = samples[0]
        return max(0.0, (count - c0) / (t - t0)) if t > t0 else 0.0
