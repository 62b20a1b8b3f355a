"""The worker's half of Monarch's "cached" propagation: run a remote function once, on this rank, to tell the
controller what it returns (``controller/cached_propagation.py`` sends it, as a ``SendValue`` to the mesh's first
rank, when the function cannot run on the controller's fake tensors).

``describe_outputs`` runs the function on copies of its remote tensor arguments (aliasing kept: one copy per
storage), with the random number generators' states put back afterwards, so the real call that follows finds the
rank's tensors and generators as if nothing had run. What it answers is plain data: the pytree of the result, each
leaf as a tensor's metadata (and whose storage it views: an argument's, an earlier output's, or its own) or as the
value itself, and the arguments whose version counter moved (written in place).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..protocol.function import resolve_function
from .opaque import is_key

__all__ = ["describe_outputs"]


def _is_none(x) -> bool:
    return x is None


def _copies(tensors: list) -> dict:
    """``{id(t): copy}`` for ``tensors``, the copies of tensors that share a storage sharing one copy of it."""
    storages: dict = {}
    copies: dict = {}
    for t in tensors:
        if id(t) in copies:
            continue
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in storages:
            storages[key] = storage.clone()
        copy = torch.empty(0, dtype=t.dtype, device=t.device)
        copy.set_(storages[key], t.storage_offset(), t.size(), t.stride())
        copies[id(t)] = copy
    return copies


def _devices(tensors: list) -> list:
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


def describe_outputs(function, args, kwargs, inputs: list):
    """Run ``function`` (a ``ResolvableFunction``) on ``args``/``kwargs``, whose remote tensors are ``inputs`` (in the
    controller's order), and describe its result: ``(skeleton, leaves, written)`` with ``skeleton`` the result's
    pytree with every leaf None, ``leaves`` one entry per leaf, ``("tensor", size, stride, storage_offset, dtype,
    device, requires_grad, where, which)`` with ``where`` ``"input"`` (``which``: the argument index whose storage it
    views), ``"output"`` (the index of the earlier leaf whose storage it shares) or ``"fresh"`` (``which``: its
    storage's bytes), or ``("value", v)``; ``written`` the indices of ``inputs`` the function wrote. What the
    function raises is this fetch's error."""
    fn = resolve_function(function)
    if any(is_key(t) for t in inputs):
        raise TypeError("it takes an OpaqueRef, so its outputs cannot be learned by running it: not on the controller "
                        "(the object is not there) nor once more on a rank (that would call into the object twice); "
                        "give remote(..., propagate=...) a function returning the outputs' shapes")
    copies = _copies(inputs)
    args, kwargs = tree_map(lambda x: copies.get(id(x), x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
    mine = [copies[id(t)] for t in inputs]
    versions = [t._version for t in mine]
    with torch.random.fork_rng(devices=_devices(mine)):
        out = fn(*args, **kwargs)
    written = [i for i, (t, v) in enumerate(zip(mine, versions)) if t._version != v]
    of_input: dict = {}
    for i, t in enumerate(mine):
        of_input.setdefault(t.untyped_storage()._cdata, i)
    of_output: dict = {}
    leaves, spec = tree_flatten(out, is_leaf=_is_none)
    described = []
    for k, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            described.append(("value", leaf))
            continue
        storage = leaf.untyped_storage()
        key = storage._cdata
        if key in of_input:
            where, which = "input", of_input[key]
        elif key in of_output:
            where, which = "output", of_output[key]
        else:
            where, which = "fresh", storage.nbytes()
            of_output[key] = k
        described.append(("tensor", tuple(leaf.shape), tuple(leaf.stride()), leaf.storage_offset(), leaf.dtype,
                          leaf.device, leaf.requires_grad, where, which))
    return tree_unflatten([None] * len(leaves), spec), described, written
