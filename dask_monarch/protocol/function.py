"""``ResolvableFunction``: how a message names the function a worker calls (seed ``FunctionPath`` /
``Cloudpickle``; spec §2 "Function paths").

Resolution rules (spec §2):
* ``"torch.a.b"`` is a getattr chain starting at the ``torch`` module;
* any other path imports the module before the last dot and takes that attribute, using its ``_remote_impl``
  when it has one;
* a path without a dot fails ("paths must be fully qualified");
* ``Cloudpickle`` bytes are unpickled.
Resolved functions are cached per process (DESIGN.md "Performance design"); failures are not cached.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Union

import cloudpickle

__all__ = ["FunctionPath", "Cloudpickle", "ResolvableFunction", "resolve_function", "resolve_path", "TEST_PANIC"]

#: The path that makes a stream fail fatally instead of calling anything (spec §2, "__test_panic").
TEST_PANIC = "__test_panic"


@dataclass(slots=True, frozen=True)
class FunctionPath:
    """A fully qualified name such as ``"torch.ops.aten.add.Tensor"`` or ``"os.path.split"``."""

    path: str

    def __post_init__(self):
        if not isinstance(self.path, str):
            raise TypeError(f"FunctionPath.path must be a str, got {type(self.path).__name__}")

    def __hash__(self) -> int:  # the dataclass's hashes a new tuple; a str caches its hash (a key of every call)
        return hash(self.path)

    def __repr__(self) -> str:
        return f'<function "{self.path}">'

    def __reduce__(self):
        return (FunctionPath, (self.path,))


@dataclass(slots=True, frozen=True)
class Cloudpickle:
    """A function serialized with ``cloudpickle.dumps`` (lambdas, closures, functions of ``__main__``)."""

    bytes: bytes

    def __post_init__(self):
        if not isinstance(self.bytes, (bytes, bytearray)):
            raise TypeError(f"Cloudpickle.bytes must be bytes, got {type(self.bytes).__name__}")

    def __repr__(self) -> str:
        return f"<cloudpickled function, {len(self.bytes)} bytes>"


ResolvableFunction = Union[FunctionPath, Cloudpickle]

_cache: dict = {}


def resolve_path(path: str) -> Callable:
    """The object named by ``path`` under spec §2's rules (see the module docstring); not cached."""
    if "." not in path:
        raise ValueError(f"paths must be fully qualified: {path!r}")
    if path.startswith("torch."):
        import torch

        obj = torch
        for part in path.split(".")[1:]:
            obj = getattr(obj, part)
        return obj
    module_name, _, attr = path.rpartition(".")
    obj = getattr(importlib.import_module(module_name), attr)
    return getattr(obj, "_remote_impl", obj)


def resolve_function(function: ResolvableFunction) -> Callable:
    """Return the callable named by ``function``.

    Raises whatever the import, attribute lookup or unpickling raised (``ModuleNotFoundError``,
    ``AttributeError``, ...), ``ValueError`` for a path without a dot, ``TypeError`` for a non-function.
    Callers wrap it as spec §2's V error ``invalid remote function: failed to resolve function <...>``.
    """
    key = function.path if type(function) is FunctionPath else function
    fn = _cache.get(key)
    if fn is not None:
        return fn
    if type(function) is FunctionPath:
        fn = resolve_path(function.path)
    elif type(function) is Cloudpickle:
        fn = cloudpickle.loads(function.bytes)
    else:
        raise TypeError(f"expected FunctionPath or Cloudpickle, got {type(function).__name__}")
    if not callable(fn):
        raise TypeError(f"{function!r} resolved to a non-callable {type(fn).__name__}")
    _cache[key] = fn
    return fn
