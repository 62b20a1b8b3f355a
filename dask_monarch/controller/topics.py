"""A session's Dask event topics on the controller (``Client.subscribe_topic``): the debugger's and the compile
notices' topics, one of each per session.

``Client.unsubscribe_topic`` (distributed 2026.8.0) tells the scheduler, but keeps the handler in the Client's
``_event_handlers``, so every session's handler, and all it reaches (its session: channels, answers, history,
plans) stayed alive for the Client's life: about 0.4 MB of controller memory per session (50 sessions of
/work/fastbreak/cycles.py on a 4-worker LocalCluster, 2026-12-06). ``unsubscribe`` replaces the handler with a
no-op that reaches nothing: what stays in the Client is the topic's name alone.
"""

from __future__ import annotations

__all__ = ["unsubscribe"]


def unsubscribe(client, topic: str) -> None:
    """End ``client``'s subscription to ``topic`` and drop its handler. Quiet when the client is closing or closed
    (nothing left to tell the scheduler) or when ``topic`` has no handler (it was dropped already)."""
    handlers = getattr(client, "_event_handlers", None)
    if handlers is None or topic not in handlers:
        return
    try:
        client.unsubscribe_topic(topic)
    except Exception:  # the client is closing: the scheduler forgets its subscriptions with it
        pass
    # an event the scheduler sent before it read the unsubscribe finds no handler: Dask's Client._handle_event
    # then unsubscribes once more (it raises ValueError, which the Client logs at ERROR); a no-op keeps it quiet
    # without holding the session: it reaches nothing
    handlers[topic] = _ignore


def _ignore(event) -> None:
    """The handler of an ended subscription: an event still in flight is dropped."""
