"""``reduce`` / ``reduce_`` / ``Tensor.reduce`` / ``Tensor.reduce_``: collectives over mesh dimensions
(spec §1 ``t.reduce``, §5 ``Reduce``; DESIGN.md "Decisions").

Output shape for input shape ``s`` and ``N`` ranks along the reduced dims: stack -> ``[N, *s]`` (all-gather);
stack + scatter -> ``s`` (all-to-all); op -> ``s`` (all-reduce); op + scatter -> ``s[1:]`` (reduce-scatter).
The first reduce of a session sends ``BackendNetworkInit``; the first over given (stream, dims) of a mesh sends
``SplitComm``; then each tensor is one ``Reduce``.
"""

from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..protocol import Factory, Reduce, Reduction
from .local import propagating
from .mesh import frontend
from .process_group import mesh_dims
from .stream import check_access, get_active_stream
from .tensor import Tensor

__all__ = ["reduce", "reduce_", "reduce_one"]


def reduce_one(t: Tensor, dims, reduction="sum", scatter: bool = False, mesh=None, in_place: bool = False,
               out: Tensor | None = None):
    """Reduce remote tensor ``t`` over mesh ``dims`` (a name, a tuple of names, or ``()`` for all dims).

    ``reduction``: ``"sum" | "avg" | "prod" | "min" | "max" | "stack"`` (and ``"band" | "bor" | "bxor"``).
    Raises ``KeyError`` for an unknown dim; ``ValueError`` for duplicate dims, several dims with stack or
    scatter, an ``out`` of the wrong shape or dtype, or an unsupported in-place form; ``TypeError`` ("When
    scattering") when ``t.shape[0]`` is not the number of ranks reduced over; ``NotImplementedError`` for
    ``mesh=``. Returns the result tensor (``t`` itself when ``in_place``).
    """
    if mesh is not None:
        raise NotImplementedError("reduce(mesh=...) is not supported; reduce over dims of the tensor's own mesh")
    if not isinstance(t, Tensor):
        raise TypeError(f"reduce needs a remote dask_monarch.Tensor, got {type(t).__name__}")
    t.check_usable()
    red = Reduction.parse(reduction)
    tmesh = t.mesh
    dims = mesh_dims(tmesh, dims, "reduce")
    if len(dims) > 1 and (red is Reduction.Stack or scatter):
        raise ValueError(f"reduce: {red.value}{' with scatter' if scatter else ''} over {dims} is not valid for multiple "
                         "dimensions: a stack or a scatter works over one dimension (reduce one dimension at a time)")
    n = math.prod(tmesh.sizes[d] for d in dims)
    shape = tuple(t.shape)
    if scatter and (not shape or shape[0] != n):
        raise TypeError(
            f"When scattering, the first dimension of the tensor must be the number of ranks reduced over ({n}); "
            f"got shape {shape}"
        )
    if red is Reduction.Stack:
        out_shape = shape if scatter else (n, *shape)
    else:
        out_shape = shape[1:] if scatter else shape
    if in_place:
        if out is not None:
            raise ValueError("reduce_: an in-place reduce cannot take out=")
        if red is Reduction.Stack and not scatter:
            raise ValueError("reduce_: in-place, non-scatter not supported for stack reduce (the shape changes)")
        if red is not Reduction.Stack and scatter:
            raise ValueError("reduce_: in-place, scatter not supported for reduce (the shape changes)")
    if out is not None:
        if not isinstance(out, Tensor):
            raise TypeError(f"reduce: out must be a remote dask_monarch.Tensor, got {type(out).__name__}")
        out.check_usable()
        if out.mesh._session is not tmesh._session:
            raise TypeError(
                f"WRONG_MESH: reduce: out ({out.ref}) belongs to another session ({out.mesh._session.tag}) "
                f"than the tensor ({tmesh._session.tag})"
            )
        if out.mesh._rank_list != tmesh._rank_list:
            raise TypeError("WRONG_MESH: reduce: out is on a different mesh")
        if tuple(out.shape) != out_shape:
            raise ValueError(f"Reduce expects the shape to be {torch.Size(out_shape)} (the result's), but out has shape "
                             f"{torch.Size(out.shape)}")
        if out.dtype != t.dtype:
            raise ValueError(f"Reduce expects out to have dtype {t.dtype}, got {out.dtype}")
    if t.requires_grad:
        raise TypeError("REQUIRES_GRAD: reduce of a tensor that requires grad is not supported")

    session = tmesh._session
    stream = get_active_stream()
    with session.lock:
        session.check_ok()
        outs = [out] if out is not None else []
        check_access(stream, [t] + outs, outs + ([t] if in_place else []))
        stream_ref = stream.ref_for(session)
        mesh_ref = tmesh.define_remotely()
        sorted_dims = sorted(dims)
        session.ensure_comm(tmesh, mesh_ref, stream_ref, sorted_dims)
        if in_place:
            fake = t._fake
        elif out is not None:
            fake = out._fake
        else:
            # propagating(): under mesh.activate() the mesh's dispatch mode would run the factory on the mesh
            # (the fake mode is an infra mode, ordered below it; dispatch.py)
            with propagating(), session.fake_mode:
                fake = torch.empty(out_shape, dtype=t.dtype, device=t.device)
        result = Tensor(session.new_ref(), fake, tmesh, stream)
        seq = session.new_seq()
        defs = [result] + ([t] if in_place else []) + ([out] if out is not None else [])
        uses = [t] + ([out] if out is not None else [])
        session.record(seq, defs=defs, uses=uses, what=f"reduce({red.value} over {dims})")
        session.send(
            Reduce(
                result.ref, t.ref, Factory(shape, t.dtype, t._fake.layout, t.device), mesh_ref, stream_ref,
                sorted_dims, red, bool(scatter), bool(in_place), out.ref if out is not None else None, seq,
            ),
            tmesh._rank_list,
        )
    return t if in_place else result


def reduce(tensors, dims, reduction="sum", scatter: bool = False, mesh=None, out=None):
    """``reduce_one`` over every remote tensor of the pytree ``tensors``; returns the same structure. ``out``, if
    given, is a pytree of the same structure."""
    leaves, spec = tree_flatten(tensors)
    outs = tree_flatten(out)[0] if out is not None else [None] * len(leaves)
    if len(outs) != len(leaves):
        raise ValueError(f"reduce: out has {len(outs)} leaves for {len(leaves)} tensors")
    results = [
        reduce_one(x, dims, reduction, scatter, mesh, False, o) if isinstance(x, Tensor) else x
        for x, o in zip(leaves, outs)
    ]
    return tree_unflatten(results, spec)


def reduce_(tensors, dims, reduction="sum", scatter: bool = False, mesh=None):
    """In-place ``reduce`` of every remote tensor of the pytree ``tensors``; returns ``tensors``."""
    leaves, _ = tree_flatten(tensors)
    for x in leaves:
        if isinstance(x, Tensor):
            reduce_one(x, dims, reduction, scatter, mesh, True, None)
    return tensors


frontend.reduce_one = reduce_one
