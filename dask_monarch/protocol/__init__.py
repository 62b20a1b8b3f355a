"""The tensor-worker protocol: messages, identifiers and value types (seed ``worker.rs``; spec §2, §6, §8)."""

from .function import Cloudpickle, FunctionPath, ResolvableFunction, resolve_function
from .messages import *  # noqa: F401,F403
from .messages import __all__ as _messages_all
from .refs import Ref, Seq, StreamRef
from .slice import Slice, SliceError
from .types import ArgsKwargs, Factory, PickledValue, ProtocolError, Reduction, StreamCreationMode, UniqueId, WorkerError
from .wire_value import WireValue
from . import tensor_bytes  # noqa: F401  (importing it fills torch's layout cache: see its docstring)
from . import torch_values  # noqa: F401  (importing it makes torch's values pickle by name: see its docstring)
from . import wire_forms  # noqa: F401  (importing it makes CallFunction and DeleteRefs pickle flattened)

__all__ = [
    "ArgsKwargs",
    "Cloudpickle",
    "Factory",
    "FunctionPath",
    "PickledValue",
    "ProtocolError",
    "Reduction",
    "Ref",
    "ResolvableFunction",
    "Seq",
    "Slice",
    "SliceError",
    "StreamCreationMode",
    "StreamRef",
    "UniqueId",
    "WireValue",
    "WorkerError",
    "resolve_function",
    *_messages_all,
]
