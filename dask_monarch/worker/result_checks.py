"""The worker's check of a remote function's results against what the controller propagated for them (the
``declared`` field of ``CallFunction``): each declared output must be a tensor of the declared dtype and shape,
(dimensions of size 1 aside: Monarch's own programs declare ``torch.zeros(1)`` for a 0-d result, and Monarch does
not check shapes at all), or an object that is not a plain Python value (``int``, ``float``, ``bool``, ``complex``, ``str``, ``bytes``,
``None``): Monarch lets a declared tensor stand for an opaque object, such as a returned ``Exception``.
A mismatch fails that call only (a value error: its results take it, and fetching one raises a
``RemoteException`` naming the function, the output and declared against returned); the session goes on.

The device is not checked: the controller's fakes do not say which device of a rank the tensor is on.
"""

from __future__ import annotations

import torch

from .activity import function_name

__all__ = ["mismatch"]

# what a declared tensor output may not be: a plain Python value (flattening leaves no list, tuple or dict)
_SCALARS = (int, float, bool, complex, str, bytes, type(None))


def _shape(shape) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _same_shape(returned: tuple, declared: tuple) -> bool:
    """Equal shapes, or shapes that differ only in dimensions of size 1 (``()`` returned for ``(1,)`` declared)."""
    return returned == declared or [n for n in returned if n != 1] == [n for n in declared if n != 1]


def mismatch(declared: tuple, leaves: list, function) -> str | None:
    """``None`` if every leaf whose entry of ``declared`` is not None is a ``torch.Tensor`` of that entry's
    ``(dtype, shape)`` or an opaque object (not a plain value); else the text of the first mismatch, e.g.
    ``"result 0 of remote function m.f ...: declared float32 (3,), returned int"``; ``function`` is the call's
    ``FunctionPath`` or ``Cloudpickle``."""
    for i, (want, leaf) in enumerate(zip(declared, leaves)):
        if want is None:
            continue
        dtype, shape = want
        if isinstance(leaf, torch.Tensor):
            if leaf.dtype is dtype and _same_shape(tuple(leaf.shape), shape):
                continue
            got = f"{_dtype(leaf.dtype)} {_shape(leaf.shape)}"
        elif type(leaf) in _SCALARS:
            got = type(leaf).__name__
        else:  # any other object is a handle to an opaque value, as Monarch allows (test_return_exception)
            continue
        return (f"result {i} of remote function {function_name(function)} does not match its propagation: declared "
                f"{_dtype(dtype)} {_shape(shape)}, returned {got}")
    return None
