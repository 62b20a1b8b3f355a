"""The controller's per-op fast path (issue 13: an op whose shapes are cached costs no fake tensors): plans reused
for inputs at other storage offsets, view ops' metadata from their meta kernels, and the storage's alias list
(``controller/propagation.py``, ``storage.py``; spec §1 "Dispatch")."""

from __future__ import annotations

import gc

import torch

import dask_monarch as dm
from dask_monarch.controller.propagation import offset_free

TIMEOUT = 60


def test_op_on_a_slice_at_another_offset_reuses_the_plan(mesh1):
    """``mm(x[rows], w)`` with other ``rows`` each step: the slice is a view (its offset follows ``rows``: a miss),
    the matmul makes a fresh tensor whatever its input's offset (a hit), and every value is right."""
    propagator = mesh1._session.propagator
    with mesh1.activate():
        x = torch.arange(40.0).reshape(10, 4)
        w = torch.eye(4) * 2
        torch.mm(x[0:2], w)  # learn the plan once
        misses = propagator.misses
        outs = [torch.mm(x[i:i + 2], w) for i in (1, 3, 5)]
        assert propagator.misses - misses == 3  # the three slices only
        assert [o.shape for o in outs] == [(2, 4)] * 3 and all(o.storage_offset() == 0 for o in outs)
        values = dm.inspect(outs)
    local = torch.arange(40.0).reshape(10, 4)
    for i, value in zip((1, 3, 5), values):
        assert torch.equal(value, local[i:i + 2] * 2)


def test_view_of_a_slice_at_another_offset_is_not_reused(mesh1):
    """A view's own offset depends on its input's: ``x[rows].t()`` learns its plan at each new offset."""
    propagator = mesh1._session.propagator
    with mesh1.activate():
        x = torch.arange(40.0).reshape(10, 4)
        x[0:2].t()
        misses = propagator.misses
        views = [x[i:i + 2].t() for i in (2, 6)]
        assert propagator.misses - misses == 4  # each slice and each transpose
        assert [v.storage_offset() for v in views] == [8, 24]
        values = dm.inspect(views)
    local = torch.arange(40.0).reshape(10, 4)
    assert torch.equal(values[0], local[2:4].t()) and torch.equal(values[1], local[6:8].t())


def test_offset_free_key_drops_only_the_tensor_offsets():
    meta = ((2, 4), (4, 1), 8, torch.float32, torch.device("cpu"))
    key = ("f", "op", 3, (meta, 0), (int, 1), (list, 2, 3))
    assert offset_free(key) == ("f", "op", 3, (((2, 4), (4, 1), torch.float32, torch.device("cpu")), 0), (int, 1),
                                (list, 2, 3))
    assert offset_free(("f", "op", object(), (meta, 0))) is None  # a pytree key keeps its offsets


def test_in_place_op_on_a_view_mutates_every_alias(mesh1):
    """The storage's alias list (weak references) still gives every live alias to an in-place op's ``mutates``."""
    session = mesh1._session
    with mesh1.activate():
        x = torch.zeros(6)
        a, b = x[0:3], x[3:6]
        assert {t.ref.id for t in session.aliases_of([a])} == {x.ref.id, a.ref.id, b.ref.id}
        b.add_(1)
        value = dm.inspect(x)
    assert torch.equal(value, torch.tensor([0.0, 0, 0, 1, 1, 1]))


def test_dead_views_leave_the_alias_list(mesh1):
    """Views made and dropped in a loop do not pile up in their storage's alias list."""
    with mesh1.activate():
        x = torch.zeros(8)
        for i in range(200):
            x[i % 8:]  # a view that dies at once
        gc.collect()
        assert len(x._storage._aliases) <= 16
        assert x._storage.aliases() == [x]
        x.add_(1)
        value = dm.inspect(x)
    assert torch.equal(value, torch.ones(8))


def test_view_ops_learn_their_metadata_from_the_meta_kernel(mesh1):
    """A view op's miss runs its meta kernel outside the fake mode: shapes, strides, offsets and values are torch's,
    and an invalid view raises torch's error."""
    views = {
        "slice": lambda t: t[3:7],
        "select": lambda t: t[2],
        "transpose": lambda t: t[1:5].t(),
        "split": lambda t: t.split(3)[1],
        "unbind": lambda t: t.unbind(1)[2],
        "expand": lambda t: t[0:1].expand(4, 6),
        "as_strided": lambda t: t.as_strided((2, 3), (1, 6), 5),
        "diagonal": lambda t: t[0:6].diagonal(offset=1),
        "view": lambda t: t[2:4].view(12),
    }
    local = torch.arange(60.0).reshape(10, 6)
    with mesh1.activate():
        x = torch.arange(60.0).reshape(10, 6)
        remote = {name: fn(x) for name, fn in views.items()}
        for name, r in remote.items():
            expected = views[name](local)
            assert (r.shape, r.stride(), r.storage_offset()) == (
                expected.shape, expected.stride(), expected.storage_offset()), name
            assert x.ref.id in {t.ref.id for t in mesh1._session.aliases_of([r])}, name
        try:
            x.t().view(60)
        except (RuntimeError, ValueError) as e:  # the fake mode's error, as without the meta kernel
            error = str(e)
        else:
            error = ""
        values = dm.inspect(list(remote.values()))
    assert "view" in error
    for (name, fn), value in zip(views.items(), values):
        assert torch.equal(value, fn(local)), name


def test_torch_compile_under_activate_runs_eagerly_on_the_mesh_without_dynamo_in_the_dispatch(mesh1):
    """The dispatch functions are marked for Dynamo to skip (``dispatch.skip_dynamo``), not wrapped per call in
    ``torch._disable_dynamo``: a ``torch.compile``d function called under ``activate()`` runs its ops on the mesh, and
    Dynamo compiles no frame of dask_monarch (unmarked, it compiled ``__torch_dispatch__`` and what it calls)."""
    import os

    from torch._dynamo import convert_frame

    from dask_monarch.controller.dispatch import MeshDispatchMode

    handler = MeshDispatchMode.__dict__["__torch_dispatch__"]
    assert not hasattr(handler, "_torchdynamo_orig_callable") and handler._torchdynamo_disable

    @torch.compile(backend="eager")
    def step(x):
        return torch.relu(x * 2 - 3) + 1

    package = os.path.dirname(dm.__file__)
    before = _compiled_codes(convert_frame)
    with mesh1.activate():
        y = step(torch.arange(4.0))
        assert isinstance(y, dm.Tensor)
        value = dm.inspect(y)
    assert torch.equal(value, torch.relu(torch.arange(4.0) * 2 - 3) + 1)
    assert not [c.co_filename for c in _compiled_codes(convert_frame) - before if c.co_filename.startswith(package)]


def _compiled_codes(convert_frame) -> set:
    """The code objects Dynamo has compiled in this process so far (``convert_frame.input_codes``)."""
    return {c for c in (code() for code in convert_frame.input_codes.seen) if c is not None}


def test_a_finalizer_run_by_the_collector_inside_a_compiled_function_is_not_compiled(mesh1):
    """The garbage collector may run a remote tensor's ``__del__`` in the middle of a ``torch.compile``d function
    called under ``activate()``; Dynamo sees that frame too, and must leave it (and the session's bookkeeping it calls)
    alone (``dynamo_skip.skip_dynamo`` on the finalizers). Found beside a CPU hog, where a collection happened to fall
    inside the compiled step of the test above: Dynamo had compiled tensor.py's ``__del__``, bookkeeping.py's
    ``drop_ref`` and coalescing.py's ``held_messages``."""
    import gc
    import os

    from torch._dynamo import convert_frame

    @torch.compile(backend="eager")
    def step(x):
        gc.collect()  # a graph break; the collection runs the finalizers of the garbage made below
        return x * 2

    package = os.path.dirname(dm.__file__)
    before = _compiled_codes(convert_frame)
    with mesh1.activate():
        for _ in range(3):
            a = torch.ones(4)
            garbage = [a]
            garbage.append(garbage)  # a cycle: only the collector frees it, inside step
            del a, garbage
            y = step(torch.arange(4.0))
        value = dm.inspect(y)
    assert torch.equal(value, torch.arange(4.0) * 2)
    compiled = [f"{c.co_filename}:{c.co_name}" for c in _compiled_codes(convert_frame) - before
                if c.co_filename.startswith(package)]
    assert not compiled, f"Dynamo compiled dask_monarch frames: {compiled}"


def _torch_way(monkeypatch) -> list:
    """The ops that reach ``dispatch.run_op`` (torch's dispatcher into the mode's or ``Tensor``'s handler)."""
    from dask_monarch.controller import dispatch
    from dask_monarch.controller.mesh import frontend

    seen, run_op = [], dispatch.run_op

    def counting(func, *rest, **kw):
        seen.append(func)
        return run_op(func, *rest, **kw)

    monkeypatch.setattr(dispatch, "run_op", counting)
    monkeypatch.setattr(frontend, "run_op", counting)
    return seen


def test_operators_with_a_cached_plan_skip_torchs_dispatcher(mesh1, monkeypatch):
    """``+ - * /`` on remote tensors and Python numbers (``1 + x``, ``0.5 * x`` too) send their op from the operator
    once the op's plan is cached (``dispatch.operator_call``), under ``activate()`` and outside it; values are
    torch's."""
    seen = _torch_way(monkeypatch)
    ops = [lambda a, b: a + b, lambda a, b: a - 2, lambda a, b: 1 + a, lambda a, b: a * b, lambda a, b: 0.5 * a,
           lambda a, b: a / b, lambda a, b: a * 3.0]
    la, lb = torch.arange(1.0, 7.0).reshape(2, 3), torch.full((2, 3), 4.0)
    with mesh1.activate():
        a, b = torch.arange(1.0, 7.0).reshape(2, 3), torch.full((2, 3), 4.0)
        [op(a, b) for op in ops]  # the plans are learned the way torch goes
        assert len(seen) >= len(ops)
        del seen[:]
        inside = [op(a, b) for op in ops]
    outside = [op(a, b) for op in ops]
    assert seen == []
    values = dm.inspect(inside + outside)
    for i, op in enumerate(ops):
        assert torch.equal(values[i], op(la, lb)) and torch.equal(values[len(ops) + i], op(la, lb)), i


def test_operators_go_torchs_way_where_torch_adds_something(mesh1, monkeypatch):
    """Autograd (an input that requires grad, grad mode on), another dispatch mode, a torch function mode and the
    profiler see ``x + y`` as without the shortcut; ``no_grad`` takes it."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    class Functions(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    seen = _torch_way(monkeypatch)
    add = torch.ops.aten.add.Tensor
    with mesh1.activate():
        x, y = torch.ones(3), torch.ones(3)
        x + y
        w = torch.ones(3).requires_grad_()
        w + y  # the plans are learned
        del seen[:]
        g = w + y
        assert seen == [add] and g.grad_fn is not None
        with torch.no_grad():
            assert (w + y).grad_fn is None and seen == [add]
        with Log() as log:
            x + y
        assert log.ops == [add] and seen == [add, add]
        with Functions() as functions:
            x + y
        assert functions.calls and seen == [add] * 3
        with torch.profiler.profile() as prof:
            x + y
        assert seen == [add] * 4 and "aten::add" in {e.key for e in prof.key_averages()}
        x + y
        assert seen == [add] * 4
        g.sum().backward()
        value = dm.inspect(w.grad)
    assert torch.equal(value, torch.ones(3))


def test_operator_shortcut_raises_what_torchs_way_raises(mesh1):
    """A dropped input raises ``TypeError`` DROPPED from the operator, cached plan or not."""
    with mesh1.activate():
        x, y = torch.ones(3), torch.ones(3)
        x + y
        y.drop()
        try:
            x + y
        except TypeError as e:
            error = str(e)
        else:
            error = ""
    assert error.startswith("DROPPED")
