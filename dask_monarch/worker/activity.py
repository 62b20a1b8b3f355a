"""What each thread of a tensor worker is applying now, and for how long; the Python stacks of those busy longer
than the session's threshold (issue 18 "Where each rank is now"; spec/dask-notes.md §2 "Data feeds").

The threads keep only this for it: a ``StreamWorker`` stores the message with a seq (or the borrow step) it takes
up in ``current`` (its handlers do; ``DeleteRefs`` has no seq and never waits), the dispatcher (``TensorWorker``)
every message it applies, and both whether they are inside a batch in ``busy``: one attribute store a message, no
clock, no lock (DESIGN.md "Performance design"). Everything else happens here, when the heartbeat metric is
computed on the worker's event loop:

* a thread is on the same message as at the previous sample while ``current`` is the same object and its counter
  of messages applied is unchanged; it has been on it since the first sample that saw it, so a duration is a
  lower bound, short by at most one heartbeat interval (0.5 s on a small cluster);
* a thread busy on one message for longer than ``stuck_after`` seconds (the session option, from the controller's
  Dask config ``monarch.dashboard.stuck-after``) is *flagged*, and only then are the rank's busy threads' stacks
  read (``sys._current_frames()``), each cut to its innermost ``STACK_FRAMES`` frames and ``STACK_CHARS``
  characters, at most ``STACKS`` per rank: the heartbeat stays small and bounded.
"""

from __future__ import annotations

import sys
import time
import traceback
import weakref

from ..protocol import Cloudpickle, FunctionPath

__all__ = ["describe", "observe", "progress", "stacks", "STACK_FRAMES", "STACK_CHARS", "STACKS", "DISPATCHER"]

#: frames kept per stack (the innermost), characters per stack, stacks per rank
STACK_FRAMES = 12
STACK_CHARS = 2400
STACKS = 4
#: the key of the dispatcher thread among a rank's streams
DISPATCHER = "dispatcher"

_seen: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # thread owner -> (marker, monotonic since)


def function_name(function) -> str:
    """The name of a ``CallFunction``/``SendValue`` function: its path, or for a cloudpickled one the name of the
    function it unpickled to (from ``resolve_function``'s cache: nothing is unpickled here)."""
    if type(function) is FunctionPath:
        return function.path
    if type(function) is Cloudpickle:
        from ..protocol.function import _cache

        fn = _cache.get(function)
        if fn is None:
            return "a cloudpickled function"
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    return "" if function is None else type(function).__name__


def describe(msg) -> tuple[str, int | None, str]:
    """``(kind, seq, name)`` of a queue item of a stream or of the dispatcher: ``("CallFunction", 12,
    "__main__.train_step")``; status barriers are ``RequestStatus``, replays ``CallRecording`` (spec §2, §7)."""
    kind = type(msg).__name__
    seq = getattr(msg, "seq", None)
    name = ""
    if kind == "StatusBarrier":
        kind = "RequestStatus"
    elif kind == "ReplayCall":
        kind, name = "CallRecording", f"recording r{msg.recording.ref_id}"
    elif kind == "BorrowStep":
        kind, name = "Borrow", getattr(msg.fn, "__name__", "")
    elif kind == "StreamSegment":
        kind = "a segment of messages"
    elif hasattr(msg, "function"):
        name = function_name(msg.function)
    elif kind == "Reduce":
        name = f"{msg.reduction.name.lower()} over {', '.join(sorted(msg.dims))}"
    return kind, (seq if type(seq) is int else None), name


def _entry(owner, key: str, count: int, now: float, stuck_after: float) -> dict:
    msg = owner.current
    busy = bool(owner.busy) and msg is not None
    marker = (id(msg), count, busy)
    seen = _seen.get(owner)
    since = seen[1] if seen is not None and seen[0] == marker else now
    _seen[owner] = (marker, since)
    entry = {"stream": key, "busy": busy, "kind": "", "seq": None, "name": "", "for_s": 0.0, "flagged": False}
    if msg is not None:
        entry["kind"], entry["seq"], entry["name"] = describe(msg)
    call = getattr(owner, "replay", None)
    if busy and call is not None and msg is not call:  # an operation of a replay: the call's seq, then the operation
        kind, _, name = describe(msg)
        entry["kind"], entry["seq"] = "CallRecording", call.seq
        entry["name"] = f"recording r{call.recording.ref_id} at {kind}" + (f" {name}" if name else "")
    if busy:
        entry["for_s"] = round(now - since, 2)
        entry["flagged"] = now - since > stuck_after
    return entry


def observe(tw) -> list[dict]:
    """One entry per stream of ``tw`` (by stream id, ascending) and one for its dispatcher (``"dispatcher"``):
    ``{"stream", "busy", "kind", "seq", "name", "for_s", "flagged"}``; an idle thread shows the last message it
    applied, ``for_s`` 0. A dispatcher that waits in ``Exit`` for its streams (``TensorWorker.exiting``) is never
    flagged: the streams it waits for are, if they are stuck."""
    now = time.monotonic()
    stuck_after = tw.stuck_after
    entries = []
    for stream_id, stream in sorted(list(tw.streams.items())):
        entries.append(_entry(stream, str(stream_id), stream.applied, now, stuck_after))
    dispatcher = _entry(tw, DISPATCHER, tw.received, now, stuck_after)
    if dispatcher["flagged"] and getattr(tw, "exiting", False):
        dispatcher["flagged"] = False
    entries.append(dispatcher)
    return entries


def progress(tw, entries: list[dict]) -> int:
    """How far ``tw`` got, in the controller's seqs: one less than the smallest seq a stream is busy on, else the
    largest seq applied (at least the last ``Status``'s seq - 1). Ranks of a session compare by it."""
    busy = [e["seq"] for e in entries if e["busy"] and e["seq"] is not None and e["stream"] != DISPATCHER]
    if busy:
        return min(busy) - 1
    done = [e["seq"] for e in entries if e["seq"] is not None and e["stream"] != DISPATCHER]
    return max([tw.completed_seq - 1, *done])


def _format(frame) -> str:
    summary = traceback.StackSummary.extract(traceback.walk_stack(frame), limit=STACK_FRAMES)
    summary.reverse()
    text = "".join(summary.format()).rstrip()
    return text if len(text) <= STACK_CHARS else "…" + text[-(STACK_CHARS - 1):]


def stacks(tw, entries: list[dict]) -> dict:
    """The Python stacks of ``tw``'s busy threads if one of them is flagged, else ``{}``: stream key -> text
    (innermost frame last), flagged threads first, at most ``STACKS``."""
    if not any(e["flagged"] for e in entries):
        return {}
    threads = {str(sid): s.thread for sid, s in list(tw.streams.items())}
    threads[DISPATCHER] = tw.thread
    frames = sys._current_frames()
    out = {}
    for e in sorted((e for e in entries if e["busy"]), key=lambda e: not e["flagged"])[:STACKS]:
        thread = threads.get(e["stream"])
        frame = frames.get(getattr(thread, "ident", None))
        if frame is not None:
            out[e["stream"]] = _format(frame)
    return out
