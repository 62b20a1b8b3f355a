"""The torchrun-style environment variables a session's rank sees in ``os.environ`` on its worker process.

While a session runs on a worker, ``RANK`` (the rank in the mesh), ``WORLD_SIZE`` (the mesh size), ``LOCAL_RANK``
and ``LOCAL_WORLD_SIZE`` (this rank's position among, and the count of, the session's ranks on the same host) are
set, as Monarch's and torchrun's processes have them; all four are strings of decimal integers.

Several sessions may share one worker process (they share its ``os.environ``): the session that started last
wins; when it ends, the values of the newest session still running come back, and when the last one ends, the
values from before the first session (or their absence) are restored.
"""

from __future__ import annotations

import os
import threading

__all__ = ["VARIABLES", "enter_session", "leave_session"]

VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")

_lock = threading.Lock()
_active: dict[str, dict[str, str]] = {}  # session id -> its values, in start order
_before: dict[str, str | None] = {}  # the values before the first active session (None: unset)


def _apply(values: dict) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def enter_session(session_id: str, rank: int, world_size: int, local_rank: int, local_world_size: int) -> None:
    """Set the four variables for ``session_id``'s rank (all ints >= 0). Raises ``ValueError`` for a bad value."""
    values = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": local_world_size}
    for name, value in values.items():
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"session environment: {name} must be an int >= 0, got {value!r}")
    with _lock:
        if not _active:
            _before.clear()
            _before.update({name: os.environ.get(name) for name in VARIABLES})
        _active.pop(session_id, None)
        _active[session_id] = {name: str(value) for name, value in values.items()}
        _apply(_active[session_id])


def leave_session(session_id: str) -> None:
    """Undo ``enter_session`` for ``session_id`` (idempotent): the newest running session's values, or the ones
    from before."""
    with _lock:
        if _active.pop(session_id, None) is None:
            return
        if _active:
            _apply(_active[next(reversed(_active))])
        else:
            _apply(_before)
            _before.clear()
