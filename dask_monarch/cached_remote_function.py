"""``remote_autograd_function``: a ``torch.autograd.Function`` whose ``forward`` and ``backward`` run on the workers
(Monarch's ``monarch.cached_remote_function.remote_autograd_function``, importable from the same module path here).

Given a ``torch.autograd.Function`` subclass ``F`` defined in an importable module (the workers import it by its
module and qualified name), ``R = remote_autograd_function(F)`` is a new ``torch.autograd.Function`` named
``Remote_F``. ``R.apply(*args)`` on the controller, with remote ``Tensor`` arguments under an active mesh:

* runs ``F.forward(ctx, *args)`` on every rank, under ``torch.no_grad()``, with the arguments that require grad on
  the controller requiring grad on the rank too (so a forward that branches on ``x.requires_grad`` sees what the
  controller sees), and a fresh ``torch.autograd.function.FunctionCtx`` as ``ctx``;
* returns its outputs as remote tensors (Python values among them as the controller learns them: from running
  ``forward`` on fake tensors, else from rank 0, as for any ``remote`` function without ``propagate=``), and keeps
  what ``forward`` saved (``ctx.save_for_backward``) and the attributes it set on ``ctx`` for the backward;
* ``backward`` (from the controller's autograd, e.g. ``loss.backward()``) runs ``F.backward(ctx, *grads)`` on every
  rank with a context holding ``ctx.saved_tensors`` and those attributes; one gradient per output of ``forward``,
  None for a Python value. Its results are the gradients of the arguments, as torch's.

Errors: ``TypeError`` if ``F`` is not a ``torch.autograd.Function`` subclass or is defined where the workers
cannot import it (inside a function); what ``forward``/``backward`` raise on a rank surfaces as the
``RemoteException`` of a fetch, as for any remote function. A class made by ``remote_autograd_function`` given
again is returned unchanged, with a warning (as Monarch's).

dask_monarch's own way to put a function's backward on the controller's autograd graph is ``dm.grad_function``;
``OpaqueModule`` runs a whole ``nn.Module`` on the workers with autograd across the boundary.
"""

from __future__ import annotations

import importlib
import warnings

import torch
from torch.autograd.function import FunctionCtx
from torch.utils._pytree import tree_flatten, tree_unflatten

from .controller import remote

__all__ = ["RemoteAutogradFunction", "remote_autograd_function"]


def _target(module_name: str, qualname: str):
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def worker_autograd_function_forward(module_name: str, qualname: str, requires_grad: list, *args):
    """On a rank: ``F.forward`` under ``no_grad``; ``(outputs, saved tensors, ctx attributes)``."""
    leaves, spec = tree_flatten(args)
    for i in requires_grad:
        leaves[i] = leaves[i].detach().requires_grad_(True)
    ctx = FunctionCtx()
    with torch.no_grad():
        out = _target(module_name, qualname).forward(ctx, *tree_unflatten(leaves, spec))
    saved = [t.detach() if isinstance(t, torch.Tensor) else t for t in (getattr(ctx, "to_save", None) or ())]
    attrs = {k: v for k, v in vars(ctx).items() if k != "to_save" and not k.startswith("_")}
    return out, saved, attrs


def worker_autograd_function_backward(module_name: str, qualname: str, saved: list, attrs: dict, *grads):
    """On a rank: ``F.backward`` under ``no_grad`` with a context holding the forward's saved tensors and
    attributes."""
    ctx = FunctionCtx()
    for k, v in attrs.items():
        setattr(ctx, k, v)
    ctx.saved_tensors = tuple(saved)
    with torch.no_grad():
        return _target(module_name, qualname).backward(ctx, *grads)


_forward = remote(worker_autograd_function_forward)
_backward = remote(worker_autograd_function_backward)


class RemoteAutogradFunction(torch.autograd.Function):
    """The base of the classes ``remote_autograd_function`` makes (Monarch's name)."""

    @staticmethod
    def forward(ctx, *args):
        raise NotImplementedError("make a RemoteAutogradFunction with remote_autograd_function(YourFunction)")

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("make a RemoteAutogradFunction with remote_autograd_function(YourFunction)")


def remote_autograd_function(target_class, name: str | None = None):
    """A ``torch.autograd.Function`` that runs ``target_class``'s ``forward`` and ``backward`` on the workers (see
    the module docstring); ``name`` defaults to ``"Remote_" + target_class.__name__``."""
    if isinstance(target_class, type) and issubclass(target_class, RemoteAutogradFunction):
        warnings.warn(f"{target_class.__name__} is already a remote autograd.Function; returned unchanged",
                      stacklevel=2)
        return target_class
    if not (isinstance(target_class, type) and issubclass(target_class, torch.autograd.Function)):
        raise TypeError(f"remote_autograd_function: target_class must be a torch.autograd.Function subclass, got "
                        f"{target_class!r}")
    module_name, qualname = target_class.__module__, target_class.__qualname__
    if "<locals>" in qualname:
        raise TypeError(f"remote_autograd_function: {qualname} is defined inside a function; the workers import "
                        "the class by its module and name, so define it at a module's top level")

    def forward(ctx, *args):
        leaves, _ = tree_flatten(args)
        requires_grad = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        out, saved, attrs = _forward(module_name, qualname, requires_grad, *args)
        ctx.save_for_backward(*saved)
        ctx.remote_attrs = attrs
        return out

    def backward(ctx, *grads):
        return _backward(module_name, qualname, list(ctx.saved_tensors), ctx.remote_attrs, *grads)

    return type(name or f"Remote_{target_class.__name__}", (RemoteAutogradFunction,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward), "__module__": __name__})
