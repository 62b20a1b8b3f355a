"""Output metadata of a call, learned on fake tensors and cached (spec §1: "Output shapes come from FakeTensors").

Running an op on fake tensors costs the controller a few hundred microseconds; a training loop repeats the same
ops on the same shapes. The first call with given input metadata runs ``propagate`` on fakes and records a
``Plan``: for each output, which input it is (an in-place op), or its size, strides, offset, dtype and device and
whose storage it views (an input's, an earlier output's, or a fresh one of so many bytes); and which inputs the
call writes. Later calls with the same function and the same input metadata (``call_key``) make their outputs
from the plan, without fake tensors (``remote.py``). A call whose inputs include local tensors, unhashable
values, or whose propagation changed an input's metadata is never cached.

A torch op's plan whose outputs view no input (fresh results, the inputs themselves for an in-place op, plain
values) does not depend on where its inputs start in their storages: it is also kept under the key without the
inputs' storage offsets (``offset_free``), so that ``mm(x[rows], w)`` with a different ``rows`` each step reuses
it (a view's offset, as ``x[rows]``'s own, follows its input's and is never reused so).
"""

from __future__ import annotations

import torch

__all__ = ["Plan", "Propagator", "call_key", "fake_view", "fresh_storage", "offset_free"]

_PLAIN = frozenset((int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format))
_SEQUENCES = (list, tuple)
_UNCACHEABLE = object()
_MAX_ENTRIES = 8192

#: kinds of a ``Plan`` step
INPUT, VALUE, TENSOR = 0, 1, 2
#: where a ``TENSOR`` step's storage comes from
FRESH, OF_INPUT, OF_OUTPUT = 0, 1, 2


def _meta(fake) -> tuple:
    return tuple(fake.shape), fake.stride(), fake.storage_offset()


def fresh_storage(nbytes: int):
    """A new storage of ``nbytes`` bytes on the meta device, for fake tensors to view."""
    return torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()


def fake_view(fake_mode, storage, offset: int, size, stride, dtype, device):
    """A fake tensor of ``fake_mode`` viewing ``storage`` (a meta storage, e.g. another fake's) with the given
    metadata; built from plain meta tensors outside any dispatch mode, which is cheap (a few microseconds)."""
    from torch._subclasses.fake_tensor import FakeTensor

    with torch._C._DisableTorchDispatch():  # local meta tensors, also under mesh.activate()
        meta = torch.empty(0, dtype=dtype, device="meta")
        meta.set_(storage, offset, size, stride)
        return FakeTensor(fake_mode, meta, device)


def call_key(function, shapes, args: tuple, kwargs: dict, tensor_type, mesh_type):
    """``(key, tensors)`` of a call of ``function`` (and its ``shapes``) with ``args``/``kwargs``: the cache key of its
    plan, and its remote tensor arguments (``tensor_type``) in order. Fast for what torch ops pass (positional
    tensors, plain values and lists of them; plain keyword values); anything else is keyed by its pytree
    (``torch.utils._pytree``). The key is None if the call cannot be cached (a local tensor, an unhashable value).
    ``function`` may be None where ``shapes`` determines it (a torch op and its ``FunctionPath``)."""
    parts = [function, shapes, len(args)]
    tensors = []
    for x in args:
        t = type(x)
        if t is tensor_type:
            storage = x._storage
            for alias, other in enumerate(tensors):
                if other._storage is storage:
                    break
            else:
                alias = len(tensors)
            tensors.append(x)
            parts.append((x._meta, alias))
        elif t in _PLAIN:
            parts.append((t, x))
        elif t in _SEQUENCES and all(type(v) in _PLAIN for v in x):
            parts.append((t, *x))
        else:
            return _pytree_key(function, shapes, args, kwargs, tensor_type, mesh_type)
    for name, x in kwargs.items():
        if type(x) not in _PLAIN:
            return _pytree_key(function, shapes, args, kwargs, tensor_type, mesh_type)
        parts.append((name, type(x), x))
    return tuple(parts), tensors


def _pytree_key(function, shapes, args, kwargs, tensor_type, mesh_type):
    from torch.utils._pytree import tree_flatten

    leaves, spec = tree_flatten((args, kwargs))
    parts = [function, shapes, spec]
    storages: dict = {}
    tensors = []
    for x in leaves:
        t = type(x)
        if t in _PLAIN:
            parts.append((t, x))
        elif t is tensor_type:
            alias = storages.setdefault(x._storage, len(storages))
            tensors.append(x)
            parts.append((x._meta, alias))
        elif t is mesh_type:
            parts.append(("mesh", id(x)))
        elif isinstance(x, torch.Tensor):
            return None, [x for x in leaves if isinstance(x, tensor_type)]
        elif hasattr(t, "propagation_key"):  # an object whose key must not keep it alive (a process group)
            parts.append(x.propagation_key())
        else:
            try:
                hash(x)
            except TypeError:
                return None, [x for x in leaves if isinstance(x, tensor_type)]
            parts.append((t, x))
    return tuple(parts), tensors


_views: dict = {}  # OpOverload -> whether it is a view op (every output aliases an input, nothing is written)


def _is_view(op) -> bool:
    view = _views.get(op)
    if view is None:
        schema = op._schema
        view = _views[op] = bool(schema.returns) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        ) and not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    return view


def _on_meta(op, fake_args, fake_kwargs, input_fakes):
    """The outputs of view op ``op`` computed by its meta kernel on the fakes' meta tensors, outside the fake mode
    (a view's metadata only; ``x[rows]`` with new ``rows`` each step, which the fake mode took about 80 % of a
    miss to decompose and cache), as fake tensors on the inputs' storages; None if that fails or is not simple
    (then the fake mode computes them, and raises what torch raises)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_flatten, tree_unflatten

    if not input_fakes:
        return None
    device = input_fakes[0].fake_device
    if any(f.fake_device != device for f in input_fakes):
        return None
    try:
        with torch._C._DisableTorchDispatch():
            out = op(*fake_args, **fake_kwargs)
    except Exception:
        return None
    leaves, spec = tree_flatten(out)
    if not leaves or any(type(leaf) is not torch.Tensor or leaf.device.type != "meta" for leaf in leaves):
        return None
    return tree_unflatten([FakeTensor(input_fakes[0].fake_mode, leaf, device) for leaf in leaves], spec)


def offset_free(key):
    """``key`` (a ``call_key`` of positional tensors and plain values) without its tensors' storage offsets, or None
    for a key of another form (``_pytree_key``'s)."""
    if type(key[2]) is not int:
        return None
    return key[:3] + tuple(((p[0][0], p[0][1], p[0][3], p[0][4]), p[1]) if type(p[0]) is tuple else p
                           for p in key[3:])


class Plan:
    """What a call with a given key makes (see the module's docstring). ``steps`` has one entry per output leaf:
    ``(INPUT, i)`` (the call returns its input ``i``), ``(VALUE, v)`` (a plain value), or ``(TENSOR, meta,
    requires_grad, where, which)`` with ``meta`` = ``(size, stride, storage offset, dtype, device)`` viewing a
    ``FRESH`` storage of ``which`` bytes, input ``which``'s storage (``OF_INPUT``) or that of output leaf ``which``
    (``OF_OUTPUT``). ``spec`` is the outputs' pytree (None: one leaf, returned as it is); ``written`` are the indices
    of the inputs the call writes; ``groups`` says whether the call passes process groups (``RemoteProcessGroup``),
    which the call must find among its arguments."""

    __slots__ = ("steps", "spec", "written", "groups")

    def __init__(self, steps: tuple, spec, written: tuple):
        self.steps = steps
        self.spec = spec
        self.written = written
        self.groups = False


class Propagator:
    """Runs or reuses propagation for one session (``fake_mode`` is the session's ``FakeTensorMode``)."""

    def __init__(self, fake_mode):
        self.fake_mode = fake_mode
        self._plans: dict = {}
        self._offset_free: dict = {}  # offset_free(key) -> a torch op's plan that views no input (module docstring)
        self._default_dtype = torch.get_default_dtype()  # the plans' outputs follow it: they go when it changes
        self.hits = 0
        self.misses = 0

    def plan(self, key) -> Plan | None:
        """The plan for ``key`` (counted as a hit), or None."""
        if torch.get_default_dtype() is not self._default_dtype:
            self._plans.clear()
            self._offset_free.clear()
            self._default_dtype = torch.get_default_dtype()
        plan = self._plans.get(key)
        if plan is None or plan is _UNCACHEABLE:
            return None
        self.hits += 1
        return plan

    def plan_at_other_offsets(self, key) -> Plan | None:
        """For a torch op's ``key`` that has no plan: the plan of the same call with its inputs at other storage
        offsets, if that plan views no input (counted as a hit, and kept under ``key`` too), else None."""
        if not self._offset_free or self._plans.get(key) is _UNCACHEABLE:
            return None
        free = offset_free(key)
        plan = None if free is None else self._offset_free.get(free)
        if plan is None:
            return None
        if len(self._plans) >= _MAX_ENTRIES:
            self._plans.clear()
        self._plans[key] = plan
        self.hits += 1
        return plan

    def learned(self, key, plan: Plan) -> None:
        """Keep ``plan``, learned elsewhere (on the mesh's first rank: ``cached_propagation.py``, after ``run``
        raised, which counted the miss), for ``key``. A plan with a value that is not plain is not kept (a value
        object would be shared by every call): each such call learns again."""
        if key is None or any(s[0] == VALUE and type(s[1]) not in _PLAIN for s in plan.steps):
            return
        if len(self._plans) >= _MAX_ENTRIES:
            self._plans.clear()
            self._offset_free.clear()
        self._plans[key] = plan

    def run(self, key, shapes, fake_args, fake_kwargs, input_fakes, writes=(), torch_op: bool = False):
        """``(output pytree, mutated input indices, plan)``: ``shapes(*fake_args, **fake_kwargs)`` computed under the
        fake mode, and the ``Plan`` recorded for ``key`` (None if the call cannot be cached). ``writes`` are the
        indices of inputs the call writes besides those whose fake version moved; ``torch_op``: ``shapes`` is a
        torch op (an ``OpOverload``), whose plan may be kept for other input offsets too (the module's docstring).
        Call it inside ``local.propagating()``."""
        self.misses += 1
        before = [(f._version, _meta(f)) for f in input_fakes]
        out = _on_meta(shapes, fake_args, fake_kwargs, input_fakes) if torch_op and _is_view(shapes) else None
        if out is None:
            with self.fake_mode:
                out = shapes(*fake_args, **fake_kwargs)
        mutated = [i for i, (f, (v, _)) in enumerate(zip(input_fakes, before)) if f._version != v]
        plan = None
        if key is not None and self._plans.get(key) is not _UNCACHEABLE:
            changed = any(_meta(f) != m for f, (_, m) in zip(input_fakes, before))
            plan = None if changed else self._record(out, input_fakes, sorted(set(mutated) | set(writes)))
            if len(self._plans) >= _MAX_ENTRIES:
                self._plans.clear()
                self._offset_free.clear()
            self._plans[key] = _UNCACHEABLE if plan is None else plan
            if torch_op and plan is not None and not any(s[0] == TENSOR and s[3] == OF_INPUT for s in plan.steps):
                free = offset_free(key)
                if free is not None:
                    self._offset_free[free] = plan
        return out, mutated, plan

    @staticmethod
    def _record(out, input_fakes, written) -> Plan | None:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._pytree import tree_flatten

        leaves, spec = tree_flatten(out, is_leaf=lambda x: x is None)
        by_id = {id(f): i for i, f in enumerate(input_fakes)}
        storage_of_input = {f.untyped_storage()._cdata: i for i, f in enumerate(input_fakes)}
        storage_of_output: dict = {}
        steps = []
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                if id(leaf) in by_id:
                    steps.append((INPUT, by_id[id(leaf)]))
                    continue
                if not isinstance(leaf, FakeTensor):
                    return None
                storage = leaf.untyped_storage()
                cdata = storage._cdata
                if cdata in storage_of_input:
                    where, which = OF_INPUT, storage_of_input[cdata]
                elif cdata in storage_of_output:
                    where, which = OF_OUTPUT, storage_of_output[cdata]
                else:
                    where, which = FRESH, storage.nbytes()
                    storage_of_output[cdata] = k
                meta = (tuple(leaf.shape), leaf.stride(), leaf.storage_offset(), leaf.dtype, leaf.device)
                steps.append((TENSOR, meta, leaf.requires_grad, where, which))
            elif type(leaf) in _PLAIN:
                steps.append((VALUE, leaf))
            else:
                return None
        single = spec.is_leaf() and len(steps) == 1
        return Plan(tuple(steps), None if single else spec, tuple(written))
