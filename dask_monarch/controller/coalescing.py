"""``coalescing()``: send what a block produces as one ``CommandGroup`` per rank (spec §1 "Coalescing").

Inside the block every message a session would send is held back; at the outermost block's exit each session
sends, to each rank, one ``CommandGroup`` with that rank's messages in order (ranks with the same messages share
one). Nested blocks flush at the outermost exit. Fetches are refused inside a block: their answer could only
come after the block is sent.
"""

from __future__ import annotations

import contextlib
import contextvars

__all__ = ["coalescing", "held_messages", "is_coalescing", "refuse_wait"]

_held: contextvars.ContextVar = contextvars.ContextVar("dask_monarch_coalescing", default=None)


def held_messages():
    """The dict session -> held (targets, message) list of the active block, or None outside one."""
    return _held.get()


def is_coalescing() -> bool:
    return _held.get() is not None


def refuse_wait(describe: str) -> None:
    """``RuntimeError`` inside a block: an answer (a fetch, a status) could only come after the block is sent.
    Call it before sending anything for the wait, so that a refused wait leaves nothing in the block."""
    if _held.get() is not None:
        raise RuntimeError(
            f"{describe}: cannot wait for an answer inside dask_monarch.coalescing(); the block's messages are "
            "only sent at its end. Fetch after the block."
        )


@contextlib.contextmanager
def coalescing():
    """Hold the messages of this block and send them as one ``CommandGroup`` per rank at the outermost exit."""
    if _held.get() is not None:
        yield
        return
    held: dict = {}
    token = _held.set(held)
    try:
        yield
    finally:
        _held.reset(token)
        for session, items in held.items():
            session.send_group(items)
