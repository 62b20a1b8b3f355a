"""A session's id, and the short tag that names it everywhere (issue 25 item 5): the mesh's repr, the dashboard
link's ``?session=``, log lines, task keys, thread names, the ``/monarch`` page.

A session id is 32 letters from ``g`` to ``v`` (a uuid4's hex digits spelled with those letters: 0 -> g, ...,
f -> v), and its tag is its first 8 letters: the same string wherever the session is shown, and letters only, so
that Dask's dashboard, which groups task keys by their leading words of letters and drops an 8-character word that
looks like hex (``distributed.utils.key_split``), keeps it in the group's name. An id made elsewhere (a
``Session(session_id=...)`` of a test or a tool, say a uuid's hex) is tagged by its first 8 characters with the
same spelling, so its tag is letters too.
"""

from __future__ import annotations

import uuid

__all__ = ["new_session_id", "session_tag", "compile_topic"]

_LETTERS = str.maketrans("0123456789abcdef", "ghijklmnopqrstuv")


def new_session_id() -> str:
    """A new session id: 32 letters ``g``-``v``, as random as a uuid4."""
    return uuid.uuid4().hex.translate(_LETTERS)


def session_tag(session_id: str) -> str:
    """The 8-letter tag of ``session_id``: its first 8 characters, hex digits spelled ``g``-``v`` (a session id
    made by ``new_session_id`` starts with its tag)."""
    return session_id[:8].lower().translate(_LETTERS)


def compile_topic(session_id: str) -> str:
    """The Dask event topic (``Worker.log_event``) on which the workers of session ``session_id`` report a part of a
    recording that Inductor could not compile (``worker/inductor.py``; ``controller/compile_notices.py``)."""
    return f"dask-monarch-compile-{session_id}"
