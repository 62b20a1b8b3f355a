"""The ``/monarch`` page's progress row (issue 25 item 6): what the program itself is getting done, per session.

* **Compiled calls per second**, per compiled function (``dask_monarch.compile``): the replays of its recordings
  that have run to their end on every rank that has them (each rank counts its own, ``worker/metrics.py``
  ``recordings``; the controller names each recording by its function, ``monarch_session_recording``), as a rate
  over ``history.RATE_WINDOW`` seconds;
* **reported values**: the last value of each name the program reports with ``dask_monarch.report(loss=...)``
  (``controller/report.py``; the scheduler plugin stamps them with its clock, ``monarch_session_report``) and its
  history.

Both are lines from the session's start (``history.Series``), one per (session, function) and (session, name),
and one line of text per session. Pure Python, tested on its own (tests/test_dashboard_watch.py).
"""

from __future__ import annotations

from .history import LINE_COLUMNS, PALETTE, Series, WindowRate

__all__ = ["Progress", "PROGRESS_KEYS", "REPORT_COLUMNS"]

#: the keys of a progress row (one per session with compiled calls or reports)
PROGRESS_KEYS = ("session", "text")
#: the columns of the reported values' lines: a plot's, and the name reported (the page plots each on its own)
REPORT_COLUMNS = (*LINE_COLUMNS, "name")


class _Calls:
    __slots__ = ("window", "series", "heartbeats", "rate", "count")

    def __init__(self, limit: int):
        self.window = WindowRate()
        self.series = Series("mean", limit)
        self.heartbeats = None  # the heartbeat times the count was taken from
        self.rate = 0.0
        self.count = 0


class _Reported:
    __slots__ = ("series", "last", "value")

    def __init__(self, limit: int):
        self.series = Series("mean", limit)
        self.last = None  # scheduler time of the newest point taken
        self.value = None


class Progress:
    """Per session: compiled calls per second of each compiled function, and the values the program reported
    (see the module's docstring); ``limit`` points per line."""

    def __init__(self, limit: int):
        self.limit = limit
        self._calls: dict[tuple, _Calls] = {}  # (session id, function name) -> _Calls
        self._reports: dict[tuple, _Reported] = {}  # (session id, name) -> _Reported
        self._tags: dict[str, str] = {}

    def update(self, session_id: str, tag: str, info: dict, workers: dict, now: float) -> None:
        """Take session ``session_id``'s new numbers: ``info`` is its entry in the scheduler plugin's table (its
        ``recordings``: ref id -> function name; its ``reports``: name -> ``[(time, value)]``), ``workers`` maps each
        rank to its worker's heartbeat metric (``{"time", "sessions"}``), ``now`` is the scheduler's time."""
        self._tags[session_id] = tag
        by_name: dict = {}
        for rid, name in (info.get("recordings") or {}).items():
            by_name.setdefault(name, []).append(str(rid))
        for name, rids in by_name.items():
            counts, heartbeats = [], []
            for rank, worker in workers.items():
                snap = (worker.get("sessions") or {}).get(session_id) or {}
                replayed = snap.get("recordings") or {}
                mine = [replayed[r] for r in rids if r in replayed]
                if mine:
                    counts.append(sum(mine))
                    heartbeats.append((rank, worker.get("time")))
            if not counts:
                continue
            calls = self._calls.get((session_id, name))
            if calls is None:
                calls = self._calls[(session_id, name)] = _Calls(self.limit)
            if heartbeats != calls.heartbeats:  # a new heartbeat: a new sample (the page may ask more often)
                calls.heartbeats = heartbeats
                calls.count = min(counts)  # calls every rank that runs the function has finished
                calls.rate = calls.window.add(now, calls.count)
                calls.series.add(now, calls.rate)
        for name, points in (info.get("reports") or {}).items():
            reported = self._reports.get((session_id, name))
            if reported is None:
                reported = self._reports[(session_id, name)] = _Reported(self.limit)
            for t, value in list(points):
                if reported.last is None or t > reported.last:
                    reported.series.add(t, value)
                    reported.last, reported.value = t, value

    def forget(self, sessions: dict) -> None:
        """Drop what is kept of sessions no longer in ``sessions``."""
        for table in (self._calls, self._reports):
            for key in [k for k in table if k[0] not in sessions]:
                del table[key]
        for session_id in [s for s in self._tags if s not in sessions]:
            del self._tags[session_id]

    def view(self, sessions: dict) -> dict:
        """``{"calls": lines, "reports": lines, "progress": [row]}``: lines are columns (``LINE_COLUMNS``; the
        reports' ``REPORT_COLUMNS``) with one row per (session, function) or (session, name), xs in milliseconds; rows ``PROGRESS_KEYS``, one per
        session that has compiled calls or reports, in the order of ``sessions``."""
        calls, reports = _lines(), _lines(REPORT_COLUMNS)
        texts: dict = {}
        for i, ((session_id, name), c) in enumerate(self._calls.items()):
            tag = self._tags[session_id]
            _line(calls, c.series, f"{tag} {name}", tag, i)
            texts.setdefault(session_id, []).append(f"{name} {c.rate:,.1f} calls/s ({c.count:,} calls)")
        for i, ((session_id, name), r) in enumerate(self._reports.items()):
            tag = self._tags[session_id]
            _line(reports, r.series, f"{tag} {name} = {r.value:.4g}", tag, i)
            reports["name"].append(name)
            texts.setdefault(session_id, []).append(f"{name} {r.value:.4g}")
        rows = [{"session": self._tags[s], "text": f"{self._tags[s]}: " + " · ".join(texts[s])}
                for s in sessions if s in texts]
        return {"calls": calls, "reports": reports, "progress": rows}


def _lines(columns=LINE_COLUMNS) -> dict:
    return {c: [] for c in columns}


def _line(lines: dict, series: Series, label: str, tag: str, i: int) -> None:
    times, values = series.view()
    lines["xs"].append([t * 1000.0 for t in times])  # milliseconds, for a datetime axis
    lines["ys"].append(values)
    lines["label"].append(label)
    lines["color"].append(PALETTE[i % len(PALETTE)])
    lines["session"].append(tag)
