"""What the workers say about recordings compiled by Inductor (``compile(fn, backend="inductor")``).

A worker that cannot compile part of a recording with Inductor replays that part as Python and logs a Dask event
(``Worker.log_event``) on the session's topic ``compile_topic(session id)`` (``worker/inductor.py``). The controller
subscribes to that topic (``Client.subscribe_topic``) for each session that has such a recording; the handler (on
the client's event loop) keeps the reason for the compiled function that made the recording, and that function's
next call raises it as one ``RuntimeWarning`` in the caller's thread. The subscription ends with the session.
"""

from __future__ import annotations

import threading
import warnings
import weakref

from ..protocol.session_id import compile_topic
from .topics import unsubscribe

__all__ = ["BACKENDS", "fallbacks", "warn_fallbacks", "watch"]

#: ``compile(backend=...)`` values
BACKENDS = frozenset((None, "inductor"))

#: id of a compiled function -> reasons reported by its ranks, not yet warned about
fallbacks: dict = {}
_owners: dict = {}  # (session id, recording ref id) -> weak reference to the compiled function
_sessions: dict = {}  # session id -> the session (subscribed)
_lock = threading.Lock()


def watch(recording, compiled) -> None:
    """Report what the ranks say about ``recording`` (made by ``compiled``) at ``compiled``'s next call."""
    session = recording.session
    with _lock:
        _owners[(session.id, recording.ref.id)] = weakref.ref(compiled)
        if session.id in _sessions:
            return
        _sessions[session.id] = session
    session.on_stop.append(lambda: _forget(session.id, session))
    session.client.subscribe_topic(compile_topic(session.id), _handler(session.id))


def _forget(sid: str, session) -> None:
    """The session stopped: drop what was kept for it and end its subscription."""
    with _lock:
        _sessions.pop(sid, None)
        for key in [k for k in _owners if k[0] == sid]:
            del _owners[key]
    unsubscribe(session.client, compile_topic(sid))


def _handler(sid: str):
    def handle(event) -> None:
        _, msg = event
        with _lock:
            owner = _owners.get((sid, msg.get("recording")))
            compiled = owner() if owner is not None else None
            if compiled is not None:
                fallbacks.setdefault(id(compiled), []).append(msg.get("reason", "?"))

    return handle


def warn_fallbacks(compiled) -> None:
    """Warn once for each reason reported for ``compiled`` since its last call."""
    with _lock:
        reasons = fallbacks.pop(id(compiled), ())
    for reason in dict.fromkeys(reasons):
        warnings.warn(f"compiled function {compiled.name}: {reason}", RuntimeWarning, stacklevel=3)
