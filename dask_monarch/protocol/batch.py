"""How the messages of one batch (one Dask task; DESIGN.md "Seed concept -> Dask concept") travel: segments.

A batch is a list of segments, each pickled once on the controller and shared by every rank it goes to:

* ``bytes``: messages for the worker's dispatcher, which applies them in order;
* ``(stream_id, count, bytes)``: ``count`` consecutive messages that all run on stream ``stream_id`` and touch
  nothing else (``STREAM_MESSAGES``). The dispatcher hands the bytes to that stream unopened, and the stream's
  thread unpickles and runs them: the dispatcher thread then does not compete with the stream thread for the
  GIL message by message (DESIGN.md "Performance design": the worker's per-message cost is the budget).

Either way the messages of a segment run in order, and segments in batch order, so the order of a stream's
messages is the controller's.
"""

from __future__ import annotations

from .messages import CallFunction, Reduce, SendValue
from .refs import StreamRef

__all__ = ["STREAM_MESSAGES", "lane", "segments", "targeted"]

#: messages whose whole effect is on their own ``stream``: they may travel in a stream's segment
STREAM_MESSAGES = (CallFunction, SendValue, Reduce)


def lane(msg) -> int | None:
    """The stream id whose segment ``msg`` may travel in, or None for a dispatcher segment. A stream message whose
    ``stream`` is not a ``StreamRef`` (changed after construction) travels to the dispatcher, whose unpickling
    check names the field: picking its lane must not fail on the controller."""
    if type(msg) in STREAM_MESSAGES:
        stream = getattr(msg, "stream", None)
        if type(stream) is StreamRef:
            return stream.id
    return None


def segments(items: list, dumps) -> list:
    """``[(targets, segment)]`` for ``items``, a list of ``(targets, message)``: consecutive messages with the same
    targets and the same ``lane`` form one segment, pickled with ``dumps`` (a list of messages -> bytes). One pass,
    with ``lane`` inlined for the common case (a stream message with a ``StreamRef``): the flusher runs this on
    every message under the session lock, which the program's next operation waits for (issue 13)."""
    out = []
    run: list = []
    key = None
    for targets, msg in items:
        if type(msg) in STREAM_MESSAGES and type(stream := getattr(msg, "stream", None)) is StreamRef:
            k = (targets, stream.id)
        else:
            k = (targets, None)
        if k != key:
            if run:
                _close(out, key, run, dumps)
            key, run = k, []
        run.append(msg)
    if run:
        _close(out, key, run, dumps)
    return out


def _close(out: list, key: tuple, run: list, dumps) -> None:
    targets, stream_id = key
    blob = dumps(run)
    out.append((targets, blob if stream_id is None else (stream_id, len(run), blob)))


def targeted(items: list, everyone: tuple) -> tuple | None:
    """The ranks that ``items`` (``(targets, message)``) go to, sorted, or None if one of them goes to ``everyone``
    (the session's every rank). A sync flush tells the host relays which ranks get more than its ``RequestStatus``:
    the relay may answer it for the others, those that had passed all they were sent (``worker/relay.py``, "Quiet
    ranks")."""
    ranks: set = set()
    for targets, _ in items:
        if targets is everyone:
            return None
        ranks.update(targets)
    return tuple(sorted(ranks))
