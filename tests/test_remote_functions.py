"""Monarch's test_remote_functions.py on CPU workers (spec §9 "Python tests", test_remote_functions.py; spec §1
``remote``, §3 "Controller").

Monarch's ``local_device_mesh(2, 2)`` is the ``mesh2x2`` fixture, ``local_device_mesh(1, 2)`` is ``mesh1x2`` below
(the first two workers of the same cluster). Monarch's worker-side ``do_bogus_tensor_work`` reads the global rank
from the environment; here it gets it as an argument (``mesh.rank(mesh.names)``, the global rank on a root mesh).
Cases that need process groups, pipes, streams, opaque objects or ``call_on_shard_and_fetch`` are not here.
"""

from __future__ import annotations

import pytest
import torch

import dask_monarch as dm
from dask_monarch.protocol import RemoteFunctionFailed

TIMEOUT = 60


def fetch(obj, shard=None, **coords):
    return dm.fetch_shard(obj, shard, **coords).result(timeout=TIMEOUT)


@pytest.fixture
def mesh1x2(client4):
    """Monarch's 1x2 mesh (host=1, gpu=2) on the first two workers of the four-worker cluster."""
    mesh = dm.attach(client4, dims={"host": 1, "gpu": 2}, comm_timeout=60, record_answers=True)
    yield mesh
    if not mesh._session.closed:
        try:
            mesh.exit()
        except Exception:
            pass


def _do_bogus_tensor_work(x, y, rank=None, fail_rank=None):
    return x + y  # the real function does x @ y


def do_bogus_tensor_work(x, y, rank=None, fail_rank=None):
    """On the worker: ``x @ y`` (which fails for two 3x4 tensors) on global rank ``fail_rank``, or on every rank
    without one; ``x`` elsewhere."""
    if fail_rank is not None and int(rank) != fail_rank:
        return x
    return x @ y


bogus = dm.remote(do_bogus_tensor_work, propagate=_do_bogus_tensor_work)


def failures(mesh) -> list:
    """The ``RemoteFunctionFailed`` answers the session received, as (rank, seq)."""
    return [(rank, msg.seq) for rank, msg in mesh._session.answers if isinstance(msg, RemoteFunctionFailed)]


# -------------------------------------------------------------------------------------------- failures
def test_eager_remote_function_failed(mesh1x2):
    with mesh1x2.activate():
        x = torch.rand(3, 4)
        y = torch.rand(3, 4)
        z = bogus(x, y, mesh1x2.rank(mesh1x2.names), fail_rank=1)
        a = z + x
        with pytest.raises(dm.RemoteException, match="do_bogus_tensor_work") as info:
            _ = fetch(a)  # shard 0, where z did not fail
    assert info.value.rank == 1
    assert "mat1 and mat2 shapes cannot be multiplied" in info.value.backtrace
    assert {rank for rank, _ in failures(mesh1x2)} == {1}  # reported by rank 1 only, once
    assert len(failures(mesh1x2)) == 1


def test_remote_exception(mesh2x2):
    with mesh2x2.activate():
        x = torch.rand(3, 4)
        y = torch.rand(3, 4)
        z = bogus(x, y)
        a = z + x
        b = x + y
        with pytest.raises(dm.RemoteException, match="do_bogus_tensor_work"):
            _ = fetch(a)
        # but values not dependent on z are fine
        lx, ly, lb = fetch((x, y, b))
    assert torch.allclose(lb, lx + ly)


def test_distributed_error(mesh2x2):
    with mesh2x2.activate():
        x = torch.rand(3, 4)
        y = torch.rand(3, 4)
        # z is broken on rank 1 but not others
        z = bogus(x, y, mesh2x2.rank(mesh2x2.names), fail_rank=1)
        # rank 1 is still doing work despite z failing
        a = (x + y).reduce("gpu")
        la = fetch(a)
        lx = [fetch(x, host=0, gpu=g) for g in range(2)]
        ly = [fetch(y, host=0, gpu=g) for g in range(2)]
        with dm.no_mesh.activate():  # local arithmetic on fetched values
            assert torch.allclose(la, lx[0] + ly[0] + lx[1] + ly[1])
        # z itself fails, even fetched from rank 0: a fetch waits for every rank
        with pytest.raises(dm.RemoteException, match="do_bogus_tensor_work") as info:
            fetch(z)
        assert info.value.rank == 1
        # reducing z: rank 1 still takes part (no deadlock), and the result depends on the error
        rz = z.reduce("gpu")
        with pytest.raises(dm.RemoteException, match="do_bogus_tensor_work"):
            fetch(rz)
        # the reduce did not leave anything stuck: a later value from (host 0, gpu 1) comes back
        l2x = fetch(2 * x, gpu=1, host=0)
    assert torch.allclose(l2x, 2 * lx[1])


def test_remote_function_failure_message_contains_traceback(mesh2x2):
    def inner_remote_function(x):
        return x @ x

    def outer_remote_function(x):
        return inner_remote_function(x)

    with mesh2x2.activate():
        x = dm.remote(outer_remote_function, propagate=lambda x: x.clone())(torch.rand(3, 4))
        with pytest.raises(dm.RemoteException) as info:
            fetch(x)
    assert "outer_remote_function" in str(info.value)
    assert "inner_remote_function" in info.value.backtrace


# ----------------------------------------------------------------------------------------------- values
def test_return_exception(mesh2x2):
    def simple():
        return Exception("is a valid value to return")

    with mesh2x2.activate():
        dm.remote(simple, propagate=lambda: None)()  # no outputs: nothing to fetch, nothing failed
        # a handle to the returned object: fetching it gives the Exception back as a value
        handle = dm.remote(simple, propagate=lambda: torch.empty(()))()
        value = fetch(handle, host=1, gpu=1)
    assert type(value) is Exception and str(value) == "is a valid value to return"
    assert failures(mesh2x2) == []
    mesh2x2.exit()  # no failure to raise


def test_user_call(mesh2x2):
    rlist = dm.remote("builtins.list", propagate=lambda elem: list(elem))
    with mesh2x2.activate():
        x = torch.rand(3, 4)
        y = rlist((x + 1, x))
        assert isinstance(y, list) and len(y) == 2 and all(isinstance(t, dm.Tensor) for t in y)
        ly0, ly1 = fetch(y)
    assert torch.allclose(ly0, ly1 + 1)


# --------------------------------------------------------------------------------- propagation cache
def how_many_of_these_do_you_want(n, t):
    return [torch.ones_like(t) for _ in range(n)]


def remote_chunk(t):
    return t.chunk(4)


def test_cached_remote_function(mesh2x2):
    fn = dm.remote(how_many_of_these_do_you_want)
    session = mesh2x2._session
    with mesh2x2.activate():
        x = torch.ones(3, 4)
        y = torch.rand(3, 4)
        start_hits, start_misses = session.propagator.hits, session.propagator.misses

        a, _, _ = fn(3, x)  # miss
        b, _, _ = fn(3, x)  # hit
        assert session.aliases_of([a]) == [a]
        assert session.aliases_of([b]) == [b]
        _, _, _ = fn(3, y)  # hit: same function, same input metadata
        t0, t1 = fn(2, x)  # miss: another n
        assert session.propagator.hits - start_hits == 2
        assert session.propagator.misses - start_misses == 2

        assert b.shape == (3, 4) and b.dtype == torch.float32
        s = t0.add(t1)
        local_a, local_b, local_s = fetch((a, b, s))
    assert torch.all(local_a == 1.0) and torch.all(local_b == 1.0) and torch.all(local_s == 2.0)


def test_cached_remote_aliases(mesh2x2):
    fn = dm.remote(remote_chunk)
    session = mesh2x2._session
    with mesh2x2.activate():
        x = torch.randn(16, 5)
        for _ in range(2):  # the first call propagates on fakes, the second replays the cached recipe
            outs = fn(x)
            # x and the 4 results of x.chunk(4)
            assert len(session.aliases_of([outs[0]])) == 5
            assert outs[2]._fake.storage_offset() == 40
        hits = session.propagator.hits
        outs[1].mul_(0)  # in place on a chunk: x sees it
        lx, l2 = fetch((x, outs[2]))
    assert hits >= 1
    assert torch.all(lx[4:8] == 0)
    assert torch.equal(l2, lx[8:12])


# ------------------------------------------------------------------------- the worker's mesh, the user's file
def shard_of(x, mesh):
    """As docs/guide.md shows: a function that reads its rank and size from the mesh the worker gives it."""
    rank, size = mesh.dims["gpu"].rank, mesh.dims["gpu"].size
    return x[rank::size] * (1 + mesh.dims["host"].rank)


def test_default_propagation_runs_the_function_with_the_mesh_as_the_workers_see_it(mesh2x2):
    """No ``propagate=``: the controller learns the shapes by running the function with the worker-side mesh of
    the mesh's first rank (``mesh.dims[...]``), as Monarch runs it on shard 0; every rank computes its own."""
    assert mesh2x2.seen_from().dims["gpu"].rank == 0 and mesh2x2.seen_from(3).dims["host"].rank == 1
    with mesh2x2.activate():
        x = torch.arange(6.0)
        part = dm.remote(shard_of)(x, mesh2x2)
    assert part.shape == (3,)
    assert fetch(part, host=0, gpu=0).tolist() == [0.0, 2.0, 4.0]
    assert fetch(part, host=1, gpu=1).tolist() == [2.0, 6.0, 10.0]


def fails_on_worker(x):
    raise RuntimeError("raised in the user's file")  # the line the remote traceback must name


def test_remote_traceback_names_the_users_file_and_line(mesh2x2):
    """A function sent by value (a test module's, like ``__main__``'s) fails on the workers: the traceback names
    this file and the line of the ``raise``, not cloudpickle's ``<dynamic-code>``."""
    import inspect

    lines, first = inspect.getsourcelines(fails_on_worker)
    line = first + next(i for i, text in enumerate(lines) if text.strip().startswith("raise"))
    with mesh2x2.activate():
        y = dm.remote(fails_on_worker, propagate=lambda x: torch.empty_like(x))(torch.ones(2))
    with pytest.raises(dm.RemoteException) as info:
        fetch(y)
    assert f'File "{__file__}", line {line}, in fails_on_worker' in info.value.backtrace, info.value.backtrace
    assert "<dynamic-code>" not in info.value.backtrace
    assert lines[line - first].strip() in info.value.backtrace  # the source line too (the worker reads the file)
