"""``coalescing()``: send what a block produces as one ``CommandGroup`` per rank (spec §1 "Coalescing").

Inside the block every message a session would send is held back; at the outermost block's exit each session
sends, to each rank, one ``CommandGroup`` with that rank's messages in order (ranks with the same messages share
one). Nested blocks flush at the outermost exit. Fetches are refused inside a block: their answer could only
come after the block is sent. The same holds while a compiled function records (``compile.py``): fetches and
``coalescing()`` are refused there.
"""

from __future__ import annotations

import contextlib
import contextvars

__all__ = ["HeldDelete", "coalescing", "compiling", "held_messages", "is_coalescing", "recording_block", "refuse_wait"]

_held: contextvars.ContextVar = contextvars.ContextVar("dask_monarch_coalescing", default=None)
_compiling: contextvars.ContextVar = contextvars.ContextVar("dask_monarch_compiling", default=None)


class HeldDelete(tuple):
    """A ref dropped inside a ``coalescing()`` block, held with the block's messages (``Session.drop_ref``): it
    is freed after them (``Session.send_group``)."""

    __slots__ = ()

    def __new__(cls, ref_id: int):
        return super().__new__(cls, (ref_id,))

    @property
    def ref(self) -> int:
        return self[0]


def compiling() -> str | None:
    """The name of the compiled function recording in this context, or None."""
    return _compiling.get()


@contextlib.contextmanager
def recording_block(name: str):
    """Mark this context as recording compiled function ``name`` (``compile.py``)."""
    token = _compiling.set(name)
    try:
        yield
    finally:
        _compiling.reset(token)


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
    name = _compiling.get()
    if name is not None:
        raise RuntimeError(
            f"{describe}: cannot wait for an answer inside compiled function {name}: its operations are recorded "
            "and run only when it is called. Return the value from the function and fetch it after the call."
        )


@contextlib.contextmanager
def coalescing():
    """Hold the messages of this block and send them as one ``CommandGroup`` per rank at the outermost exit.
    ``RuntimeError`` inside a compiled function (its messages already travel as one recording)."""
    name = _compiling.get()
    if name is not None:
        raise RuntimeError(
            f"coalescing() inside compiled function {name}: a compiled function's operations already travel as one "
            "recording; remove the coalescing() block"
        )
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
