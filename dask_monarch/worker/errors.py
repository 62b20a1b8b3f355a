"""Failure classes of the tensor worker (spec §2 "Failure classes", §3).

* ``SeqError``: a value error (class V) stored in a ref table in place of a value. One object per root failure;
  dependents store the *same* object (the seed's ``Arc<SeqError>``).
* ``DependentError``: raised while resolving the inputs of an invocation when one of them holds a ``SeqError``.
* ``FatalError``: class F. It fails the session on this worker (DESIGN.md "Decisions"); the Dask worker lives on.
"""

from __future__ import annotations

from ..protocol import WorkerError

__all__ = ["SeqError", "DependentError", "FatalError", "NotImplementedYet", "ValueFailure"]


class SeqError:
    """The root failure of invocation ``seq``; ``error`` is a ``WorkerError`` (traceback text and worker id)."""

    __slots__ = ("seq", "error")

    def __init__(self, seq: int, error: WorkerError):
        self.seq = seq
        self.error = error

    def __repr__(self) -> str:
        return f"SeqError(seq={self.seq}, error={self.error.backtrace!r})"

    def __str__(self) -> str:
        return self.error.backtrace


class DependentError(Exception):
    """An input of an invocation holds the failure ``root`` (a ``SeqError``); nothing is reported for it."""

    def __init__(self, root: SeqError):
        super().__init__(f"Computation depended on an input that failed with error: {root.error.backtrace}")
        self.root = root


class ValueFailure(Exception):
    """A value error (class V) whose text is the whole report: no Python traceback would help (``ref not found``,
    ``invalid remote function``, ``unexpected number of returns``)."""


class FatalError(Exception):
    """A fatal (class F) error: the message cannot be applied and the session on this worker stops."""


class NotImplementedYet(FatalError):
    """A known ``WorkerMessage`` variant this worker does not implement yet."""

    def __init__(self, variant: str):
        super().__init__(f"not implemented yet: {variant}")
