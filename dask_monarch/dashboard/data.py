"""The data source of the ``/monarch`` dashboard page: the scheduler plugin's session table and the workers'
heartbeat metrics (``worker/metrics.py``) turned into the page's health lines (``health.py``), rows, what each rank
is doing now, the stacks of flagged ranks, history lines since each session's start (``history.py``) and the list
of remote errors (issue 18).

Pure Python, no Bokeh and no scheduler: ``DashboardData.update(sessions, metrics, now)`` takes plain dicts, so it is
tested on its own (tests/test_dashboard.py).
"""

from __future__ import annotations

import math

from ..controller.task_keys import session_tag
from .health import HEALTH_COLUMNS, RankProgress, session_health
from .history import LINE_COLUMNS, PALETTE, SERIES_POINTS, Series, WindowRate
from .hosts import HOST_COLUMNS, behind, host_rows, order
from .progress import Progress

__all__ = ["DashboardData", "NO_SESSION", "format_age", "format_bytes", "memory_text", "memory_title", "mesh_coords",
           "select", "HISTORIES"]

NO_SESSION = (
    "No dask_monarch session is running on this cluster. A session appears here while a controller is attached "
    "(dask_monarch.attach)."
)
SESSION_COLUMNS = ("session", "id", "controller", "mesh", "shape", "ranks", "age", "state")
RANK_COLUMNS = (
    "session", "rank", "coords", "worker", "device", "received", "applied", "queued", "inbox", "streams", "refs",
    "bytes", "bytes_text", "rate", "last_error", "state", "behind",
)
RATE_COLUMNS = LINE_COLUMNS
NOW_COLUMNS = ("session", "rank", "stream", "state", "message", "for_s", "for_text", "flagged")
ERROR_COLUMNS = ("time", "session", "rank", "seq", "text")
STACK_KEYS = ("session", "rank", "stream", "title", "text")
#: the history lines: view key -> (the rank's number it plots, how a full series merges two points)
HISTORIES = {"rates": ("rate", "mean"), "queued": ("queued", "max"), "held": ("bytes", "max")}
#: remote errors kept per session (the newest)
ERRORS_KEPT = 100


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


def _on_gpu(device: str) -> bool:
    return str(device).startswith("cuda")


def memory_text(nbytes: int, device: str) -> str:
    """A rank's memory as the page's table shows it, with what it measures (``worker/metrics.held_bytes``): CUDA
    memory allocated on a GPU worker (``"1.1 GiB CUDA"``), the sizes of the refs' tensor storages on a CPU one
    (``"2.0 KiB tensors"``)."""
    return f"{format_bytes(nbytes)} {'CUDA' if _on_gpu(device) else 'tensors'}"


def memory_title(devices) -> str:
    """The memory plot's title for ranks on ``devices`` (their ``device`` strings): it names what is measured."""
    gpu = {_on_gpu(d) for d in devices if d}
    if gpu == {True}:
        return "CUDA memory allocated on each rank's GPU (torch.cuda.memory_allocated), per rank"
    if gpu == {False}:
        return "tensor bytes held by each rank's refs (the sizes of their distinct storages, CPU workers), per rank"
    if gpu:
        return "memory per rank: CUDA memory allocated on GPU workers, tensor bytes of the refs on CPU workers"
    return "memory held, per rank"


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


class _Rank:
    """What the data source keeps of one (session, rank) between heartbeats."""

    __slots__ = ("last", "rate", "window", "series", "progress", "count")

    def __init__(self, limit: int):
        self.last = None  # (worker time, received) of the last heartbeat used
        self.rate = 0.0  # messages received per second over the last RATE_WINDOW seconds
        self.window = WindowRate()
        self.series = {key: Series(combine, limit) for key, (_, combine) in HISTORIES.items()}
        self.progress = RankProgress()
        self.count = 0  # the rank's count of remote errors, as last reported


class DashboardData:
    """Everything the page shows, kept from each session's start: per (session, rank) ``Series`` of messages per
    second, queued messages and bytes held (``history`` points each, merged as the session grows old), its
    progress steps, and per session its remote errors (the newest ``ERRORS_KEPT``).

    A rank's rate is the growth of its ``received`` counter over the last ``history.RATE_WINDOW`` seconds of its
    heartbeats, on the worker's own clock (the table, the health line and the lines show that one figure); points
    are added when a new heartbeat arrives (a repeated snapshot adds nothing). ``progress`` keeps the sessions'
    compiled calls per second and reported values (``progress.py``). A session's data goes when
    it leaves the scheduler plugin's table (its ended sessions included).
    """

    def __init__(self, history: int = SERIES_POINTS):
        self.history = history
        self._ranks: dict[tuple, _Rank] = {}  # (session, rank) -> _Rank
        self._errors: dict[str, dict] = {}  # session -> {(rank, seq, time): error row}
        self.progress = Progress(history)

    @property
    def current_rate(self) -> dict:
        """(session, rank) -> messages per second at the last heartbeat."""
        return {key: r.rate for key, r in self._ranks.items()}

    def update(self, sessions: dict, metrics: dict, now: float) -> dict:
        """``sessions``: session id -> ``{"client", "dims", "workers", "started", "streams"}`` (the scheduler plugin's
        table; ``streams`` maps stream ids to their names, the default stream 0 being ``main``; ``recordings`` and
        ``reports`` feed ``progress.py``; an ended session has ``ended``, its end time, and ``reason``, None after a
        clean exit); ``metrics``: worker address -> that worker's ``metrics["monarch"]`` (or None); ``now``:
        scheduler time (seconds).

        Returns ``{"running": bool, "shown": bool, "summary": str, "health": [dict], "sessions": columns,
        "ranks": columns (each session's stuck ranks first, then failed, then most behind: ``hosts.order``),
        "hosts": columns (``hosts.HOST_COLUMNS``: one row per host of each session), "now": columns (stuck
        first), "stacks": [dict], "errors": columns, "rates" / "queued" / "held" /
        "calls" / "reports": columns, "progress": [dict]}``; columns are dicts of equal-length lists
        (``SESSION_COLUMNS``, ``RANK_COLUMNS``, ``NOW_COLUMNS``, ``ERROR_COLUMNS``, ``RATE_COLUMNS``), health rows
        have ``HEALTH_COLUMNS``, stacks ``STACK_KEYS``, progress rows ``progress.PROGRESS_KEYS``."""
        session_rows = {c: [] for c in SESSION_COLUMNS}
        rank_rows = {c: [] for c in RANK_COLUMNS}
        now_rows = {c: [] for c in NOW_COLUMNS}
        stacks, health = [], []
        hosts = {c: [] for c in HOST_COLUMNS}
        live = set()
        failed_sessions = running = ended = 0
        for session_id, info in sorted(sessions.items(), key=lambda kv: kv[1].get("started", 0)):
            tag = session_tag(session_id)
            dims = dict(info.get("dims") or {})
            workers = list(info.get("workers") or [])
            stream_names = {"0": "main", **{str(k): v for k, v in (info.get("streams") or {}).items()}}
            failed_ranks, rank_health, progress = [], [], {}
            finishing = False
            start = len(rank_rows["rank"])
            for rank, address in enumerate(workers):
                worker = metrics.get(address) or {}
                snap = (worker.get("sessions") or {}).get(session_id)
                closed = worker.get("closed") or {}
                key = (session_id, rank)
                live.add(key)
                state = self._rank(key, worker.get("time"), snap, now, info.get("started"))
                rate = state.rate
                progress[rank] = state.progress
                rank_rows["session"].append(tag)
                rank_rows["rank"].append(rank)
                rank_rows["coords"].append(mesh_coords(dims, rank) if dims else "")
                rank_rows["worker"].append(address)
                rank_rows["rate"].append(round(rate, 1))
                flagged = False
                if snap is not None:
                    rank_rows["device"].append(snap["device"])
                    for column in ("received", "applied", "queued", "refs", "bytes"):
                        rank_rows[column].append(snap[column])
                    rank_rows["inbox"].append(snap["inbox_batches"])
                    rank_rows["streams"].append(", ".join(
                        f"{stream_names.get(str(sid)) or f's{sid}'}: {s['queued']}"
                        for sid, s in sorted(snap["streams"].items(), key=lambda kv: int(kv[0]))
                    ))
                    rank_rows["bytes_text"].append(memory_text(snap["bytes"], snap["device"]))
                    error = snap.get("last_error")
                    if snap.get("failure"):
                        rank_rows["last_error"].append(f"session failed: {snap['failure']}")
                        rank_state = "failed"
                    elif error:
                        rank_rows["last_error"].append(f"seq {error['seq']}: {error['text']}")
                        rank_state = "running"
                    else:
                        rank_rows["last_error"].append("")
                        rank_state = "running"
                    if rank_state == "running" and info.get("ended"):
                        rank_state = "ending"  # the scheduler ended it; the worker had not, at its last heartbeat
                    elif rank_state == "running" and snap.get("exiting"):
                        rank_state = "finishing"  # mesh.exit() came; the rank still runs what was sent before
                    flagged = self._now(tag, rank, snap, stream_names, now_rows, stacks)
                    self._note_errors(session_id, tag, rank, snap)
                else:
                    rank_rows["device"].append("")
                    for column in ("received", "applied", "queued", "inbox", "refs", "bytes"):
                        rank_rows[column].append(0)
                    rank_rows["streams"].append("")
                    rank_rows["bytes_text"].append("")
                    if session_id in closed:
                        failure = closed[session_id]
                        rank_state = "failed" if failure else "exited"
                        text = f"session failed: {failure}" if failure else ""
                    elif address not in metrics:
                        rank_state, text = "worker gone", f"the worker {address} left the cluster"
                    elif info.get("ended"):
                        rank_state, text = "exited", ""
                    else:
                        rank_state, text = "starting", ""  # no task of the session reached the worker yet
                    rank_rows["last_error"].append(text)
                if rank_state in ("failed", "worker gone"):
                    failed_ranks.append(rank)
                finishing = finishing or rank_state == "finishing"
                rank_rows["state"].append(rank_state)
                rank_health.append({
                    "rank": rank, "rate": rate if snap is not None else 0.0, "errors": state.count,
                    "progress": None if snap is None else snap.get("progress"), "flagged": flagged,
                    "idle": snap is None or (not snap["queued"] and not snap["inbox_batches"] and not any(
                        e["busy"] for e in snap.get("now") or ())),
                })
            lag = behind(rank_health)
            rank_rows["behind"].extend(lag)
            _permute(rank_rows, start, order(rank_health, rank_rows["state"][start:], lag))
            for column, values in host_rows(rank_rows, start, len(rank_rows["rank"]), lag, rank_health,
                                            memory_text).items():
                hosts[column].extend(values)
            self.progress.update(session_id, tag, info, {r: (metrics.get(a) or {}) for r, a in enumerate(workers)}, now)
            if info.get("ended"):
                ended += 1
                session_state = "failed" if (failed_ranks or info.get("reason")) else "ended"
                age = f"ran {format_age(info['ended'] - info.get('started', info['ended']))}"
            else:
                running += 1
                session_state = "failed" if failed_ranks else ("finishing" if finishing else "running")
                age = format_age(now - info.get("started", now))
            if failed_ranks:
                failed_sessions += 1
            reason = info.get("reason") or info.get("lost") or ""
            if failed_ranks and not reason:
                reason = f"rank {', '.join(map(str, failed_ranks))}"
            health.append(session_health(tag, session_id, session_state, reason, rank_health, progress, now, age))
            session_rows["session"].append(tag)
            session_rows["id"].append(session_id)
            session_rows["controller"].append(str(info.get("client", "")))
            session_rows["mesh"].append(" × ".join(f"{name}={size}" for name, size in dims.items()))
            session_rows["shape"].append(str(tuple(dims.values())))
            session_rows["ranks"].append(len(workers))
            session_rows["age"].append(age)
            session_rows["state"].append(
                f"failed on rank {', '.join(map(str, failed_ranks))}" if failed_ranks else session_state
            )
        for key in [k for k in self._ranks if k not in live]:
            del self._ranks[key]
        for session_id in [s for s in self._errors if s not in sessions]:
            del self._errors[session_id]
        self.progress.forget(sessions)
        if running:
            n_ranks = sum(len(info.get("workers") or ()) for info in sessions.values() if not info.get("ended"))
            summary = (f"{running} session{'s' if running != 1 else ''}, {n_ranks} rank{'s' if n_ranks != 1 else ''}"
                       + (f", {failed_sessions} failed" if failed_sessions else ""))
        else:
            summary = NO_SESSION
        if ended:
            summary += f" ({ended} ended lately, below)" if running else f" Ended lately: {ended}, below."
        return {
            "running": bool(running),
            "shown": bool(running or ended),
            "summary": summary,
            "health": health,
            "sessions": session_rows,
            "ranks": rank_rows,
            "hosts": hosts,
            "now": _stuck_first(now_rows),
            "stacks": stacks,
            "errors": self._error_rows(sessions),
            **self.progress.view(sessions),
            **{name: self._lines(rank_rows, name) for name in HISTORIES},
        }

    def _rank(self, key: tuple, worker_time, snap, now: float, started=None) -> _Rank:
        """The rank's record, with the heartbeat ``snap`` (taken at ``worker_time``) added if it is new."""
        state = self._ranks.get(key)
        if snap is None or worker_time is None:
            return state or _Rank(self.history)
        if state is None:
            state = self._ranks[key] = _Rank(self.history)
            if started and started < now:  # the lines start at the session's start, not when it was first seen
                for series in state.series.values():
                    series.add(started, 0.0)
        last = state.last
        if last is not None and worker_time <= last[0]:
            return state  # the same heartbeat as before
        received = int(snap["received"])
        state.last = (worker_time, received)
        state.count = int(snap.get("errors") or 0)
        if snap.get("progress") is not None:
            state.progress.add(now, int(snap["progress"]))
        values = {"queued": snap["queued"], "bytes": snap["bytes"]}
        rate = state.window.add(worker_time, received)
        if last is not None:
            state.rate = values["rate"] = rate
        for name, (field, _) in HISTORIES.items():
            if field in values:
                state.series[name].add(now, float(values[field]))
        return state

    def _now(self, tag, rank, snap, stream_names, rows, stacks) -> bool:
        """Add the rank's rows of what each thread applies now, and its stacks; whether a thread is flagged."""
        flagged = False
        titles = {}
        for e in snap.get("now") or ():
            stream = e["stream"]
            name = stream_names.get(stream) or (f"s{stream}" if stream.isdigit() else stream)
            message = " ".join(p for p in (e["kind"], f"seq {e['seq']}" if e["seq"] is not None else "") if p)
            if e["name"]:
                message += f": {e['name']}"
            rows["session"].append(tag)
            rows["rank"].append(rank)
            rows["stream"].append(name)
            rows["state"].append("STUCK" if e["flagged"] else ("busy" if e["busy"] else "idle"))
            rows["message"].append(message if e["busy"] else (f"last: {message}" if message else ""))
            rows["for_s"].append(e["for_s"])
            rows["for_text"].append(format_age(e["for_s"]) if e["busy"] else "")
            rows["flagged"].append(bool(e["flagged"]))
            flagged = flagged or bool(e["flagged"])
            titles[stream] = f"{tag} rank {rank}, stream {name}: " + (
                f"busy {format_age(e['for_s'])} on {message}" if e["busy"] else "idle")
        for stream, text in (snap.get("stacks") or {}).items():
            stacks.append({"session": tag, "rank": rank, "stream": stream_names.get(stream) or stream,
                           "title": titles.get(stream, f"{tag} rank {rank}, stream {stream}"), "text": text})
        return flagged

    def _note_errors(self, session_id, tag, rank, snap) -> None:
        errors = self._errors.setdefault(session_id, {})
        for e in snap.get("recent_errors") or ():
            key = (rank, e["seq"], e["time"])
            if key not in errors:
                errors[key] = {"time": e["time"] * 1000.0, "session": tag, "rank": rank, "seq": e["seq"],
                               "text": e["text"] or ""}
        while len(errors) > ERRORS_KEPT:
            del errors[min(errors, key=lambda k: k[2])]

    def _error_rows(self, sessions: dict) -> dict:
        rows = {c: [] for c in ERROR_COLUMNS}
        everything = [row for s in sessions if s in self._errors for row in self._errors[s].values()]
        for row in sorted(everything, key=lambda r: (r["time"], r["session"], r["rank"])):
            for c in ERROR_COLUMNS:
                rows[c].append(row[c])
        return rows

    def _lines(self, rank_rows: dict, name: str) -> dict:
        lines = {c: [] for c in RATE_COLUMNS}
        index = {}
        for tag, rank in zip(rank_rows["session"], rank_rows["rank"]):
            index[(tag, rank)] = len(index)
        for (session_id, rank), state in self._ranks.items():
            tag = session_tag(session_id)
            i = index.get((tag, rank), 0)
            times, values = state.series[name].view()
            lines["xs"].append([t * 1000.0 for t in times])  # milliseconds, for a datetime axis
            lines["ys"].append(values)
            lines["label"].append(f"{tag} rank {rank}")
            lines["color"].append(PALETTE[i % len(PALETTE)])
            lines["session"].append(tag)
        return lines


def _permute(columns: dict, start: int, positions: list[int]) -> None:
    """Reorder the rows from ``start`` on of ``columns`` (a dict of equal-length lists): row ``start + k`` becomes
    the row that was at ``start + positions[k]``."""
    for column in columns.values():
        tail = column[start:]
        column[start:] = [tail[i] for i in positions]


def _stuck_first(rows: dict) -> dict:
    """The page's "where each rank is now" rows, per session (in their order): stuck threads first, then the busy
    ones by how long they have been busy, then the rest, by rank."""
    sessions = {}
    for tag in rows["session"]:
        sessions.setdefault(tag, len(sessions))
    positions = sorted(range(len(rows["session"])), key=lambda i: (
        sessions[rows["session"][i]], not rows["flagged"][i], rows["state"][i] != "busy", -rows["for_s"][i],
        rows["rank"][i]))
    _permute(rows, 0, positions)
    return rows


def select(view: dict, tag: str | None) -> dict:
    """``view`` with only session ``tag``'s health, rows, lines, stacks and errors (the page's ``?session=tag``);
    ``view`` itself when ``tag`` is None."""
    if not tag:
        return view
    out = dict(view)
    for key, value in view.items():
        if isinstance(value, dict) and "session" in value:
            keep = [i for i, t in enumerate(value["session"]) if t == tag]
            out[key] = {c: [col[i] for i in keep] for c, col in value.items()}
        elif isinstance(value, list):
            out[key] = [row for row in value if row.get("session") == tag]
    out["shown"] = bool(out["health"])
    return out
