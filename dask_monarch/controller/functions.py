"""Which ``ResolvableFunction`` a callable travels as (spec §1 ``remote``, §2 "Function paths"): its path when the
workers can import it (torch ops, importable functions), else cloudpickled by value, keeping the source file of the
code so that a traceback on a worker names the user's file and line.
"""

from __future__ import annotations

import io
import marshal
import sys
import threading
import types
from collections import ChainMap

import cloudpickle
import torch

from ..protocol import Cloudpickle, FunctionPath
from ..protocol.function import TEST_PANIC

__all__ = ["dumps_by_value", "function_of"]


def _is_test_module(module: str) -> bool:
    base = module.rsplit(".", 1)[-1]
    return base.startswith("test_") or base.endswith("_test") or base == "conftest"


def _importable_path(fn) -> str | None:
    """``"module.qualname"`` if the workers can import ``fn`` by that name (spec §1: not ``__main__``, not a
    pytest module, not a local function), else None."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname or _is_test_module(module):
        return None
    mod = sys.modules.get(module)
    obj = mod
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is fn or getattr(obj, "_remote_impl", None) is fn:  # a function decorated with @remote
        return f"{module}.{qualname}"
    name = getattr(fn, "__name__", None)
    if name and getattr(mod, name, None) is fn:  # builtins such as torch.zeros (qualname _VariableFunctionsClass.zeros)
        return f"{module}.{name}"
    return None


_BY_VALUE_LOCK = threading.Lock()


def _code_reduce(code: types.CodeType):
    """A code object, with its file name (cloudpickle writes ``"<dynamic-code>"``, so remote tracebacks named no
    file): ``marshal`` keeps every field, nested functions' code included. Controller and workers run the same
    Python version, as code travelling by value needs anyway."""
    return marshal.loads, (marshal.dumps(code),)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, keeping the source file of functions sent by value (``_code_reduce``)."""

    dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)


def dumps_by_value(fn) -> bytes:
    """``cloudpickle.dumps(fn)``, with ``fn``'s (and the functions it uses') file names kept, so that a traceback
    on a worker names the user's file and line."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=5).dump(fn)
    return buffer.getvalue()


def function_of(fn):
    """The ``ResolvableFunction`` for ``fn``: an ``OpOverload`` or dotted string -> ``FunctionPath``; an importable
    function -> its path; anything else (lambdas, closures, ``__main__``, functions of pytest modules, which the
    workers usually cannot import) -> ``Cloudpickle``, by value."""
    if isinstance(fn, str):
        if "." not in fn and fn != TEST_PANIC:  # Monarch's "__test_panic": the stream that runs it fails
            raise ValueError(f"remote function paths must be fully qualified, got {fn!r}")
        return FunctionPath(fn)
    if isinstance(fn, torch._ops.OpOverload):
        return FunctionPath(f"torch.ops.{fn.namespace}.{fn._schema.name.split('::')[-1]}.{fn._overloadname}")
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return FunctionPath(f"torch.ops.{fn._qualified_op_name.replace('::', '.')}")
    if not callable(fn):
        raise TypeError(f"remote() needs a callable or a dotted path, got {type(fn).__name__}")
    path = _importable_path(fn)
    if path is not None:
        return FunctionPath(path)
    module_name = getattr(fn, "__module__", None) or ""
    module = sys.modules.get(module_name)
    if module is not None and _is_test_module(module_name):
        with _BY_VALUE_LOCK:  # cloudpickle's registry is process-wide: controllers in other threads share it
            cloudpickle.register_pickle_by_value(module)
            try:
                return Cloudpickle(dumps_by_value(fn))
            finally:
                cloudpickle.unregister_pickle_by_value(module)
    return Cloudpickle(dumps_by_value(fn))
