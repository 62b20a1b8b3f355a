"""Identifiers of the tensor-worker protocol: ``Ref``, ``StreamRef`` and ``Seq``.

Source: seed ``worker.rs`` (``Ref{id: u64}``, ``StreamRef{id: u64}``, ``Seq``) and spec §2 "Types".
A ``Ref`` names a value in a stream's ref table (env); a ``StreamRef`` names a stream; a ``Seq`` is the
controller-assigned, increasing number of a message that can fail or be waited on.
"""

from __future__ import annotations

from typing import NewType

__all__ = ["Ref", "StreamRef", "Seq", "check_id"]

#: Controller-assigned sequence number of an invocation (spec §2). Plain ``int`` on the wire.
Seq = NewType("Seq", int)


def check_id(owner: str, value) -> int:
    """Return ``value`` if it is a valid u64 id, else raise ``TypeError``/``ValueError`` naming ``owner``."""
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{owner} must be an int, got {type(value).__name__} {value!r}")
        value = int(value)
    if value < 0 or value >= 1 << 64:
        raise ValueError(f"{owner} must be in [0, 2**64), got {value}")
    return value


class Ref:
    """Reference to a value held in a stream's ref table on every worker of a mesh (spec §2).

    Displayed as ``r<id>``. Equal and hashable by ``id``. Any object with a ``__monarch_ref__()``
    method returning an int is resolved like a ``Ref`` when passed to a remote function (spec §8).

    Raises ``TypeError``/``ValueError`` if ``id`` is not an int in ``[0, 2**64)``.
    """

    __slots__ = ("id",)

    def __init__(self, id: int):
        self.id = check_id("Ref.id", id)

    def __monarch_ref__(self) -> int:
        return self.id

    def __reduce__(self):
        return (Ref, (self.id,))

    def __repr__(self) -> str:
        return f"r{self.id}"

    def __eq__(self, other) -> bool:
        return type(other) is Ref and other.id == self.id

    def __hash__(self) -> int:
        return hash(("Ref", self.id))

    def __lt__(self, other: "Ref") -> bool:
        return self.id < other.id


class StreamRef:
    """Reference to a stream (one ordered queue, one thread, one ref table per worker; spec §4).

    Displayed as ``StreamRef(<id>)``. Raises ``TypeError``/``ValueError`` for a bad ``id``.
    """

    __slots__ = ("id",)

    def __init__(self, id: int):
        self.id = check_id("StreamRef.id", id)

    def __reduce__(self):
        return (StreamRef, (self.id,))

    def __repr__(self) -> str:
        return f"StreamRef({self.id})"

    def __eq__(self, other) -> bool:
        return type(other) is StreamRef and other.id == self.id

    def __hash__(self) -> int:
        return hash(("StreamRef", self.id))

    def __lt__(self, other: "StreamRef") -> bool:
        return self.id < other.id
