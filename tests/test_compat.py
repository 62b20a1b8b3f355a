"""Small compatibility with Monarch (issue 24 item 7), as a Monarch program meets it: ``mesh(host=0)`` (the
deprecated spelling of ``slice``), ``exit()`` on a sub-mesh, ``RemoteException.worker_error_string``, mesh members
as lists, and error texts that carry the phrases Monarch's tests match on (``pytest.raises(..., match=...)`` in its
``python/tests``: test_controller, test_device_mesh) besides our explanations."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

import dask_monarch as dm
from dask_monarch.controller.mesh import DeviceMesh
from dask_monarch.protocol import Slice
from dask_monarch.worker.device_mesh import DeviceMesh as WorkerDeviceMesh

TIMEOUT = 120


OFFLINE = types.SimpleNamespace(tag="offline")  # what a mesh's shape operations and repr read of its session


def offline_mesh(sizes, names) -> DeviceMesh:
    """A controller mesh over ranks 0.. without a session: enough for its shape operations."""
    return DeviceMesh(OFFLINE, names, Slice.new_row_major(sizes))


# ------------------------------------------------------------------------------------ shapes, without a cluster
def test_monarchs_module_paths_give_the_same_objects():
    """A Monarch program's imports with ``monarch`` renamed (docs/coming-from-monarch.md): Monarch's
    ``python/tests/test_tensor_engine.py`` takes ``Actor``, ``as_endpoint``, ``endpoint`` from ``monarch.actor``,
    ``spawn_tensor_engine`` from ``monarch.mesh_controller`` and matches ``monarch.mesh_controller.RemoteException``
    after ``import monarch`` alone."""
    from dask_monarch.actor import Actor, Future, Point, ValueMesh, as_endpoint, endpoint
    from dask_monarch.mesh_controller import RemoteException, spawn_tensor_engine

    assert (Actor, as_endpoint, endpoint, ValueMesh) == (dm.Actor, dm.as_endpoint, dm.endpoint, dm.ValueMesh)
    assert Future is dm.MonarchFuture and Point.__name__ == "Point"
    assert (spawn_tensor_engine, RemoteException) == (dm.spawn_tensor_engine, dm.RemoteException)
    assert dm.mesh_controller.RemoteException is dm.RemoteException and dm.actor.Actor is dm.Actor


def test_calling_a_mesh_is_the_deprecated_slice():
    mesh = offline_mesh([2, 3, 4], ("a", "b", "c"))
    with pytest.warns(DeprecationWarning, match="mesh.slice"):
        point = mesh(a=0, b=0, c=0)
    assert point.processes[0] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        row = mesh(a=0, b=0)
        every_other = mesh(c=slice(None, None, 2))
        pair = mesh(b=2, c=3)
    assert row.names == ("c",) and row.processes[:] == (0, 1, 2, 3)  # a tuple, as Monarch's NDSlice gives
    assert every_other.processes[:] == tuple(range(24))[::2] == mesh.processes[::2]
    assert pair.processes[:] == (11, 23) and pair.processes[-1] == 23
    assert pair.processes[:] == mesh.slice(b=2, c=3).processes[:]


def test_split_and_flatten_errors_carry_monarchs_phrases():
    mesh = offline_mesh([60, 24], ("host", "gpu"))
    assert mesh.split(host=("dp", "pp"), gpu=("tp",), pp=4).processes.sizes == [15, 4, 24]
    with pytest.raises(ValueError, match="Cannot infer size") as e:
        mesh.split(host=("dp", "pp"))
    assert "give the sizes of all but one" in str(e.value)
    with pytest.raises(ValueError, match="unused size constraints"):
        mesh.split(host=("dp", "pp"), pp=4, ddp=3)
    with pytest.raises(ValueError, match="Duplicate dimension name"):
        mesh.split(host=("dp", "pp"), gpu=("pp",), dp=3)
    with pytest.raises(ValueError, match="evenly divided"):
        mesh.split(host=("dp", "pp"), dp=7)
    with pytest.raises(ValueError, match="cannot flatten sparse mesh"):
        DeviceMesh(OFFLINE, ("x",), Slice(0, [100], [2])).flatten("y")


def test_worker_mesh_members_are_lists():
    """Monarch's test_worker_mesh_init: a 3x4 mesh seen from ranks 1 and 6."""
    wdm = WorkerDeviceMesh(("a", "b"), Slice(0, [3, 4], [4, 1]), 1)
    a, b = wdm.dims["a"], wdm.dims["b"]
    assert (b.members, b.rank, a.members, a.rank) == ([0, 1, 2, 3], 1, [1, 5, 9], 0)
    assert type(a.members) is list
    wdm = WorkerDeviceMesh(("a", "b"), Slice(0, [3, 4], [4, 1]), 6)
    assert (wdm.dims["b"].members, wdm.dims["a"].members) == ([4, 5, 6, 7], [2, 6, 10])


def test_worker_mesh_takes_monarchs_constructor_arguments():
    """Monarch's worker builds its mesh as DeviceMesh(def_id, names, processes, rank=r); ours takes that form too."""
    wdm = WorkerDeviceMesh(7, ("a", "b"), Slice(0, [3, 4], [4, 1]), rank=6)
    assert (wdm.id, wdm.me, wdm.dims["b"].members, wdm.dims["a"].rank) == (7, 6, [4, 5, 6, 7], 1)
    assert WorkerDeviceMesh(7, ("a", "b"), Slice(0, [3, 4], [4, 1]), 6).dims["a"].members == [2, 6, 10]
    assert WorkerDeviceMesh(("a", "b"), Slice(0, [3, 4], [4, 1]), 6).id is None
    with pytest.raises(TypeError, match="Monarch's"):
        WorkerDeviceMesh(("a", "b"), Slice(0, [3, 4], [4, 1]))


def test_worker_frames_and_worker_error_string_of_a_text():
    backtrace = ('Traceback (most recent call last):\n  File "/w/a.py", line 3, in outer_fn\n    inner_fn()\n'
                 '  File "/w/a.py", line 7, in inner_fn\n    raise ValueError("no")\nValueError: no\n')
    e = dm.RemoteException(4, 1, "tcp://w", backtrace, "outer_fn")
    assert e.worker_error_string == backtrace
    assert [(f.filename, f.lineno, f.name, f.line) for f in e.worker_frames] == [
        ("/w/a.py", 3, "outer_fn", "inner_fn()"), ("/w/a.py", 7, "inner_fn", 'raise ValueError("no")')]


# ------------------------------------------------------------------------------------------------ on a mesh
@pytest.fixture(scope="module")
def mesh(shared_client2):
    mesh = dm.attach(shared_client2, dims={"host": 2, "gpu": 1}, comm_timeout=60)
    yield mesh
    mesh.exit()


def inner_remote_function():
    raise RuntimeError("deep down")


def outer_remote_function():
    inner_remote_function()
    return torch.zeros(1)


def test_remote_exception_gives_the_workers_error_string_and_frames(mesh):
    with mesh.activate():
        x = dm.remote(outer_remote_function, propagate=lambda: torch.empty(1))()
        with pytest.raises(dm.RemoteException) as info:
            dm.inspect(x)
    names = [frame.name for frame in info.value.worker_frames]
    assert names[-2:] == ["outer_remote_function", "inner_remote_function"]
    assert "deep down" in info.value.worker_error_string and "outer_remote_function" in info.value.worker_error_string


def test_reduce_errors_carry_monarchs_phrases(mesh):
    with mesh.activate():
        x = torch.rand(2, 4)
        for kwargs in ({"reduction": "sum", "scatter": True}, {"reduction": "stack"}):
            with pytest.raises(ValueError, match="is not valid for multiple dimensions"):
                x.reduce((), **kwargs)
        wrong = torch.rand(2, 4)
        with pytest.raises(ValueError, match=r"Reduce expects the shape to be torch.Size.") as e:
            x.reduce("host", reduction="sum", scatter=True, out=wrong)
        assert "torch.Size([4])" in str(e.value) and "torch.Size([2, 4])" in str(e.value)
        out = torch.rand(4)
        assert x.reduce("host", reduction="sum", scatter=True, out=out)._fake is out._fake


def test_a_sub_mesh_exits_the_session_as_monarchs_do(client2):
    mesh = dm.attach(client2, dims={"host": 2, "gpu": 1})
    host0 = mesh.slice(host=0)
    with host0.activate():
        value = dm.inspect(torch.ones(2) * 3)
    host0.exit()  # Monarch's sub-meshes share their parent's exit
    assert mesh._session.closed and torch.equal(value, torch.full((2,), 3.0))
    mesh.slice(host=1).exit()  # once ended, exit() returns at once
    mesh.exit()
    with pytest.raises(dm.SessionError):
        with mesh.activate():
            torch.ones(1)


def test_monarchs_test_panic_path_fails_the_session_with_its_phrase(client2):
    with dm.attach(client2, dims={"host": 2, "gpu": 1}) as mesh, mesh.activate():
        dm.remote("__test_panic", propagate="inspect")()
        with pytest.raises(dm.SessionError, match="__test_panic called"):
            dm.inspect(torch.ones(2, 3))


def set_device_then_ones(device):
    torch.cuda.set_device(device)
    return torch.ones(1)


def test_set_device_in_a_remote_function_names_the_devices_available(mesh):
    """Monarch's worker refuses torch.cuda.set_device to a device it was not given, with its phrase; a CPU worker
    has none (before, torch's own AttributeError about torch._C)."""
    with mesh.activate():
        x = dm.remote(set_device_then_ones, propagate=lambda device: torch.empty(1))(2)
        with pytest.raises(dm.RemoteException, match="Only devices None are available to monarch worker") as info:
            dm.inspect(x)
        assert "torch.cuda.set_device(2) was called" in info.value.worker_error_string
        assert dm.inspect(torch.ones(1) + 1).item() == 2  # the session goes on


class Doubler(dm.Actor):
    """A Monarch-style actor: derives from Actor, calls its __init__, marks its endpoint."""

    def __init__(self, k):
        super().__init__()
        self.k = k

    @dm.endpoint
    def double(self, x):
        return x * 2 + self.k


def test_monarchs_tensor_engine_and_actor_names(mesh):
    assert dm.spawn_tensor_engine(mesh) is mesh  # a dask_monarch mesh already is the tensor engine
    with pytest.raises(TypeError, match="DeviceMesh"):
        dm.spawn_tensor_engine("not a mesh")
    with mesh.activate():
        ranks = mesh.rank_tensor("host")
        assert [dm.inspect(ranks, host=h, gpu=0).item() for h in (0, 1)] == [0, 1]
        actors = mesh.spawn("doubler", Doubler, 1)
        assert actors.double.call(torch.ones(())).get(timeout=TIMEOUT).item(host=1, gpu=0).item() == 3
        actors.stop()
