"""What the tensor workers of one Dask worker are doing, as numbers (spec/dask-notes.md §2 "Data feeds").

``worker_snapshot`` is the Dask worker metric ``worker.metrics["monarch"]``: Dask calls it on the worker's event
loop at every heartbeat and the scheduler keeps the result in ``scheduler.workers[address].metrics["monarch"]``,
where the dashboard page reads it. The Prometheus collector (``worker/prometheus.py``) reads the same snapshot.

Everything here is computed when asked, from counters the tensor worker keeps anyway (``TensorWorker.received``,
``StreamWorker.enqueued``/``applied``, ref tables), so the per-message path does no extra work. The threads that
change those counters run concurrently; each number is read once and may be a moment old, never torn.
"""

from __future__ import annotations

import time

import torch

from . import activity

__all__ = ["worker_snapshot", "session_snapshot", "held_bytes", "summary"]

_CLOSED_SHOWN = 16  # ended sessions reported (with their failure, if any), newest last
_SUMMARY_CHARS = 300


def _copy(view) -> list:
    """A list of a dict view that another thread may change meanwhile."""
    for _ in range(10):
        try:
            return list(view)
        except RuntimeError:  # changed size during iteration
            continue
    return []


def summary(text: str | None) -> str | None:
    """One line for an error report: its first line, and its last line when they differ (a traceback's
    exception), at most 300 characters; of a bare traceback (``Traceback (most recent call last): ...``) only
    its last line, the exception."""
    if not text:
        return text
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    if lines[0].startswith("Traceback (most recent call last)"):  # a bare traceback: its exception says it all
        lines = lines[-1:]
    line = lines[0] if len(lines) == 1 or lines[-1] == lines[0] else f"{lines[0]} … {lines[-1]}"
    return line if len(line) <= _SUMMARY_CHARS else line[: _SUMMARY_CHARS - 1] + "…"


def held_bytes(tw) -> int:
    """Bytes held by the session's refs: CUDA memory allocated on its device on a GPU worker (what the caching
    allocator counts as in use), else the sizes of the distinct tensor storages in its ref tables."""
    device = tw.device
    if device.type == "cuda":
        try:
            return int(torch.cuda.memory_allocated(device))
        except Exception:
            return 0
    seen = set()
    total = 0
    for stream in _copy(tw.streams.values()):
        for value in _copy(stream.env.values()):
            if isinstance(value, torch.Tensor):
                try:
                    storage = value.untyped_storage()
                    key = (storage.data_ptr(), storage.device)
                    if key not in seen:
                        seen.add(key)
                        total += storage.nbytes()
                except Exception:  # sparse and other tensors without one storage
                    total += value.element_size() * value.nelement()
    return total


def session_snapshot(tw, with_stacks: bool = True) -> dict:
    """The numbers of one ``TensorWorker`` (one rank of one session). ``now``: what each stream and the
    dispatcher is applying and for how long (``activity.observe``); ``progress``: the rank's position in seqs
    (``activity.progress``); ``stacks``: its busy threads' Python stacks while one is flagged, else ``{}``
    (``activity.stacks``; left out when ``with_stacks`` is false); ``exiting``: the session is ending here and waits
    for its streams to finish (``TensorWorker.exiting``); ``recordings``: per recording (ref id), the replays that
    ran to their end (the dashboard's compiled calls per second); ``recent_errors``: the newest root failures as
    ``{"time": wall clock s, "seq", "text": summary}``."""
    streams = {}
    applied = queued = refs = 0
    for stream_id, stream in _copy(tw.streams.items()):
        done = stream.applied  # read before ``enqueued``: a backlog is never negative
        backlog = max(0, stream.enqueued - done)
        n_refs = len(stream.env)
        streams[str(stream_id)] = {"applied": done, "queued": backlog, "batches": stream.backlog(), "refs": n_refs}
        applied += done
        queued += backlog
        refs += n_refs
    last = tw.last_error
    now = activity.observe(tw)
    return {
        "rank": tw.rank,
        "world_size": tw.world_size,
        "device": str(tw.device),
        "received": tw.received,
        "applied": applied,
        "queued": queued,
        "inbox_batches": tw.inbox.waiting(),
        "streams": streams,
        "refs": refs,
        "bytes": held_bytes(tw),
        "status_seq": tw.completed_seq,
        "errors": tw.errors,
        "last_error": None if last is None else {"seq": last[0], "text": summary(last[1])},
        "failure": summary(tw.failure),
        "exiting": tw.exiting,
        "now": now,
        "progress": activity.progress(tw, now),
        "stacks": activity.stacks(tw, now) if with_stacks else {},
        "recent_errors": [{"time": t, "seq": seq, "text": summary(text)} for t, seq, text in _copy(tw.recent_errors)],
        "recordings": {str(rid): r.replayed for rid, r in _copy(tw.recordings.complete.items())},
    }


def worker_snapshot(plugin, with_stacks: bool = True) -> dict:
    """The heartbeat metric: ``{"time": worker clock, "sessions": {session id: session_snapshot},
    "closed": {session id: failure summary or None}}`` for the sessions that ended here most recently."""
    sessions = {}
    for session_id, tw in _copy(plugin.sessions.items()):
        sessions[session_id] = session_snapshot(tw, with_stacks)
    closed = _copy(plugin.closed.items())[-_CLOSED_SHOWN:]
    return {
        "time": time.time(),
        "sessions": sessions,
        "closed": {session_id: summary(failure) for session_id, failure in closed},
    }
