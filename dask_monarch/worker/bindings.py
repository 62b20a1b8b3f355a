"""The plain torch function a recorded aten operation can be replayed with (``worker/blocks.py``).

A recording names its operations by ``OpOverload`` (``torch.ops.aten.mul.Tensor``). Calling an overload goes
through torch's generic schema-driven path (its arguments converted one by one to ``IValue`` s, the kernel called
boxed), which costs about half a microsecond more per call than the generated Python binding that eager PyTorch
calls for ``torch.mul`` or ``x.mul_`` (measured on a 2-core x86 host, torch 2.13: 4.6 against 4.0 us for a
16x16 ``mul``, 2.0 against 1.5 us for ``relu``). A replay therefore calls the binding where it is the same
operation: ``torch._C._VariableFunctions.<name>`` (or ``torch._C._nn``, ``_linalg``, ``_special``, ``_fft``), or
the method ``torch._C.TensorBase.<name>`` (in-place operations).

"The same operation" is checked, not assumed: a binding picks its overload from its arguments' Python types, and
some bindings decompose. For each overload and pattern of argument types (a ref is a tensor, a list of refs a list
of tensors, a constant its type), the binding is called once on empty meta tensors under a ``TorchDispatchMode``
that stops at the first operation it sees; only when that is the recorded overload is the binding used. Otherwise
(or for another namespace than ``aten``) the overload's own entry point is.
"""

from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["fast_callable"]

_MODULES = (torch._C._VariableFunctions, torch._C._nn, torch._C._linalg, torch._C._special, torch._C._fft)
_checked: dict = {}  # (overload, argument pattern) -> the binding, or None
_lock = threading.Lock()


class _Seen(Exception):
    def __init__(self, func):
        self.func = func


class _FirstOp(TorchDispatchMode):
    """Raises ``_Seen(func)`` at the first operation dispatched (nothing runs)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        raise _Seen(func)


def _kind(spec) -> object:
    """The type pattern of one bound argument (``steps.Call._bind``'s specs)."""
    kind = spec[0]
    if kind == "ref":
        return "tensor"
    if kind == "list":
        return (spec[1], tuple(_kind(item) for item in spec[2]))
    value = spec[1]
    if type(value) in (list, tuple):
        return (type(value), tuple(type(v) for v in value))
    return type(value)


def _sample(spec):
    kind = spec[0]
    if kind == "ref":
        return torch.empty(0, device="meta")
    if kind == "list":
        return spec[1](_sample(item) for item in spec[2])
    return spec[1]


def _candidates(op) -> list:
    name = op._schema.name.split("::")[-1]
    found = [getattr(m, name) for m in _MODULES if hasattr(m, name)]
    method = getattr(torch._C.TensorBase, name, None)
    if method is not None:
        found.append(method)
    return found


def _dispatches_to(binding, op, args: list, kwargs: dict) -> bool:
    try:
        with torch.autocast("cpu", enabled=False), _FirstOp():
            binding(*args, **kwargs)
    except _Seen as seen:
        return seen.func is op
    except Exception:
        return False
    return False


def fast_callable(op, args: list, kwargs: dict):
    """What a replay calls for ``op`` (an ``OpOverload``) with arguments bound as ``args``/``kwargs`` (specs of
    ``steps.Call._bind``): the Python binding that dispatches to ``op`` for arguments of these types, or
    ``op``'s own entry point (``op._op``)."""
    if op.namespace != "aten":
        return op._op
    key = (op, tuple(_kind(s) for s in args), tuple((k, _kind(s)) for k, s in kwargs.items()))
    try:
        found = _checked.get(key, False)
    except TypeError:  # an unhashable constant type pattern: do not cache
        found, key = False, None
    if found is False:
        sample_args = [_sample(s) for s in args]
        sample_kwargs = {k: _sample(s) for k, s in kwargs.items()}
        found = None
        with _lock:  # a dispatch mode is per thread, but keep the one-time checks simple and serial
            for binding in _candidates(op):
                if _dispatches_to(binding, op, sample_args, sample_kwargs):
                    found = binding
                    break
        if key is not None:
            _checked[key] = found
    return found if found is not None else op._op
