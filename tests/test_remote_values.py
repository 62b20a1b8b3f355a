"""Values of remote functions and outputs learned on rank 0 (issue 24 items 2 and 3), as a Monarch program uses them:
``remote(f).call(...)`` gives every rank's value as a value mesh, ``call_on_shard_and_fetch`` one rank's, every future
answers ``.get()``; a function that fake tensors cannot run (it reads values) has its outputs learned by running it
once on the mesh's first rank, cached per argument metadata (Monarch's "cached" propagation)."""

from __future__ import annotations

import inspect

import pytest
import torch

import dask_monarch as dm
from dask_monarch.controller.cached_propagation import DESCRIBE
from test_controller import record_sends

TIMEOUT = 120


@pytest.fixture(scope="module")
def mesh(shared_client4):
    mesh = dm.attach(shared_client4, dims={"host": 2, "gpu": 2}, comm_timeout=60)
    yield mesh
    mesh.exit()


def fetch(obj, **coords):
    return dm.fetch_shard(obj, coords).result(timeout=TIMEOUT)


def learning_calls(sent) -> int:
    return sum(1 for kind, _, msg in sent if kind == "SendValue" and msg.function == DESCRIBE)


@dm.remote
def return_them(x, y):
    return x, y


# ------------------------------------------------------------------------------------------ values of calls
def test_call_gives_every_ranks_value_as_a_value_mesh(mesh):
    with mesh.activate():
        values = return_them.call(mesh.rank("host"), mesh.rank("gpu")).get(timeout=TIMEOUT)
    assert isinstance(values, dm.ValueMesh) and len(values) == 4 and values.sizes == {"host": 2, "gpu": 2}
    points = []
    for point, (h, g) in values:  # Monarch's test_value_mesh: each rank's coordinates, in rank order
        assert (point["host"], point["gpu"]) == (h.item(), g.item())
        points.append((point.rank, dict(point)))
    assert points == [(0, {"host": 0, "gpu": 0}), (1, {"host": 0, "gpu": 1}), (2, {"host": 1, "gpu": 0}),
                      (3, {"host": 1, "gpu": 1})]
    h, g = values.item(host=1, gpu=0)
    assert (h.item(), g.item()) == (1, 0)
    assert [g.item() for _, g in values.slice(host=1).values()] == [0, 1]
    with pytest.raises(KeyError, match="missing \\['gpu'\\]"):
        values.item(host=1)


def test_call_on_shard_and_fetch_gives_one_ranks_value(mesh):
    def process(text, x):
        return f"{text} processed on {int(x.sum())}"

    def close_to_seven(x):
        return torch.allclose(x, torch.full_like(x, 7.0))

    with mesh.activate():
        x = torch.full((3,), 7.0) + mesh.rank("gpu")
        assert dm.call_on_shard_and_fetch(process, "an argument", x).get() == "an argument processed on 21"
        assert dm.call_on_shard_and_fetch(dm.remote(process), "it", x, shard={"host": 1, "gpu": 1}).result() == \
            "it processed on 24"
        assert dm.call_on_shard_and_fetch(close_to_seven, x).result(timeout=TIMEOUT) is True  # bool() of a value
        assert dm.remote(close_to_seven).call_on_shard_and_fetch(x, shard={"host": 0, "gpu": 1}).get() is False
        returned = dm.call_on_shard_and_fetch(lambda: Exception("a valid value to return")).result()
        assert type(returned) is Exception
        one = dm.remote(process).call_one
        with pytest.raises(ValueError, match="mesh of one rank"):
            one("x", x)
    with mesh.slice(host=1, gpu=0).activate():
        assert dm.remote(process).call_one("rank 2", torch.ones(2)).get() == "rank 2 processed on 2"


def test_a_function_that_raises_on_a_rank_fails_that_call_only(mesh):
    def check(x, rank):
        if int(rank) == 3:
            raise ValueError("rank 3 refuses")  # the remote traceback quotes this line
        return x.sum().item()

    with mesh.activate():
        x = torch.ones(4)
        future = dm.remote(check).call(x, mesh.rank(("host", "gpu")))
        with pytest.raises(dm.RemoteException, match="rank 3 refuses") as info:
            future.result(timeout=TIMEOUT)
        assert info.value.rank == 3
        assert list(dm.remote(check).call(x, 0).get(timeout=TIMEOUT).values()) == [4.0] * 4


def test_a_declared_write_is_a_mutation_of_the_call(mesh):
    def bump(x):
        x.add_(1)
        return x.sum().item()

    def bump_shapes(x):
        x.add_(1)  # declares the write: the call's mutates name x and its aliases

    sent = record_sends(mesh._session)
    with mesh.activate():
        x = torch.zeros(2)
        view = x[:1]
        assert list(dm.remote(bump, propagate=bump_shapes).call(x).get().values()) == [2.0] * 4
    (message,) = [msg for kind, _, msg in sent if kind == "SendValue" and msg.mutates]
    assert {r.id for r in message.mutates} == {x.ref.id, view.ref.id}
    assert torch.equal(fetch(x, host=1, gpu=1), torch.ones(2))


def test_every_future_answers_get(mesh):
    class Echo:
        def back(self, v):
            return v

    echo = mesh.spawn(Echo)
    with mesh.activate():
        t = torch.arange(3.0)
        fetched = dm.fetch_shard(t).get(timeout=TIMEOUT)
        assert dm.fetch_shard(5).get() == 5  # nothing remote: an answered future
        assert list(echo.back.call(7).get(timeout=TIMEOUT).values()) == [7] * 4
        assert echo.back.call_one(8, host=0, gpu=1).get(timeout=TIMEOUT) == 8
        assert isinstance(echo.back.call(1).get(timeout=TIMEOUT), dm.ValueMesh)
    assert torch.equal(fetched, torch.arange(3.0))


# ---------------------------------------------------------------------------------- outputs learned on rank 0
def positives_twice(x):
    n = int((x > 0).sum())  # a value: fake tensors cannot run this
    return x[:n] * 2, n


def test_a_function_that_reads_values_learns_its_outputs_on_rank_0_once(mesh):
    sent = record_sends(mesh._session)
    fn = dm.remote(positives_twice)
    with mesh.activate():
        x = torch.tensor([3.0, 1.0, -2.0, -5.0]) * (1 + mesh.rank("gpu"))
        y, n = fn(x)
        assert (y.shape, y.dtype, n) == ((2,), torch.float32, 2)
        assert learning_calls(sent) == 1
        y2, _ = fn(x + 1)  # the same argument metadata: the learned outputs are kept
        assert learning_calls(sent) == 1 and y2.shape == (2,)
    assert torch.equal(fetch(y, host=1, gpu=1), torch.tensor([12.0, 4.0]))
    assert torch.equal(fetch(y2, host=0, gpu=0), torch.tensor([8.0, 4.0]))


def test_learning_runs_on_copies_and_leaves_the_random_state(mesh):
    def noisy_count(x):
        x.add_(1)  # written: the real call writes it once, on every rank
        return x + torch.rand(x.shape), int((x > 0).sum())

    with mesh.activate():
        dm.remote(torch.manual_seed, propagate="inspect")(7)
        x = torch.zeros(3)
        noisy, count = dm.remote(noisy_count)(x)
        after = torch.rand(2)
    assert count == 3
    assert torch.equal(fetch(x, host=0, gpu=0), torch.ones(3))  # rank 0 ran it twice: once on a copy
    assert torch.equal(fetch(noisy, host=0, gpu=0), fetch(noisy, host=1, gpu=1))
    assert torch.equal(fetch(after, host=0, gpu=0), fetch(after, host=1, gpu=0))  # rank 0's generator put back


def test_a_function_returning_python_values_works_without_propagate(mesh):
    def stats(x):
        return {"mean": x.mean().item(), "size": x.numel(), "name": "stats"}

    with mesh.activate():
        got = dm.remote(stats)(torch.arange(4.0) + mesh.rank("host"))
    assert got == {"mean": 1.5, "size": 4, "name": "stats"}  # rank 0's, as Monarch returns them


def test_data_dependent_shapes_and_propagate_cached(mesh):
    sent = record_sends(mesh._session)
    with mesh.activate():
        x = torch.tensor([[0.0, 1.0], [2.0, 0.0]]) * (1 + mesh.rank("host"))
        nz = dm.remote("torch.nonzero")(x)  # its output's shape depends on x's values
        assert nz.shape == (2, 2) and nz.dtype == torch.int64
        doubled = dm.remote(lambda t: t * 2, propagate="cached")(x)
        assert doubled.shape == (2, 2) and learning_calls(sent) == 2
    assert fetch(nz, host=1, gpu=0).tolist() == [[0, 1], [1, 0]]
    assert torch.equal(fetch(doubled, host=1, gpu=1), torch.tensor([[0.0, 4.0], [8.0, 0.0]]))
    with pytest.raises(NotImplementedError, match="mocked"):
        dm.remote(torch.add, propagate="mocked")


def wrong_view(x):
    return x.view(3, 5)  # of 4 elements: a plain bug


def test_a_wrong_function_is_told_what_raised_not_to_pass_propagate(mesh):
    with mesh.activate():
        with pytest.raises(RuntimeError, match="the function raised on the shapes of its arguments") as info:
            dm.remote(wrong_view)(torch.ones(4))
        assert "propagate=" not in str(info.value)
        assert "return x.view(3, 5)  # of 4 elements" in str(info.value)  # the user's line, quoted
        assert f'File "{__file__}"' in str(info.value)
        assert dm.inspect(torch.ones(2) * 3).tolist() == [3.0, 3.0]  # the session goes on


def too_big(x):
    if x.sum() > 100:
        raise ValueError("too big for this function")  # quoted from rank 0's traceback
    return x


def test_when_both_fail_the_error_quotes_the_users_line(mesh):
    lines, first = inspect.getsourcelines(too_big)
    with mesh.activate():
        with pytest.raises(dm.RemoteException, match="too big for this function") as info:
            dm.remote(too_big)(torch.full((4,), 50.0))
    text = str(info.value)
    assert "run once on rank 0 to learn its outputs" in text
    assert f'File "{__file__}", line {first + 2}, in too_big' in text and lines[2].strip() in text


def test_learning_is_refused_inside_coalescing_until_it_is_known(mesh):
    fn = dm.remote(positives_twice)
    with mesh.activate():
        x = torch.tensor([1.0, 2.0, -3.0])
        with pytest.raises(RuntimeError, match="inside dask_monarch.coalescing\\(\\) the controller cannot wait"):
            with dm.coalescing():
                fn(x)
        fn(x)  # learned here, outside
        with dm.coalescing():
            y, n = fn(x * 2)
    assert n == 2 and torch.equal(fetch(y, host=1, gpu=1), torch.tensor([4.0, 8.0]))
