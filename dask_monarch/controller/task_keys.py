"""Keys of the Dask tasks that carry a session's messages, named for the dashboard's Task Stream and Progress
panels (spec/dask-notes.md §2).

A key reads ``monarch-<session>-<kind>-<rank>-<batch>``: like every other name of a session (its threads
``monarch-<session>-stream0``, ``monarch-<session>-socket-r1``, ...; its actors ``monarch-<session>-actor-...``),
it starts with ``monarch-`` and the session's tag (``protocol/session_id.py``: the 8 letters the mesh's repr, the
dashboard link and the logs show). The dashboard groups tasks by ``distributed.utils.key_split(key)``, which keeps
the leading words made only of letters, so every (session, kind) pair is one group: ``monarch-kqhrtgvn-messages``,
``monarch-kqhrtgvn-fetch``, ...

Kinds:

* ``messages``: a batch of messages handed to a rank's inbox (``deliver_batch``; returns at once);
* ``fetch``: a batch ending with ``RequestStatus`` that a ``fetch_shard`` waits for (``sync_batch``);
* ``status``: the same for any other wait (``Session.sync``);
* ``exit``: the batch that ends the session on a rank (``mesh.exit()``, or ``Exit`` after a failure).
"""

from __future__ import annotations

from ..protocol.session_id import session_tag

__all__ = ["KINDS", "session_tag", "task_key", "parse_task_key"]

KINDS = ("messages", "fetch", "status", "exit")


def task_key(kind: str, session_id: str, rank: int, batch: int) -> str:
    """The key of rank ``rank``'s batch number ``batch`` of session ``session_id``, a task of ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"task kind must be one of {KINDS}, got {kind!r}")
    return f"monarch-{session_tag(session_id)}-{kind}-{rank}-{batch}"


def parse_task_key(key: str) -> tuple[str, str, int, int] | None:
    """``(kind, session tag, rank, batch)`` of a key made by ``task_key``, else None."""
    parts = key.split("-") if isinstance(key, str) else ()
    if len(parts) != 5 or parts[0] != "monarch" or parts[2] not in KINDS:
        return None
    try:
        return parts[2], parts[1], int(parts[3]), int(parts[4])
    except ValueError:
        return None
