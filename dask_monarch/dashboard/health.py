"""One line per session at the top of the ``/monarch`` page: is it healthy, and which rank is behind (issue 18
"Health at a glance").

* state: ``running``, ``finishing`` (``mesh.exit()`` came and a rank still runs what was sent before it),
  ``failed`` (a rank failed, a worker left, or the controller ended it with an error) or ``ended`` (a clean exit);
* the overall message rate (messages received per second, summed over the ranks);
* the slowest rank and how far behind the fastest it is: ranks compare by ``progress`` (the heartbeat's position
  in the controller's seqs, ``worker/activity.py``); a rank that is idle with nothing queued has caught up and is
  never the slowest (a rank outside a sub-mesh does not receive that sub-mesh's seqs). In seconds: how long ago
  the fastest rank got past the slowest one's position (from each rank's progress history, to a heartbeat);
* the number of remote errors (root failures reported by the ranks, ``RemoteFunctionFailed``), and the ranks
  flagged as busy on one message for longer than the session's ``stuck_after``.
"""

from __future__ import annotations

from collections import deque

__all__ = ["RankProgress", "HEALTH_COLUMNS", "session_health", "health_text"]

HEALTH_COLUMNS = ("session", "id", "state", "reason", "rate", "slowest", "fastest", "behind_seqs", "behind_s",
                  "errors", "flagged", "ranks", "age", "text")
_STEPS = 256


class RankProgress:
    """A rank's progress over time: ``(scheduler time, progress)`` each time it grew, the newest ``_STEPS``."""

    __slots__ = ("steps",)

    def __init__(self):
        self.steps: deque = deque(maxlen=_STEPS)

    def add(self, t: float, progress: int) -> None:
        if not self.steps or progress > self.steps[-1][1]:
            self.steps.append((t, progress))

    def passed(self, progress: int) -> float | None:
        """When this rank first got beyond ``progress`` (its oldest step kept, if all are), or None."""
        for t, p in self.steps:
            if p > progress:
                return t
        return None


def session_health(tag: str, session_id: str, state: str, reason: str, ranks: list[dict],
                   progress: dict, now: float, age: str) -> dict:
    """The health of one session. ``ranks``: per rank ``{"rank", "rate", "progress", "idle", "errors",
    "flagged"}`` (``progress`` None without a heartbeat); ``progress``: rank -> ``RankProgress``."""
    known = [r for r in ranks if r["progress"] is not None]
    slowest = fastest = None
    behind_seqs, behind_s = 0, 0.0
    if known and state in ("running", "finishing"):
        fast = max(known, key=lambda r: (r["progress"], -r["rank"]))
        waiting = [r for r in known if not r["idle"]]
        if waiting:
            slow = min(waiting, key=lambda r: (r["progress"], not r["flagged"], r["rank"]))
            if fast["progress"] > slow["progress"]:
                slowest, fastest = slow["rank"], fast["rank"]
                behind_seqs = fast["progress"] - slow["progress"]
                passed = progress[fast["rank"]].passed(slow["progress"]) if fast["rank"] in progress else None
                behind_s = round(max(0.0, now - passed), 1) if passed is not None else 0.0
    row = {
        "session": tag, "id": session_id, "state": state, "reason": reason or "",
        "rate": round(sum(r["rate"] for r in ranks), 1), "slowest": slowest, "fastest": fastest,
        "behind_seqs": behind_seqs, "behind_s": behind_s, "errors": sum(r["errors"] for r in ranks),
        "flagged": [r["rank"] for r in ranks if r["flagged"]], "ranks": len(ranks), "age": age,
    }
    row["text"] = health_text(row)
    return row


def health_text(h: dict) -> str:
    """``kqhrtgvn running · 2 ranks · 1,234.5 msg/s · slowest rank 1: 3 seqs, 12.4 s behind rank 0 · 1 remote
    error · stuck: rank 1 · 5m 02s``."""
    parts = [f"{h['session']} {h['state']}" + (f" ({h['reason']})" if h["reason"] else ""),
             f"{h['ranks']} rank{'s' if h['ranks'] != 1 else ''}"]
    if h["state"] in ("running", "finishing"):
        parts.append(f"{h['rate']:,.1f} msg/s")
        if h["slowest"] is None:
            parts.append("no rank behind")
        else:
            parts.append(f"slowest rank {h['slowest']}: {h['behind_seqs']} seq{'s' if h['behind_seqs'] != 1 else ''}"
                         f", {h['behind_s']:.1f} s behind rank {h['fastest']}")
    parts.append(f"{h['errors']} remote error{'s' if h['errors'] != 1 else ''}")
    if h["flagged"]:
        parts.append("stuck: rank " + ", ".join(map(str, h["flagged"])))
    parts.append(h["age"])
    return " · ".join(parts)
