"""The data source of the ``/monarch`` dashboard page: the scheduler plugin's session table and the workers'
heartbeat metrics (``worker/metrics.py``) turned into the page's rows and rate lines.

Pure Python, no Bokeh and no scheduler: ``DashboardData.update(sessions, metrics, now)`` takes plain dicts, so it is
tested on its own (tests/test_dashboard.py).
"""

from __future__ import annotations

import math
from collections import deque

from ..controller.task_keys import session_tag

__all__ = ["DashboardData", "NO_SESSION", "format_age", "format_bytes", "mesh_coords"]

NO_SESSION = (
    "No dask_monarch session is running on this cluster. A session appears here while a controller is attached "
    "(dask_monarch.attach)."
)
SESSION_COLUMNS = ("session", "id", "controller", "mesh", "shape", "ranks", "age", "state")
RANK_COLUMNS = (
    "session", "rank", "coords", "worker", "device", "received", "applied", "queued", "inbox", "streams", "refs",
    "bytes", "bytes_text", "rate", "last_error", "state",
)
RATE_COLUMNS = ("xs", "ys", "label", "color")
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")


def format_age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


def mesh_coords(dims: dict, rank: int) -> str:
    """``"host=1, gpu=0"``: the coordinates of ``rank`` in a row-major mesh of ``dims`` (name -> size)."""
    coords = []
    rest = rank
    sizes = list(dims.values())
    for i, name in enumerate(dims):
        stride = math.prod(sizes[i + 1:])
        coords.append(f"{name}={rest // stride}")
        rest %= stride
    return ", ".join(coords)


class DashboardData:
    """Rows of the page, and a messages-per-second history per (session, rank) of ``history`` points (a point per
    heartbeat: 5 minutes at Dask's 0.5 s for small clusters).

    A rank's rate is the growth of its ``received`` counter between two heartbeats, over the worker's own clock;
    a point is added when a new heartbeat arrives (a repeated snapshot adds nothing).
    """

    def __init__(self, history: int = 600):
        self.history = history
        self._last: dict[tuple, tuple[float, int]] = {}  # (session, rank) -> (worker time, received)
        self._rates: dict[tuple, deque] = {}  # (session, rank) -> deque of (scheduler time, rate)
        self.current_rate: dict[tuple, float] = {}

    def update(self, sessions: dict, metrics: dict, now: float) -> dict:
        """``sessions``: session id -> ``{"client", "dims", "workers", "started", "streams"}`` (the scheduler plugin's
        table; ``streams`` maps stream ids to their names, the default stream 0 being ``main``);
        ``metrics``: worker address -> that worker's ``metrics["monarch"]`` (or None); ``now``: scheduler time.

        Returns ``{"running": bool, "summary": str, "sessions": columns, "ranks": columns, "rates": columns}``;
        columns are dicts of equal-length lists (``SESSION_COLUMNS``, ``RANK_COLUMNS``, ``RATE_COLUMNS``)."""
        session_rows = {c: [] for c in SESSION_COLUMNS}
        rank_rows = {c: [] for c in RANK_COLUMNS}
        live = set()
        failed_sessions = 0
        for session_id, info in sorted(sessions.items(), key=lambda kv: kv[1].get("started", 0)):
            tag = session_tag(session_id)
            dims = dict(info.get("dims") or {})
            workers = list(info.get("workers") or [])
            stream_names = {"0": "main", **{str(k): v for k, v in (info.get("streams") or {}).items()}}
            failed_ranks = []
            for rank, address in enumerate(workers):
                worker = metrics.get(address) or {}
                snap = (worker.get("sessions") or {}).get(session_id)
                closed = worker.get("closed") or {}
                key = (session_id, rank)
                live.add(key)
                rate = self._rate(key, worker.get("time"), snap, now, info.get("started"))
                rank_rows["session"].append(tag)
                rank_rows["rank"].append(rank)
                rank_rows["coords"].append(mesh_coords(dims, rank) if dims else "")
                rank_rows["worker"].append(address)
                rank_rows["rate"].append(round(rate, 1))
                if snap is not None:
                    rank_rows["device"].append(snap["device"])
                    for column in ("received", "applied", "queued", "refs", "bytes"):
                        rank_rows[column].append(snap[column])
                    rank_rows["inbox"].append(snap["inbox_batches"])
                    rank_rows["streams"].append(", ".join(
                        f"{stream_names.get(str(sid)) or f's{sid}'}: {s['queued']}"
                        for sid, s in sorted(snap["streams"].items(), key=lambda kv: int(kv[0]))
                    ))
                    rank_rows["bytes_text"].append(format_bytes(snap["bytes"]))
                    error = snap.get("last_error")
                    if snap.get("failure"):
                        rank_rows["last_error"].append(f"session failed: {snap['failure']}")
                        state = "failed"
                    elif error:
                        rank_rows["last_error"].append(f"seq {error['seq']}: {error['text']}")
                        state = "running"
                    else:
                        rank_rows["last_error"].append("")
                        state = "running"
                else:
                    rank_rows["device"].append("")
                    for column in ("received", "applied", "queued", "inbox", "refs", "bytes"):
                        rank_rows[column].append(0)
                    rank_rows["streams"].append("")
                    rank_rows["bytes_text"].append("")
                    if address not in metrics:
                        state, text = "worker gone", f"the worker {address} left the cluster"
                    elif session_id in closed:
                        failure = closed[session_id]
                        state = "failed" if failure else "exited"
                        text = f"session failed: {failure}" if failure else ""
                    else:
                        state, text = "starting", ""  # no task of the session reached the worker yet
                    rank_rows["last_error"].append(text)
                if state in ("failed", "worker gone"):
                    failed_ranks.append(rank)
                rank_rows["state"].append(state)
            if failed_ranks:
                failed_sessions += 1
            session_rows["session"].append(tag)
            session_rows["id"].append(session_id)
            session_rows["controller"].append(str(info.get("client", "")))
            session_rows["mesh"].append(" × ".join(f"{name}={size}" for name, size in dims.items()))
            session_rows["shape"].append(str(tuple(dims.values())))
            session_rows["ranks"].append(len(workers))
            session_rows["age"].append(format_age(now - info.get("started", now)))
            session_rows["state"].append(
                f"failed on rank {', '.join(map(str, failed_ranks))}" if failed_ranks else "running"
            )
        for key in [k for k in self._rates if k not in live]:
            self._rates.pop(key, None)
            self._last.pop(key, None)
            self.current_rate.pop(key, None)
        n = len(session_rows["session"])
        if n:
            n_ranks = len(rank_rows["rank"])
            summary = (f"{n} session{'s' if n != 1 else ''}, {n_ranks} rank{'s' if n_ranks != 1 else ''}"
                       + (f", {failed_sessions} failed" if failed_sessions else ""))
        else:
            summary = NO_SESSION
        return {
            "running": bool(n),
            "summary": summary,
            "sessions": session_rows,
            "ranks": rank_rows,
            "rates": self._rate_lines(rank_rows),
        }

    def _rate(self, key: tuple, worker_time, snap, now: float, started=None) -> float:
        if snap is None or worker_time is None:
            return self.current_rate.get(key, 0.0)
        received = int(snap["received"])
        last = self._last.get(key)
        if last is None:
            self._last[key] = (worker_time, received)
            # the line starts at the session's start (scheduler time), not when it was first seen here
            self._rates[key] = deque([(started, 0.0)] if started and started < now else [], maxlen=self.history)
            self.current_rate[key] = 0.0
            return 0.0
        if worker_time <= last[0]:
            return self.current_rate.get(key, 0.0)  # the same heartbeat as before
        rate = max(0, received - last[1]) / (worker_time - last[0])
        self._last[key] = (worker_time, received)
        self._rates[key].append((now, rate))
        self.current_rate[key] = rate
        return rate

    def _rate_lines(self, rank_rows: dict) -> dict:
        lines = {c: [] for c in RATE_COLUMNS}
        index = {}
        for tag, rank in zip(rank_rows["session"], rank_rows["rank"]):
            index[(tag, rank)] = len(index)
        for (session_id, rank), points in self._rates.items():
            i = index.get((session_tag(session_id), rank), 0)
            lines["xs"].append([t * 1000.0 for t, _ in points])  # milliseconds, for a datetime axis
            lines["ys"].append([r for _, r in points])
            lines["label"].append(f"{session_tag(session_id)} rank {rank}")
            lines["color"].append(PALETTE[i % len(PALETTE)])
        return lines
