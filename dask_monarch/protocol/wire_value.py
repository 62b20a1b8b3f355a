"""``WireValue``: the typed values of the test messages ``SetRefUnitTestsOnly`` / ``GetRefUnitTestsOnly``.

Source: spec §8 "WireValue variants" and §2 "Test-only". Variants, in the seed's order (``Bool`` precedes
``Int``): Bool, Int, Double, String, Ref, IntList, RefList, Device, Layout, ScalarType, MemoryFormat, None,
PyObject (pickled bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch

from .refs import Ref
from .types import ProtocolError

__all__ = ["WireValue", "KINDS"]

KINDS = (
    "Bool",
    "Int",
    "Double",
    "String",
    "Ref",
    "IntList",
    "RefList",
    "Device",
    "Layout",
    "ScalarType",
    "MemoryFormat",
    "None",
    "PyObject",
)

_CHECKS = {
    "Bool": lambda v: type(v) is bool,
    "Int": lambda v: type(v) is int,
    "Double": lambda v: type(v) is float,
    "String": lambda v: type(v) is str,
    "Ref": lambda v: type(v) is Ref,
    "IntList": lambda v: isinstance(v, list) and all(type(x) is int for x in v),
    "RefList": lambda v: isinstance(v, list) and all(type(x) is Ref for x in v),
    "Device": lambda v: isinstance(v, torch.device),
    "Layout": lambda v: isinstance(v, torch.layout),
    "ScalarType": lambda v: isinstance(v, torch.dtype),
    "MemoryFormat": lambda v: isinstance(v, torch.memory_format),
    "None": lambda v: v is None,
    "PyObject": lambda v: isinstance(v, bytes),
}


@dataclass(slots=True, frozen=True)
class WireValue:
    """One typed value. ``kind`` is a variant name from ``KINDS``; ``value`` its Python payload
    (``PyObject`` holds pickled bytes). Raises ``ProtocolError`` naming the kind when they disagree."""

    kind: str
    value: Any = None

    def __post_init__(self):
        check = _CHECKS.get(self.kind)
        if check is None:
            raise ProtocolError(f"WireValue.kind: unknown variant {self.kind!r}; expected one of {', '.join(KINDS)}")
        if not check(self.value):
            raise ProtocolError(f"WireValue.value: {self.value!r} is not a valid {self.kind}")

    @classmethod
    def from_python(cls, obj) -> "WireValue":
        """The legacy Python -> WireValue order of spec §8: a Ref; a list of ints (an empty list is ``IntList``)
        or of Refs; None, bool, int, float, str, device, layout, dtype, memory format; anything else pickled."""
        if isinstance(obj, Ref):
            return cls("Ref", obj)
        if isinstance(obj, list):
            if not obj or type(obj[0]) is int:
                if all(type(x) is int for x in obj):
                    return cls("IntList", list(obj))
            elif isinstance(obj[0], Ref) and all(isinstance(x, Ref) for x in obj):
                return cls("RefList", list(obj))
            return cls("PyObject", cloudpickle.dumps(obj))
        if obj is None:
            return cls("None", None)
        for kind, typ in (("Bool", bool), ("Int", int), ("Double", float), ("String", str)):
            if type(obj) is typ:
                return cls(kind, obj)
        for kind, typ in (
            ("Device", torch.device),
            ("Layout", torch.layout),
            ("ScalarType", torch.dtype),
            ("MemoryFormat", torch.memory_format),
        ):
            if isinstance(obj, typ):
                return cls(kind, obj)
        return cls("PyObject", cloudpickle.dumps(obj))

    def to_python(self):
        """The obvious mapping; ``PyObject`` is unpickled, ``Ref``/``RefList`` stay ``Ref`` objects."""
        if self.kind == "PyObject":
            return cloudpickle.loads(self.value)
        if self.kind in ("IntList", "RefList"):
            return list(self.value)
        return self.value

    @classmethod
    def for_reply(cls, obj) -> "WireValue":
        """What ``GetRefUnitTestsOnly`` answers for a stored value: Bool/Int/IntList/Double/String/None, and
        ``String("unsupported ...")`` for anything else (spec §2)."""
        if obj is None:
            return cls("None", None)
        for kind, typ in (("Bool", bool), ("Int", int), ("Double", float), ("String", str)):
            if type(obj) is typ:
                return cls(kind, obj)
        if isinstance(obj, list) and all(type(x) is int for x in obj):
            return cls("IntList", list(obj))
        return cls("String", f"unsupported value of type {type(obj).__name__}")
