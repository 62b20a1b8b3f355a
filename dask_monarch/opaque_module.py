"""``OpaqueModule``: a ``torch.nn.Module`` that lives on every rank, called from the controller with autograd across
the boundary (Monarch's ``monarch.opaque_module``; also ``dask_monarch.OpaqueModule``)::

    with mesh.activate():
        linear = dm.OpaqueModule("torch.nn.Linear", 3, 3)            # built on every rank
        x = torch.rand(4, 3, requires_grad=True)
        y = linear(x, propagator=lambda self, x: torch.empty(4, 3))  # forward on the workers
        y.sum().backward()                                            # backward on the workers, through autograd
        weight, bias = linear.parameters()                            # remote handles of every rank's parameters
        weight.grad.reduce_("dp", "avg")                              # their gradients, on the mesh like any tensor

How: ``parameters()`` asks the first rank for the parameters' layout (shapes, strides, dtypes, which share a
storage) and returns a remote ``Tensor`` per parameter that aliases the module's own (detached: an in-place op on
it, ``p.zero_()`` or an optimizer step, changes the module), with ``requires_grad`` set on the controller. A call
with any input (or parameter) that requires grad runs as one ``torch.autograd.Function`` on the controller: its
forward runs the module on each rank with autograd recording there and keeps, as an ``OpaqueRef``, a closure over
that graph's edges; its backward sends the output gradients to that closure, which computes the gradients of the
inputs and parameters with ``torch.autograd.grad`` on each rank and returns them (zeros for an input the outputs do
not depend on). The controller's autograd accumulates them into ``x.grad`` and each parameter handle's ``.grad``;
the module's own ``p.grad`` on the workers is not touched. The closure (and the graph it holds on the workers) is
freed after backward, or when the outputs are dropped without one. Without gradients (no input requires grad, or
under ``torch.no_grad()``) the module runs on each rank under ``torch.no_grad()``.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from .controller import call_on_shard_and_fetch, remote
from .opaque_object import OpaqueObject
from .opaque_ref import OpaqueRef

__all__ = ["OpaqueModule"]


# ------------------------------------------------------------------------------------------- on the workers
def parameter_layout(module: OpaqueRef) -> list:
    """``[(shape, stride, storage offset, dtype, device, storage index, storage bytes)]`` of the module's parameters
    (``module.parameters()`` order); parameters that share a storage share its index."""
    storages: dict = {}
    layout = []
    for p in module.value.parameters():
        storage = p.untyped_storage()
        index = storages.setdefault(storage._cdata, len(storages))
        layout.append((tuple(p.shape), tuple(p.stride()), p.storage_offset(), p.dtype, str(p.device), index,
                       storage.nbytes()))
    return layout


def detached_parameters(module: OpaqueRef) -> list:
    """The module's parameters, detached: the same storage, no autograd on the worker's ref."""
    return [p.detach() for p in module.value.parameters()]


def call_without_grad(module: OpaqueRef, args: tuple, kwargs: dict):
    """``module(*args, **kwargs)`` under ``torch.no_grad()``."""
    with torch.no_grad():
        return module.value(*args, **kwargs)


def forward_with_grad(module: OpaqueRef, requires_grad: list, args: tuple, kwargs: dict):
    """``(OpaqueRef of the backward closure, module(*args, **kwargs) detached)``; ``requires_grad`` flags the tensor
    leaves of ``(args, kwargs)`` and then the module's parameters, as the controller flattened them."""
    the_module = module.value
    parameters = list(the_module.parameters())
    leaves, spec = tree_flatten((args, kwargs))
    at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if len(requires_grad) != len(at) + len(parameters):
        raise ValueError(f"OpaqueModule: {len(requires_grad)} gradient flags for {len(at)} tensor arguments and "
                         f"{len(parameters)} parameters on this rank")
    inputs = [leaves[i] for i in at] + parameters
    for k, i in enumerate(at):
        if requires_grad[k]:
            leaves[i] = inputs[k] = leaves[i].detach().requires_grad_(True)
    args, kwargs = tree_unflatten(leaves, spec)
    wanted = [k for k, flag in enumerate(requires_grad) if flag]
    into = [get_gradient_edge(inputs[k]) for k in wanted]  # edges, not tensors: nothing else is kept alive
    shapes = [(tuple(inputs[k].shape), inputs[k].dtype, inputs[k].device) for k in wanted]
    with torch.enable_grad():
        out = the_module(*args, **kwargs)
    out_leaves, out_spec = tree_flatten(out)
    outs = [x for x in out_leaves if isinstance(x, torch.Tensor)]
    edges = [get_gradient_edge(x) if x.requires_grad else None for x in outs]
    count = len(requires_grad)
    del inputs, leaves, args, kwargs, out, outs

    def backward(grad_outputs: list) -> list:
        pairs = [(e, g) for e, g in zip(edges, grad_outputs) if e is not None]
        found = [None] * len(wanted)
        if pairs and wanted:
            found = torch.autograd.grad([e for e, _ in pairs], into, [g for _, g in pairs], allow_unused=True)
        grads = [None] * count
        for k, g, (shape, dtype, device) in zip(wanted, found, shapes):
            grads[k] = torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
        return grads

    result = tree_unflatten([x.detach() if isinstance(x, torch.Tensor) else x for x in out_leaves], out_spec)
    return OpaqueRef(backward), result


def backward_of(closure: OpaqueRef, grad_outputs: list) -> list:
    """The gradients of a forward's inputs and parameters (None where not asked) for ``grad_outputs``."""
    return closure.value(grad_outputs)


# ------------------------------------------------------------------------------------------- on the controller
def _layout_fakes(layout, module):
    """Fake tensors with ``layout`` (``parameter_layout``), those of one storage viewing one fake storage."""
    bases: dict = {}
    fakes = []
    for shape, stride, offset, dtype, device, index, nbytes in layout:
        base = bases.get(index)
        if base is None:
            base = bases[index] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        fakes.append(torch.empty(0, dtype=dtype, device=device).set_(base.untyped_storage(), offset, shape, stride))
    return fakes


def _forward_shapes(propagator, module, requires_grad, args, kwargs):
    return OpaqueRef(None), propagator(module, *args, **kwargs)


def _call_shapes(propagator, module, args, kwargs):
    return propagator(module, *args, **kwargs)


@functools.lru_cache(maxsize=256)
def _forward_call(propagator):
    return remote(forward_with_grad, propagate=functools.partial(_forward_shapes, propagator))


@functools.lru_cache(maxsize=256)
def _plain_call(propagator):
    return remote(call_without_grad, propagate=functools.partial(_call_shapes, propagator))


def _grad_shapes(pattern, closure, grad_outputs):
    return [None if p is None else torch.empty(p[0], dtype=p[1], device=p[2]) for p in pattern]


@functools.lru_cache(maxsize=256)
def _backward_call(pattern: tuple):
    return remote(backward_of, propagate=functools.partial(_grad_shapes, pattern))


class _Boundary(torch.autograd.Function):
    """The module's call as one autograd node of the controller: forward and backward on every rank."""

    @staticmethod
    def forward(ctx, module, propagator, spec, others, tensor_at, holder, *tensors):
        leaves = list(others)
        for i, t in zip(tensor_at, tensors):
            leaves[i] = t
        args, kwargs, parameters = tree_unflatten(leaves, spec)
        requires_grad = list(holder["requires_grad"])
        closure, result = _forward_call(propagator)(module._object, requires_grad, args, kwargs)
        out_leaves, out_spec = tree_flatten(result)
        out_at = [i for i, x in enumerate(out_leaves) if isinstance(x, torch.Tensor)]
        outs = [out_leaves[i] for i in out_at]
        holder["unflatten"] = (out_leaves, out_spec, out_at)
        ctx.closure = closure
        ctx.pattern = tuple((tuple(t.shape), t.dtype, t.device) if flag else None
                            for t, flag in zip(tensors, requires_grad))
        ctx.mark_non_differentiable(*[t for t in outs if not (t.is_floating_point() or t.is_complex())])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        closure, ctx.closure = ctx.closure, None  # the workers' graph is used once: free it with the handle
        if closure is None:
            raise RuntimeError("OpaqueModule: backward through this call ran already (its graph on the workers is "
                               "freed after one backward)")
        grads = _backward_call(ctx.pattern)(closure, list(grad_outputs))
        closure._key.drop()  # freed on the workers right after this call, before what the program sends next
        return (None,) * 6 + tuple(grads)


class OpaqueModule:
    """An ``nn.Module`` built on every rank by ``constructor(*args, **kwargs)`` (a dotted path such as
    ``"torch.nn.Linear"`` or a callable, as ``OpaqueObject``), called from the controller (see the module docstring;
    Monarch's ``OpaqueModule``).

    ``module(*args, propagator=fn, **kwargs)`` runs its forward on every rank; ``propagator(self, *args, **kwargs)``
    returns fake tensors of the outputs' shapes (as ``remote``'s ``propagate``). ``parameters()`` is the list of
    remote handles of the parameters; ``call_method(name, propagation, *args)`` calls any method (as
    ``OpaqueObject.call_method``, with autograd recording on the workers as the module's own code does).
    """

    def __init__(self, *args, **kwargs):
        self._object = OpaqueObject(*args, **kwargs)
        self._parameters = None

    def parameters(self) -> list:
        """The module's parameters as remote ``Tensor`` s (``module.parameters()`` order), aliasing them on every rank,
        with ``requires_grad`` set; made on the first call (a fetch of their layout from the first rank)."""
        if self._parameters is None:
            layout = call_on_shard_and_fetch(parameter_layout, self._object).result()
            get = remote(detached_parameters, propagate=functools.partial(_layout_fakes, layout))
            self._parameters = [p.requires_grad_(True) for p in get(self._object)]
        return self._parameters

    def call_method(self, method_name: str, propagation, *args, **kwargs):
        """``OpaqueObject.call_method`` of the module object."""
        return self._object.call_method(method_name, propagation, *args, **kwargs)

    def __call__(self, *args, propagator, **kwargs):
        if not callable(propagator):
            raise TypeError(f"OpaqueModule: propagator must be a function of (self, *args, **kwargs) returning fake "
                            f"tensors of the outputs' shapes, got {type(propagator).__name__}")
        parameters = self.parameters()
        leaves, spec = tree_flatten((args, kwargs, parameters))
        tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        tensors = [leaves[i] for i in tensor_at]
        requires_grad = [t.requires_grad for t in tensors]
        if not torch.is_grad_enabled() or not any(requires_grad):
            return _plain_call(propagator)(self._object, args, kwargs)
        others = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        holder = {"requires_grad": requires_grad}
        outs = _Boundary.apply(self, propagator, spec, others, tensor_at, holder, *tensors)
        out_leaves, out_spec, out_at = holder["unflatten"]
        out_leaves = list(out_leaves)
        for i, t in zip(out_at, outs):
            out_leaves[i] = t
        return tree_unflatten(out_leaves, out_spec)

    def __repr__(self) -> str:
        return f"OpaqueModule({self._object!r})"
