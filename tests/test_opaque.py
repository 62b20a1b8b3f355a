"""Worker-side objects (issue 24 item 4), as a Monarch program uses them: ``OpaqueRef`` (an object a remote function
keeps on each rank, named from the controller), ``OpaqueObject`` with ``opaque_method`` (an object built on every
rank whose methods the controller calls) and ``OpaqueModule`` (an ``nn.Module`` on every rank, with autograd across
the boundary). Objects live until the controller drops its handle or the session ends."""

from __future__ import annotations

import pytest
import torch

import dask_monarch as dm
from dask_monarch.opaque_module import OpaqueModule
from dask_monarch.opaque_object import OpaqueObject, opaque_method
from test_gradients import TIMEOUT, fetch, mesh  # noqa: F401 (mesh: a module-scoped {"dp": 2} mesh fixture)


def live_objects() -> int:
    """How many objects OpaqueRefs of this session hold on the rank that runs this."""
    from dask_monarch.worker.opaque import live_objects

    return live_objects()


def live_on_rank0() -> int:
    return dm.call_on_shard_and_fetch(live_objects).result(timeout=TIMEOUT)


class Tally:
    """Lives on each rank: a running sum."""

    def __init__(self, start):
        self.total = torch.as_tensor(start, dtype=torch.float32).clone()

    def add(self, x):
        self.total = self.total + x.sum()
        return self.total.clone()

    def read(self):
        return float(self.total)


def new_tally(start):
    return dm.OpaqueRef(Tally(start))


def tally_add(ref, x):
    return ref.value.add(x)


make_tally = dm.remote(new_tally, propagate=lambda start: dm.OpaqueRef(None))
add_to_tally = dm.remote(tally_add, propagate=lambda ref, x: torch.empty(()))


# ------------------------------------------------------------------------------------------------ OpaqueRef
def test_an_object_kept_by_a_remote_function_is_used_by_later_calls_on_each_rank(mesh):
    with mesh.activate():
        tally = make_tally(mesh.rank("dp") * 10)
        assert isinstance(tally, dm.OpaqueRef)
        first = add_to_tally(tally, torch.ones(3))
        second = add_to_tally(tally, torch.ones(2))
        # each rank's own object, its state kept between calls: rank r started at 10 r
        assert [fetch(second, dp=r).item() for r in (0, 1)] == [5.0, 15.0]
        assert fetch(first, dp=1).item() == 13.0


def test_an_object_is_freed_when_the_controller_drops_its_handle(mesh):
    with mesh.activate():
        before = live_on_rank0()
        tally = make_tally(1.0)
        assert live_on_rank0() == before + 1
        del tally  # what is sent next runs without the object (Monarch's test_opaqueRef_key_deleted)
        assert live_on_rank0() == before


def key_table_size() -> int:
    from dask_monarch import opaque_ref

    return len(list(opaque_ref._key_table.keys()))


def test_monarchs_key_table_holds_the_objects_of_the_calling_session(mesh):
    """``opaque_ref._key_table`` (Monarch's name) in a remote function: this rank's objects of the session."""
    with mesh.activate():
        before = dm.call_on_shard_and_fetch(key_table_size).result(timeout=TIMEOUT)
        tally = make_tally(1.0)
        assert dm.call_on_shard_and_fetch(key_table_size).result(timeout=TIMEOUT) == before + 1
        del tally
        assert dm.call_on_shard_and_fetch(key_table_size).result(timeout=TIMEOUT) == before
    from dask_monarch import opaque_ref

    assert len(opaque_ref._key_table) == 0  # on the controller: no stream, no objects
    with pytest.raises(AttributeError, match="no_such_name"):
        opaque_ref.no_such_name


def test_the_objects_of_a_session_are_freed_when_it_ends_while_the_controller_holds_them(client2):
    def keep_and_watch():
        import weakref

        from distributed import get_worker

        class Big:
            pass

        big = Big()
        get_worker()._opaque_test_watch = weakref.ref(big)
        return dm.OpaqueRef(big)

    def freed():
        from distributed import get_worker

        return get_worker()._opaque_test_watch() is None

    with dm.attach(client2, dims={"dp": 2}) as first, first.activate():
        held = dm.remote(keep_and_watch, propagate=lambda: dm.OpaqueRef(None))()
        assert dm.call_on_shard_and_fetch(freed).result(timeout=TIMEOUT) is False
    assert held is not None  # the handle outlives the session; the object does not
    with dm.attach(client2, dims={"dp": 2}) as second, second.activate():
        assert dm.call_on_shard_and_fetch(freed).result(timeout=TIMEOUT) is True
        assert dm.call_on_shard_and_fetch(live_objects).result(timeout=TIMEOUT) == 0  # no other session's objects


def test_the_controller_can_neither_make_nor_read_an_opaque_ref(mesh):
    with pytest.raises(RuntimeError, match="lives on the workers"):
        dm.OpaqueRef([1, 2])
    with mesh.activate():
        tally = make_tally(0.0)
        with pytest.raises(RuntimeError, match="lives on the workers"):
            tally.value
        with pytest.raises(RuntimeError, match="lives on the workers"):
            tally.value = 3


def test_a_function_reading_an_opaque_ref_needs_propagate(mesh):
    with mesh.activate():
        tally = make_tally(0.0)
        with pytest.raises(RuntimeError, match=r"propagate=") as info:
            dm.remote(tally_add)(tally, torch.ones(2))
        assert "once more on a rank" in str(info.value)  # not learned by calling into the object twice
        assert fetch(add_to_tally(tally, torch.ones(2))).item() == 2.0  # the object was not called meanwhile


# --------------------------------------------------------------------------------------------- OpaqueObject
class Stats(OpaqueObject):
    @opaque_method
    def add(self, x):
        return torch.empty(())


def test_opaque_object_builds_one_object_per_rank_and_calls_its_methods(mesh):
    with mesh.activate():
        stats = Stats(Tally, mesh.rank("dp") + 1.0)
        stats.add(torch.ones(4))
        total = stats.call_method("add", lambda self, x: torch.empty(()), torch.ones(1))
        assert [fetch(total, dp=r).item() for r in (0, 1)] == [6.0, 7.0]
        assert stats.call_method_on_shard_and_fetch("read").result(timeout=TIMEOUT) == 6.0
        stats.note = "kept on the controller"  # the handle is an ordinary Python object
        assert stats.note == "kept on the controller"
        same = Stats(stats)  # another handle of the same objects
        assert same.call_method_on_shard_and_fetch("read").result(timeout=TIMEOUT) == 6.0


def test_opaque_object_by_path_and_its_errors(mesh):
    with mesh.activate():
        seen = OpaqueObject("collections.Counter", "abca")
        assert seen.call_method_on_shard_and_fetch("most_common", 1).result(timeout=TIMEOUT) == [("a", 2)]
        with pytest.raises(TypeError, match="dotted path or a callable"):
            OpaqueObject(3)
        with pytest.raises(TypeError, match="propagation must be a function"):
            seen.call_method("most_common", None)
        with pytest.raises(dm.RemoteException, match="has no method 'nope'"):
            seen.call_method_on_shard_and_fetch("nope").result(timeout=TIMEOUT)
        broken = OpaqueObject("collections.Counter", 3)  # Counter(3) raises on every rank
        with pytest.raises(dm.RemoteException, match="TypeError"):
            broken.call_method_on_shard_and_fetch("total").result(timeout=TIMEOUT)


# --------------------------------------------------------------------------------------------- OpaqueModule
def linear_shapes(self, x):
    return torch.empty(x.shape[0], 3)


def test_opaque_module_parameters_alias_the_module_on_every_rank(mesh):
    with mesh.activate():
        linear = OpaqueModule("torch.nn.Linear", 3, 3)
        weight, bias = linear.parameters()
        assert weight.shape == (3, 3) and bias.shape == (3,) and weight.requires_grad and bias.requires_grad
        with torch.no_grad():
            for p in linear.parameters():
                p.zero_()
            bias.add_(mesh.rank("dp"))
        out = linear(torch.rand(4, 3), propagator=linear_shapes)
        assert out.requires_grad  # the parameters require grad
        got = [fetch(out, dp=r) for r in (0, 1)]
    assert torch.equal(got[0], torch.zeros(4, 3))  # the in-place ops reached each rank's module
    assert torch.equal(got[1], torch.ones(4, 3))


def test_opaque_module_backward_gives_the_gradients_torch_autograd_gives(mesh):
    with mesh.activate():
        linear = OpaqueModule(torch.nn.Linear, 3, 3)
        weight, bias = linear.parameters()
        x = (torch.arange(12.0).reshape(4, 3) / 10 + mesh.rank("dp")).requires_grad_()
        y = linear(x, propagator=linear_shapes)
        assert y.requires_grad
        (y * y).sum().backward()
        got = [fetch(t, dp=1) for t in (x.grad, weight.grad, bias.grad)]
        summed = fetch(weight.grad.reduce("dp", "sum"))  # gradients are remote tensors like any other
        each = [fetch(weight.grad, dp=r) for r in (0, 1)]
        lx, lw, lb = (fetch(t, dp=1) for t in (x, weight, bias))
    with dm.no_mesh.activate():
        lx, lw, lb = (t.clone().requires_grad_() for t in (lx, lw, lb))
        ly = lx @ lw.T + lb
        expected = torch.autograd.grad((ly * ly).sum(), (lx, lw, lb))
        for g, e in zip(got, expected):
            assert torch.allclose(g, e, atol=1e-6), (g, e)
        assert torch.allclose(summed, each[0] + each[1])


def test_opaque_module_graph_on_the_workers_is_freed_after_backward_or_with_the_outputs(mesh):
    with mesh.activate():
        linear = OpaqueModule("torch.nn.Linear", 3, 3)
        x = torch.rand(2, 3, requires_grad=True)
        base = live_on_rank0()  # the module itself
        y = linear(x, propagator=linear_shapes)
        assert live_on_rank0() == base + 1  # the backward closure over the forward's graph
        y.sum().backward()
        assert live_on_rank0() == base
        y = linear(x, propagator=linear_shapes)
        assert live_on_rank0() == base + 1
        del y  # no backward: the graph goes with the outputs
        assert live_on_rank0() == base


def test_opaque_module_without_gradients_records_no_graph(mesh):
    with mesh.activate():
        linear = OpaqueModule("torch.nn.Linear", 3, 3)
        base = live_on_rank0()
        x = torch.rand(2, 3, requires_grad=True)
        with torch.no_grad():
            y = linear(x, propagator=linear_shapes)
        assert not y.requires_grad and live_on_rank0() == base
        with pytest.raises(TypeError, match="propagator must be a function"):
            linear(x, propagator="inspect")
