"""Keys of the Dask tasks that carry a session's messages, named for the dashboard's Task Stream and Progress
panels (spec/dask-notes.md §2).

A key reads ``monarch-<kind>-<session tag>-<rank>-<batch>``. The dashboard groups tasks by
``distributed.utils.key_split(key)``, which keeps the leading words made only of letters (and drops an 8-letter
word that looks like hex), so every (kind, session) pair is one group: ``monarch-messages-kqhrtgvn``,
``monarch-fetch-kqhrtgvn``, ... The session tag is the first 8 hex digits of the session id spelled with the
letters g-v (0 -> g, ..., f -> v): letters only, never mistaken for hex, and one to one with ``id[:8]``.

Kinds:

* ``messages``: a batch of messages handed to a rank's inbox (``deliver_batch``; returns at once);
* ``fetch``: a batch ending with ``RequestStatus`` that a ``fetch_shard`` waits for (``sync_batch``);
* ``status``: the same for any other wait (``Session.sync``);
* ``exit``: the batch that ends the session on a rank (``mesh.exit()``, or ``Exit`` after a failure).
"""

from __future__ import annotations

__all__ = ["KINDS", "session_tag", "task_key", "parse_task_key"]

KINDS = ("messages", "fetch", "status", "exit")
_LETTERS = str.maketrans("0123456789abcdef", "ghijklmnopqrstuv")
_HEX = str.maketrans("ghijklmnopqrstuv", "0123456789abcdef")


def session_tag(session_id: str) -> str:
    """The letters-only tag of a session (``session_id`` is a uuid4 hex string)."""
    return session_id[:8].lower().translate(_LETTERS)


def task_key(kind: str, session_id: str, rank: int, batch: int) -> str:
    """The key of rank ``rank``'s batch number ``batch`` of session ``session_id``, a task of ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"task kind must be one of {KINDS}, got {kind!r}")
    return f"monarch-{kind}-{session_tag(session_id)}-{rank}-{batch}"


def parse_task_key(key: str) -> tuple[str, str, int, int] | None:
    """``(kind, session id prefix (8 hex digits), rank, batch)`` of a key made by ``task_key``, else None."""
    parts = key.split("-") if isinstance(key, str) else ()
    if len(parts) != 5 or parts[0] != "monarch" or parts[1] not in KINDS:
        return None
    try:
        return parts[1], parts[2].translate(_HEX), int(parts[3]), int(parts[4])
    except ValueError:
        return None
