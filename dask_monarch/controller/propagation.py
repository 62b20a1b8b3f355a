"""Output metadata of a call, learned on fake tensors and cached (spec §1: "Output shapes come from FakeTensors").

Running an op on fake tensors costs the controller a few hundred microseconds; a training loop repeats the same
ops on the same shapes. The first call with given input metadata runs ``propagate`` on fakes and records a
*recipe*: for each output, which input it is (an in-place op), or its size, strides, offset, dtype and device and
whose storage it shares (an input's, an earlier output's, or its own); and which inputs were mutated. Later calls
with the same function and the same input metadata rebuild the output fakes from the recipe. A call whose inputs
include local tensors, unhashable values, or whose propagation changed an input's metadata is never cached.
"""

from __future__ import annotations

import torch

__all__ = ["Propagator", "fake_view", "fresh_storage"]

_PLAIN = frozenset((int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format))
_UNCACHEABLE = object()
_MAX_ENTRIES = 8192


def _meta(fake) -> tuple:
    return tuple(fake.shape), fake.stride(), fake.storage_offset()


def fresh_storage(nbytes: int):
    """A new storage of ``nbytes`` bytes on the meta device, for fake tensors to view."""
    return torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()


def fake_view(fake_mode, storage, offset: int, size, stride, dtype, device):
    """A fake tensor of ``fake_mode`` viewing ``storage`` (a meta storage, e.g. another fake's) with the given
    metadata; built from plain meta tensors outside the fake mode, which is cheap (a few microseconds)."""
    from torch._subclasses.fake_tensor import FakeTensor

    meta = torch.empty(0, dtype=dtype, device="meta")
    meta.set_(storage, offset, size, stride)
    return FakeTensor(fake_mode, meta, device)


class Propagator:
    """Runs or replays propagation for one session (``fake_mode`` is the session's ``FakeTensorMode``)."""

    def __init__(self, fake_mode):
        self.fake_mode = fake_mode
        # fake_view: FakeTensor(mode, meta tensor, device) wraps without the converter's memo (60 us a call)
        self._recipes: dict = {}
        self.hits = 0
        self.misses = 0

    # ----------------------------------------------------------------------------------------------- key
    @staticmethod
    def key(function, shapes, spec, leaves, tensor_type, mesh_type):
        """The cache key of a call, or None if it cannot be cached."""
        parts = [function, shapes, spec]
        storages: dict = {}
        for x in leaves:
            t = type(x)
            if t in _PLAIN:
                parts.append((t, x))
            elif t is tensor_type:
                f = x._fake
                alias = storages.setdefault(f.untyped_storage()._cdata, len(storages))
                parts.append((tuple(f.shape), f.stride(), f.storage_offset(), f.dtype, f.device, alias))
            elif t is mesh_type:
                parts.append(("mesh", id(x)))
            elif isinstance(x, torch.Tensor):
                return None
            elif hasattr(t, "propagation_key"):  # an object whose key must not keep it alive (a process group)
                parts.append(x.propagation_key())
            else:
                try:
                    hash(x)
                except TypeError:
                    return None
                parts.append((t, x))
        return tuple(parts)

    # ------------------------------------------------------------------------------------------- run/replay
    def run(self, key, shapes, fake_args, fake_kwargs, input_fakes):
        """``(output pytree, mutated input indices)``: replayed from the recipe for ``key``, or computed by
        ``shapes(*fake_args, **fake_kwargs)`` under the fake mode and recorded. Call it inside
        ``dispatch.propagating()``."""
        recipe = self._recipes.get(key) if key is not None else None
        if recipe is not None and recipe is not _UNCACHEABLE:
            self.hits += 1
            return self._replay(recipe, input_fakes)
        self.misses += 1
        before = [(f._version, _meta(f)) for f in input_fakes]
        with self.fake_mode:
            out = shapes(*fake_args, **fake_kwargs)
        mutated = [i for i, (f, (v, _)) in enumerate(zip(input_fakes, before)) if f._version != v]
        if key is not None and recipe is None:
            changed = any(_meta(f) != m for f, (_, m) in zip(input_fakes, before))
            if len(self._recipes) >= _MAX_ENTRIES:
                self._recipes.clear()
            self._recipes[key] = _UNCACHEABLE if changed else self._record(out, input_fakes, mutated)
        return out, mutated

    def _record(self, out, input_fakes, mutated):
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
                    steps.append(("input", by_id[id(leaf)]))
                    continue
                if not isinstance(leaf, FakeTensor):
                    return _UNCACHEABLE
                storage = leaf.untyped_storage()
                cdata = storage._cdata
                if cdata in storage_of_input:
                    base = ("input", storage_of_input[cdata])
                elif cdata in storage_of_output:
                    base = ("output", storage_of_output[cdata])
                else:
                    base = ("fresh", storage.nbytes())
                    storage_of_output[cdata] = k
                steps.append(("tensor", *_meta(leaf), leaf.dtype, leaf.device, base))
            elif type(leaf) in _PLAIN:
                steps.append(("value", leaf))
            else:
                return _UNCACHEABLE
        return spec, steps, tuple(mutated)

    def _replay(self, recipe, input_fakes):
        from torch.utils._pytree import tree_unflatten

        spec, steps, mutated = recipe
        leaves = []
        for step in steps:
            kind = step[0]
            if kind == "input":
                leaves.append(input_fakes[step[1]])
            elif kind == "value":
                leaves.append(step[1])
            else:
                _, size, stride, offset, dtype, device, (where, which) = step
                if where == "fresh":
                    storage = fresh_storage(which)
                else:
                    storage = (input_fakes[which] if where == "input" else leaves[which]).untyped_storage()
                leaves.append(fake_view(self.fake_mode, storage, offset, size, stride, dtype, device))
        return tree_unflatten(leaves, spec), list(mutated)
