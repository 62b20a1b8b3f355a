"""A call whose outputs a cached ``Plan`` describes (``propagation.py``): the per-op fast path of ``remote`` calls
and torch ops on remote tensors (``remote.call_on_mesh``, ``dispatch.operator_call``). ``cached`` finds the plan
and ``issue`` makes the outputs from it and sends the ``CallFunction``, without fake tensors."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..protocol import ArgsKwargs, CallFunction
from .mesh import DeviceMesh
from .process_group import RemoteProcessGroup
from .propagation import FRESH, INPUT, OF_INPUT, TENSOR, Plan, call_key
from .session import DEFAULT_STREAM
from .storage import Storage
from .stream import check_access, get_active_stream
from .tensor import Tensor

__all__ = ["MISS", "cached", "call_cached", "groups_in", "issue"]

#: ``cached``'s answer when there is no plan to use
MISS = object()


def call_cached(op, path, name: str, args: tuple):
    """``call_on_mesh(path, name, op, args, {})`` of torch op ``op`` if the call's plan is cached (it sends the
    ``CallFunction`` and returns the result), else None, having sent nothing (``dispatch.operator_call``)."""
    key, inputs = call_key(None, op, args, {}, Tensor, DeviceMesh)
    if key is None or not inputs:
        return None
    result = cached(key, inputs, path, name, args, {}, op, False)
    return None if result is MISS else result


def cached(key, inputs: list, function, name: str, args: tuple, kwargs: dict, op, check: bool):
    """The result of a call whose plan is cached under ``key`` (sent), else ``MISS``; raises ``TypeError``
    (DROPPED) for a dropped input."""
    mesh = inputs[0].mesh
    for x in inputs:
        if x.mesh is not mesh:
            return MISS  # remote._call's _mesh_of checks them, and says what is wrong
        if x._dropped_at is not None:
            x.check_usable()  # TypeError DROPPED
    propagator = mesh._session.propagator
    plan = propagator.plan(key)
    if plan is None and op is not None:  # the same op on inputs at other offsets (x[rows] each step)
        plan = propagator.plan_at_other_offsets(key)
    if plan is None:
        return MISS
    if not plan.groups:
        return issue(plan, function, name, args, kwargs, inputs, mesh, (), check)
    groups = groups_in(args, kwargs)
    if all(g.mesh._session is mesh._session for g in groups):  # else _mesh_of says what is wrong
        return issue(plan, function, name, args, kwargs, inputs, mesh, groups, check)
    return MISS


def groups_in(args: tuple, kwargs: dict) -> list:
    """The ``RemoteProcessGroup`` arguments of a call."""
    return [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, RemoteProcessGroup)]


def issue(plan: Plan, function, name: str, args: tuple, kwargs: dict, inputs: list, mesh, groups=(), check=False):
    """Send the ``CallFunction`` of a call whose outputs ``plan`` describes, with the process groups ``groups``
    among its arguments (each split on the call's stream first; ``check``: with the outputs' dtypes and shapes)."""
    session = mesh._session
    stream = get_active_stream()
    with session.lock:
        if session.failure is not None or session.closed:
            session.check_ok()  # raises
        stream_ref = DEFAULT_STREAM if stream.default else stream.ref_for(session)
        if torch.get_default_dtype() is not session.default_dtype:
            session.follow_default_dtype(stream_ref)
        written = [inputs[i] for i in plan.written] if plan.written else ()
        check_access(stream, inputs, written)
        mutates = session.aliases_of(written) if written else ()
        results, values, new = [], [], []
        declared = [] if check else None
        for step in plan.steps:
            kind = step[0]
            if kind == TENSOR:
                _, meta, requires_grad, where, which = step
                if where == FRESH:
                    storage = Storage(which)
                else:
                    storage = (inputs[which] if where == OF_INPUT else values[which])._storage
                t = Tensor.viewing(session.new_ref(), storage, meta, requires_grad, mesh, stream)
                results.append(t.ref)
                values.append(t)
                new.append(t)
                if check:
                    declared.append((meta[3], tuple(meta[0])))
            else:
                results.append(None)
                values.append(inputs[step[1]] if kind == INPUT else step[1])
                if check:
                    declared.append(None)
        for group in groups:  # its communicator on this stream is built on its ranks before the call
            group.ensure_split(stream_ref)
        seq = session.new_call(new + mutates if mutates else new, inputs, name)
        message = CallFunction(  # empty fields as the () singleton: fewer objects for the worker's GC to track
            seq, results, tuple([t.ref for t in mutates]) if mutates else (), function,
            ArgsKwargs(tuple(args), dict(kwargs)), stream_ref, tuple([g.ref for g in groups]) if groups else (),
            tuple(declared) if check else None,
        )
        session.send(message, mesh._rank_list)
    return values[0] if plan.spec is None else tree_unflatten(values, plan.spec)
