"""The worker's check of a remote function's results against what the controller propagated for them (the
``declared`` field of ``CallFunction``): each declared output must be a tensor of the declared dtype and shape.
A mismatch fails that call only (a value error: its results take it, and fetching one raises a
``RemoteException`` naming the function, the output and declared against returned); the session goes on.

The device is not checked: the controller's fakes do not say which device of a rank the tensor is on.
"""

from __future__ import annotations

import torch

from .activity import function_name

__all__ = ["mismatch"]


def _shape(shape) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def mismatch(declared: tuple, leaves: list, function) -> str | None:
    """``None`` if every leaf whose entry of ``declared`` is not None is a ``torch.Tensor`` of that entry's
    ``(dtype, shape)``; else the text of the first mismatch, e.g. ``"result 0 of function f: declared float32 (3,),
    returned int"``; ``function`` is the call's ``FunctionPath`` or ``Cloudpickle``."""
    for i, (want, leaf) in enumerate(zip(declared, leaves)):
        if want is None:
            continue
        dtype, shape = want
        if isinstance(leaf, torch.Tensor):
            if leaf.dtype is dtype and tuple(leaf.shape) == shape:
                continue
            got = f"{_dtype(leaf.dtype)} {_shape(leaf.shape)}"
        else:
            got = type(leaf).__name__
        return (f"result {i} of remote function {function_name(function)} does not match its propagation: declared "
                f"{_dtype(dtype)} {_shape(shape)}, returned {got}")
    return None
