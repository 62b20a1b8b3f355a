"""Value types carried by worker messages: ``Factory``, ``Reduction``, ``StreamCreationMode``,
``ArgsKwargs``, ``PickledValue``, ``UniqueId`` and ``WorkerError``.

Source: seed ``worker.rs`` (``Factory``, ``Reduction``/``ReduceOp``, ``StreamCreationMode``, ``ArgsKwargs``,
``SeqError``) and spec §2 "Types", §5 (reductions), §8 (``args_kwargs``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NewType

import torch

__all__ = [
    "ArgsKwargs",
    "Factory",
    "PickledValue",
    "ProtocolError",
    "Reduction",
    "StreamCreationMode",
    "UniqueId",
    "WorkerError",
]

class ProtocolError(ValueError):
    """A message or one of its fields is malformed. The text names the message type and the field."""

#: Rendezvous key of a ``BackendNetworkInit``: the controller makes one per session (the analogue of Monarch's
#: NCCL ``UniqueId``); every rank uses it as the prefix of its keys in the scheduler's key-value store.
UniqueId = NewType("UniqueId", str)

class StreamCreationMode(enum.Enum):
    """How ``CreateStream`` makes the device stream (spec §4): the device's current stream, or a new one."""

    UseDefaultStream = "UseDefaultStream"
    CreateNewStream = "CreateNewStream"

class Reduction(enum.Enum):
    """What a ``Reduce`` computes (spec §5).

    Flattens the seed's ``Reduction::Stack | Reduction::ReduceOp(Sum|Prod|Max|Min|Avg)``. ``Band``, ``Bor`` and
    ``Bxor`` are accepted too (DESIGN.md "Decisions": supported wherever the backend supports them).
    """

    Stack = "stack"
    Sum = "sum"
    Prod = "prod"
    Avg = "avg"
    Min = "min"
    Max = "max"
    Band = "band"
    Bor = "bor"
    Bxor = "bxor"

    @classmethod
    def parse(cls, value: "str | Reduction") -> "Reduction":
        """Map a user spelling (``"sum"``, ``"avg"``, ``"prod"``/``"product"``, ``"min"``, ``"max"``, ``"stack"``,
        ``"band"``, ``"bor"``, ``"bxor"``) to a member. Raises ``ValueError`` naming the bad value."""
        if isinstance(value, Reduction):
            return value
        if isinstance(value, str):
            key = value.lower()
            if key == "product":
                key = "prod"
            for member in cls:
                if member.value == key:
                    return member
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown reduction {value!r}: expected one of {choices} (or 'product')")

@dataclass(slots=True, frozen=True)
class Factory:
    """Metadata to fabricate a stand-in tensor (``zeros``/``empty``) when the real one is errored (spec §3, §5).

    ``size`` is the shape (tuple of ints), ``dtype``/``layout``/``device`` are torch's.
    """

    size: tuple
    dtype: torch.dtype
    layout: torch.layout = torch.strided
    device: torch.device = torch.device("cpu")

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Factory":
        return cls(tuple(int(s) for s in t.shape), t.dtype, t.layout, t.device)

    def zeros(self, device: torch.device | None = None) -> torch.Tensor:
        return torch.zeros(self.size, dtype=self.dtype, layout=self.layout, device=device or self.device)

    def empty(self, size=None, device: torch.device | None = None) -> torch.Tensor:
        return torch.empty(
            self.size if size is None else size, dtype=self.dtype, layout=self.layout, device=device or self.device
        )

@dataclass(slots=True)
class ArgsKwargs:
    """Positional and keyword arguments of a ``CallFunction``/``SendValue`` (spec §8).

    Monarch ships them as the cloudpickled ``(args, kwargs)`` tuple; here they travel inside the batch, which is
    pickled once per flush (cloudpickle only when plain pickle cannot). Refs (and controller tensors, which
    pickle as refs) appear as leaves and are resolved on the worker.
    """

    args: tuple = ()
    kwargs: dict = None  # type: ignore[assignment]

    def __post_init__(self):
        if self.kwargs is None:
            self.kwargs = {}

    def __reduce__(self):  # a constructor call: smaller and faster to pickle than the slots' state
        return (ArgsKwargs, (self.args, self.kwargs))

    @classmethod
    def from_wire_values(cls, args, kwargs) -> "ArgsKwargs":
        """Build from ``WireValue`` lists as the seed's ``ArgsKwargs::from_wire_values`` (convert to Python)."""
        from .wire_value import WireValue

        def conv(v):
            return v.to_python() if isinstance(v, WireValue) else v

        return cls(tuple(conv(a) for a in args), {k: conv(v) for k, v in dict(kwargs).items()})

@dataclass(slots=True, frozen=True)
class PickledValue:
    """A value pickled on its own, so that whoever cannot unpickle it fails alone, not the batch around it.

    * An argument leaf the controller pickled at call time, as Monarch pickles every call's arguments (spec §8):
      objects other than refs, tensors, meshes, numbers, strings, dtypes and devices. An unpicklable argument
      is a ``TypeError`` at the call; one the worker cannot load (its module is only on the controller, say)
      is that call's value error (spec §2 ``CallFunction`` step 1), not the whole batch's.
    * A fetched value (``FetchResult.value``) the worker pickled: one the controller cannot load (its module
      is only on the workers) fails that fetch, not every answer of the rank.

    ``type_name`` names the object's type for error messages.
    """

    data: bytes
    type_name: str

    @classmethod
    def of(cls, value, where: str) -> "PickledValue":
        """Pickle ``value``; ``TypeError`` naming ``where`` (the call) and the value's type if it cannot be."""
        import cloudpickle

        try:
            return cls(cloudpickle.dumps(value, protocol=5), type(value).__qualname__)
        except Exception as e:
            raise TypeError(
                f"{where}: an argument of type {type(value).__qualname__} cannot be pickled to send it to the "
                f"workers: {type(e).__name__}: {e}"
            ) from None

    @classmethod
    def dumps(cls, value) -> "PickledValue":
        """Pickle ``value`` (plain pickle when it can, else cloudpickle); raises what pickling raised."""
        import pickle

        import cloudpickle

        try:
            data = pickle.dumps(value, protocol=5)
        except Exception:
            data = cloudpickle.dumps(value, protocol=5)
        return cls(data, type(value).__qualname__)

    def load(self):
        """The value; raises what unpickling raised (callers say where it happened)."""
        import cloudpickle

        return cloudpickle.loads(self.data)


@dataclass(slots=True, frozen=True)
class WorkerError:
    """The error of a failed invocation as the controller sees it (seed ``WorkerError``).

    ``backtrace`` is the remote Python traceback text; ``worker_actor_id`` names the worker and rank
    (``"<dask worker address>/rank<r>"``).
    """

    backtrace: str
    worker_actor_id: str

    def __str__(self) -> str:
        return self.backtrace

