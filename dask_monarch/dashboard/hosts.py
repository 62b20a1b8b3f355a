"""The ``/monarch`` page at many ranks (issue 23 item 8): a summary row per (session, host), and each session's
ranks in the order that needs a look first.

* ``order``: a session's rank rows with the stuck ranks first (a thread busy on one message past the session's
  ``stuck_after``), then the failed ones (failed, worker gone), then by how far behind the session's fastest
  rank they are (``behind``: seqs, from the heartbeats' ``progress``; a rank idle with nothing queued has caught
  up), then by rank. Equal ranks keep their rank order.
* ``host_rows``: per host of a session (the host of each rank's worker address), its ranks, how many run, are
  stuck or failed, their messages per second (sum), messages queued (sum), memory held (sum), the most seqs a
  rank there is behind and which rank, its remote errors (sum), and a state: ``failed`` if a rank there failed,
  ``stuck`` if one is stuck, else the most common state of its ranks.

Pure Python on the data source's columns (``data.RANK_COLUMNS``), tested with ``DashboardData``
(tests/test_dashboard.py).
"""

from __future__ import annotations

from collections import Counter

__all__ = ["HOST_COLUMNS", "FAILED_STATES", "behind", "host_of", "host_rows", "order"]

HOST_COLUMNS = ("session", "host", "ranks", "running", "stuck", "failed", "rate", "queued", "bytes", "bytes_text",
                "behind", "slowest", "errors", "state")
FAILED_STATES = ("failed", "worker gone")


def host_of(address: str) -> str:
    """The host of a worker address (``tcp://10.0.0.2:4321`` -> ``10.0.0.2``); the address itself if it has
    none."""
    from distributed.comm import get_address_host

    try:
        return get_address_host(address)
    except Exception:
        return address


def behind(health: list[dict]) -> list[int]:
    """Per rank of one session (its ``session_health`` rows, in rank order): seqs behind the session's fastest
    rank; 0 for a rank without a heartbeat, or idle with nothing queued."""
    known = [h["progress"] for h in health if h["progress"] is not None]
    if not known:
        return [0] * len(health)
    fastest = max(known)
    return [0 if h["progress"] is None or h["idle"] else fastest - h["progress"] for h in health]


def order(health: list[dict], states: list[str], lag: list[int]) -> list[int]:
    """The positions of one session's ranks (lists in rank order) in the order the page lists them: stuck, then
    failed, then most behind, then by rank."""
    return sorted(range(len(states)), key=lambda i: (
        not health[i]["flagged"], states[i] not in FAILED_STATES, -lag[i], i))


def host_rows(rows: dict, start: int, stop: int, lag: list[int], health: list[dict], format_bytes) -> dict:
    """``HOST_COLUMNS`` for the rank rows ``rows[c][start:stop]`` of one session (``lag``, ``health``: per rank of
    that session, by rank), one row per host in the order its first rank comes in those rows."""
    out = {c: [] for c in HOST_COLUMNS}
    groups: dict = {}
    for i in range(start, stop):
        groups.setdefault(host_of(rows["worker"][i]), []).append(i)
    for host, members in groups.items():
        ranks = [rows["rank"][i] for i in members]
        states = [rows["state"][i] for i in members]
        stuck = sum(1 for r in ranks if health[r]["flagged"])
        failed = sum(1 for s in states if s in FAILED_STATES)
        worst = max(ranks, key=lambda r: (lag[r], -r))
        total = sum(rows["bytes"][i] for i in members)
        device = next((rows["device"][i] for i in members if rows["device"][i]), "")
        state = "failed" if failed else ("stuck" if stuck else Counter(states).most_common(1)[0][0])
        for column, value in (
            ("session", rows["session"][members[0]]), ("host", host), ("ranks", len(members)),
            ("running", sum(1 for s in states if s == "running")), ("stuck", stuck), ("failed", failed),
            ("rate", round(sum(rows["rate"][i] for i in members), 1)),
            ("queued", sum(rows["queued"][i] for i in members)), ("bytes", total),
            ("bytes_text", format_bytes(total, device) if device else ""),
            ("behind", lag[worst]), ("slowest", worst if lag[worst] else None),
            ("errors", sum(health[r]["errors"] for r in ranks)), ("state", state),
        ):
            out[column].append(value)
    return out
