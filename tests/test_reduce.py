"""The reduce values of Monarch's test_controller on a 2x2 mesh (host x gpu) of four CPU workers (spec §9:
reduce, reduce_out; spec §1 ``t.reduce``; spec §5 table), through gloo."""

from __future__ import annotations

import time

import pytest
import torch

import dask_monarch as dm

TIMEOUT = 60


def make_x(h, g):
    """Rank (h, g) holds 24h + 12g + arange(12).reshape(3, 4) (test_controller's x)."""
    return 24 * h + 12 * g + torch.arange(12, dtype=torch.float32).reshape(3, 4)


def local_x(h, g):
    return 24 * h + 12 * g + torch.arange(12, dtype=torch.float32).reshape(3, 4)


def fetch(t, **coords):
    return dm.fetch_shard(t, **coords).result(timeout=TIMEOUT)


@pytest.fixture
def x(mesh2x2):
    return dm.remote(make_x)(mesh2x2.rank("host"), mesh2x2.rank("gpu"))


def test_x_is_per_rank(mesh2x2, x):
    for h in range(2):
        for g in range(2):
            assert torch.equal(fetch(x, host=h, gpu=g), local_x(h, g))


def test_sum_over_gpu(mesh2x2, x):
    s = x.reduce("gpu", "sum")
    for h in range(2):
        for g in range(2):
            assert torch.equal(fetch(s, host=h, gpu=g), local_x(h, 0) + local_x(h, 1))


def test_result_of_a_reduce_under_activate_is_usable_in_later_ops(mesh2x2, x):
    # the result's fake tensor is made on the controller: under mesh.activate() it must not become a remote op
    with mesh2x2.activate():
        s = x.reduce("gpu", "sum")
        assert type(s._fake).__name__ == "FakeTensor"
        doubled = s * 2
    for h in range(2):
        assert torch.equal(fetch(doubled, host=h, gpu=1), 2 * (local_x(h, 0) + local_x(h, 1)))


def test_avg_over_host(mesh2x2, x):
    a = x.reduce("host", "avg")
    for g in range(2):
        assert torch.allclose(fetch(a, host=1, gpu=g), (local_x(0, g) + local_x(1, g)) / 2)


def test_stack_over_gpu(mesh2x2, x):
    st = x.reduce("gpu", "stack")
    assert tuple(st.shape) == (2, 3, 4)
    for h in range(2):
        expected = torch.stack([local_x(h, 0), local_x(h, 1)])
        assert torch.equal(fetch(st, host=h, gpu=1), expected)


def test_all_dims_total(mesh2x2, x):
    total = sum(local_x(h, g) for h in range(2) for g in range(2))
    for dims in ((), ("gpu", "host"), ("host", "gpu")):
        r = x.reduce(dims, "sum")
        assert torch.equal(fetch(r, host=1, gpu=0), total), dims


def test_min_max_prod(mesh2x2, x):
    assert torch.equal(fetch(x.reduce("host", "max"), host=0, gpu=1), local_x(1, 1))
    assert torch.equal(fetch(x.reduce("host", "min"), host=1, gpu=1), local_x(0, 1))
    assert torch.equal(fetch(x.reduce("gpu", "prod"), host=1, gpu=0), local_x(1, 0) * local_x(1, 1))


def make_pair(h, g):
    """A [2, 3] tensor per rank, for scatter over a dim of size 2: rows 100h + 10g and 100h + 10g + 1."""
    base = (100 * h + 10 * g).to(torch.float32) + torch.zeros(3)
    return torch.stack([base, base + 1])


def local_pair(h, g):
    return make_pair(torch.tensor(h), torch.tensor(g))


def test_reduce_scatter(mesh2x2):
    p = dm.remote(make_pair)(mesh2x2.rank("host"), mesh2x2.rank("gpu"))
    r = p.reduce("gpu", "sum", scatter=True)
    assert tuple(r.shape) == (3,)
    for h in range(2):
        total = local_pair(h, 0) + local_pair(h, 1)
        for g in range(2):
            assert torch.equal(fetch(r, host=h, gpu=g), total[g])


def test_stack_scatter_is_all_to_all(mesh2x2):
    p = dm.remote(make_pair)(mesh2x2.rank("host"), mesh2x2.rank("gpu"))
    r = p.reduce("gpu", "stack", scatter=True)
    assert tuple(r.shape) == (2, 3)
    for h in range(2):
        for g in range(2):
            expected = torch.stack([local_pair(h, 0)[g], local_pair(h, 1)[g]])
            assert torch.equal(fetch(r, host=h, gpu=g), expected)


def test_scatter_needs_first_dim_equal_to_group(mesh2x2, x):
    with pytest.raises(TypeError, match="When scattering"):
        x.reduce("gpu", "sum", scatter=True)


def test_multi_dim_stack_or_scatter_rejected(mesh2x2, x):
    with pytest.raises(ValueError):
        x.reduce(("host", "gpu"), "stack")
    with pytest.raises(ValueError):
        x.reduce(("host", "gpu"), "sum", scatter=True)


def test_unknown_and_duplicate_dims(mesh2x2, x):
    with pytest.raises(KeyError, match="'tpu'"):
        x.reduce("tpu")
    with pytest.raises(ValueError, match="duplicate"):
        x.reduce(("gpu", "gpu"))
    with pytest.raises(ValueError, match="unknown reduction"):
        x.reduce("gpu", "median")
    with pytest.raises(NotImplementedError):
        x.reduce("gpu", mesh=mesh2x2)


def test_reduce_out(mesh2x2, x):
    with mesh2x2.activate():
        bad = dm.remote(torch.zeros)(2, 2)
        out = dm.remote(torch.zeros)(3, 4)
    with pytest.raises(ValueError, match="Reduce expects the shape"):
        x.reduce("gpu", "sum", out=bad)
    r = x.reduce("gpu", "sum", out=out)
    expected = local_x(1, 0) + local_x(1, 1)
    assert torch.equal(fetch(r, host=1, gpu=1), expected)
    assert torch.equal(fetch(out, host=1, gpu=1), expected)  # the result aliases out


def test_reduce_in_place(mesh2x2, x):
    y = dm.remote(torch.clone)(x)
    assert dm.reduce_(y, "host", "sum") is y
    for g in range(2):
        assert torch.equal(fetch(y, host=0, gpu=g), local_x(0, g) + local_x(1, g))
    assert torch.equal(fetch(x, host=0, gpu=0), local_x(0, 0))  # the source of the clone is untouched


def test_reduce_pytree(mesh2x2, x):
    with mesh2x2.activate():
        tree = {"a": x, "b": [dm.remote(torch.ones)(2)]}
    r = dm.reduce(tree, ("host", "gpu"), "sum")
    assert torch.equal(fetch(r["b"][0], host=0, gpu=0), torch.full((2,), 4.0))
    assert torch.equal(fetch(r["a"], host=1, gpu=1), sum(local_x(h, g) for h in range(2) for g in range(2)))


def test_reduce_of_failed_input_raises_on_fetch_and_others_survive(mesh2x2, x):
    with mesh2x2.activate():
        bad = dm.remote("no_such_module.make", propagate=lambda: torch.empty(3, 4))()
    r = bad.reduce("gpu", "sum")
    with pytest.raises(dm.RemoteException, match="failed to resolve function"):
        fetch(r, host=0, gpu=1)
    ok = x.reduce("gpu", "sum")  # the communicator still works after the failed input took part as zeros
    assert torch.equal(fetch(ok, host=0, gpu=0), local_x(0, 0) + local_x(0, 1))


def test_in_place_all_to_all(mesh2x2):
    """DESIGN.md "Decisions": in-place stack + scatter (all-to-all) is allowed; in-place reduce-scatter is not."""
    p = dm.remote(make_pair)(mesh2x2.rank("host"), mesh2x2.rank("gpu"))
    assert p.reduce_("gpu", "stack", scatter=True) is p
    for h in range(2):
        for g in range(2):
            expected = torch.stack([local_pair(h, 0)[g], local_pair(h, 1)[g]])
            assert torch.equal(fetch(p, host=h, gpu=g), expected)
    with pytest.raises(ValueError, match="in-place, scatter not supported"):
        p.reduce_("gpu", "sum", scatter=True)
    with pytest.raises(ValueError, match="in-place, non-scatter not supported for stack"):
        p.reduce_("gpu", "stack")


def test_stack_into_out(mesh2x2, x):
    with mesh2x2.activate():
        out = dm.remote(torch.zeros)(2, 3, 4)
    r = x.reduce("host", "stack", out=out)
    expected = torch.stack([local_x(0, 1), local_x(1, 1)])
    assert torch.equal(fetch(r, host=0, gpu=1), expected)
    assert torch.equal(fetch(out, host=1, gpu=1), expected)


def test_integer_bitwise_reductions(mesh2x2):
    """Band/bor/bxor are supported where the backend supports them (DESIGN.md "Decisions"); gloo does."""
    bits = dm.remote(torch.bitwise_left_shift)(1, mesh2x2.rank(("host", "gpu")))  # rank r holds 1 << r
    assert fetch(bits.reduce((), "bor"), host=0, gpu=0).item() == 0b1111
    assert fetch(bits.reduce((), "band"), host=0, gpu=0).item() == 0
    assert fetch(bits.reduce("gpu", "bxor"), host=1, gpu=0).item() == 0b1100


# Each makes gpu 1's tensor differ from what the controller believes (float32 of shape (3,)) where the worker's
# check of a function's results cannot see it: in place, or as an object a declared tensor may stand for.
def rank_dependent_shape(t, g):
    if int(g) == 1:
        t.resize_(4).fill_(1)


def rank_dependent_dtype(t, g):
    if int(g) == 1:
        t.data = t.data.double()


def rank_dependent_type(t, g):
    return t if int(g) == 0 else ValueError("not a tensor")


@pytest.mark.parametrize(
    "make, text",
    [
        (rank_dependent_shape, r"has shape \[4\] and dtype torch.float32, but the controller expects shape \[3\]"),
        (rank_dependent_dtype, r"dtype torch.float64, but the controller expects shape \[3\] and dtype torch.float32"),
        (rank_dependent_type, r"is a ValueError, not a tensor"),
    ],
)
def test_reduce_of_inputs_that_differ_across_ranks_is_a_clear_error_not_a_hang(mesh2x2, x, make, text):
    """gloo would wait for the peers until comm_timeout (60 s here) and then fail the session; instead the rank
    whose input does not match the controller's shape takes part with zeros, so nobody waits, and every rank's
    result carries the error (DESIGN.md "Decisions", as for an errored input)."""
    with mesh2x2.activate():
        t = torch.ones(3)
    out = dm.remote(make, propagate=lambda t, g: t if make is rank_dependent_type else None)(t, mesh2x2.rank("gpu"))
    bad = t if out is None else out
    start = time.monotonic()
    r = bad.reduce("gpu", "sum")
    for h, g in ((0, 0), (1, 1)):
        with pytest.raises(dm.RemoteException, match=text) as info:
            fetch(r, host=h, gpu=g)
        assert "reduce(sum over ('gpu',))" in str(info.value)
        assert info.value.rank in (1, 3)  # a rank with gpu=1 reported it
    assert time.monotonic() - start < 30
    # refs not involved stay valid, and the communicator still works
    assert torch.equal(fetch(x, host=1, gpu=1), local_x(1, 1))
    assert torch.equal(fetch(x.reduce("gpu", "sum"), host=0, gpu=0), local_x(0, 0) + local_x(0, 1))


def busy_on_gpu_1(h, g):
    if int(g) == 1:
        time.sleep(12)
    return torch.ones(3)


def test_collective_timeout_says_it_is_comm_timeout_and_names_the_group(client4):
    """A peer that reaches the collective too late (here: busy in a long call) fails the session with an error
    that names the knob (comm_timeout) and the group's ranks, not only gloo's 'Timed out waiting ... recv'."""
    mesh = dm.attach(client4, dims={"host": 2, "gpu": 2}, comm_timeout=4)
    try:
        h, g = mesh.rank("host"), mesh.rank("gpu")
        assert fetch(dm.remote(make_x)(h, g).reduce("gpu"), host=0, gpu=0).shape == (3, 4)  # comms are built
        late = dm.remote(busy_on_gpu_1, propagate=lambda h, g: torch.empty(3))(h, g).reduce("gpu")
        with pytest.raises(dm.SessionError, match=r"all-reduce did not complete within comm_timeout=4 s") as info:
            fetch(late, host=0, gpu=0)
        assert "among ranks [0, 1]" in str(info.value) or "among ranks [2, 3]" in str(info.value)
    finally:
        try:
            mesh.exit()
        except Exception:
            pass


def ones_of(dtype_name):
    return torch.ones(3, dtype=getattr(torch, dtype_name))


@pytest.mark.parametrize(
    "dtype, reduction, text",
    [
        ("int64", "avg", r"gloo cannot reduce 'avg' over torch.int64 tensors: avg needs a floating point"),
        ("bool", "avg", r"gloo cannot reduce 'avg' over torch.bool tensors"),
        ("float32", "band", r"gloo cannot reduce 'band' over torch.float32 tensors: band needs an integer or bool"),
        ("complex64", "max", r"gloo cannot reduce 'max' over torch.complex64 tensors: only sum and avg"),
        ("complex64", "stack", r"gloo cannot reduce 'stack' over torch.complex64 tensors"),
    ],
)
def test_reduction_the_backend_cannot_do_for_a_dtype_is_a_value_error(mesh2x2, x, dtype, reduction, text):
    """gloo fails these on every rank after the exchange ('result type Float can't be cast...', 'Invalid scalar
    type'), which failed the whole session. It is the reduce's value error instead, naming the backend
    (DESIGN.md "Decisions"), and the session goes on."""
    with mesh2x2.activate():
        t = dm.remote(ones_of, propagate=lambda d: torch.empty(3, dtype=getattr(torch, d)))(dtype)
    r = t.reduce("gpu", reduction)
    with pytest.raises(dm.RemoteException, match=text):
        fetch(r, host=1, gpu=0)
    assert torch.equal(fetch(x.reduce("gpu", "sum"), host=0, gpu=0), local_x(0, 0) + local_x(0, 1))


# ------------------------------------------------------------------ issue 26 item 9, on a 2-rank mesh of gloo
@pytest.fixture
def mesh2(client2):
    mesh = dm.attach(client2, dims={"dp": 2}, comm_timeout=60)
    yield mesh
    try:
        mesh.exit()
    except dm.RemoteException:  # the failures these tests fetched on purpose are reported
        pass


NAN_ROWS = [[float("nan"), 1.0, float("inf"), -float("inf")], [2.0, float("nan"), 3.0, float("inf")]]


def nan_rows(rank, first):
    """The issue's two rows: row ``first`` on rank 0 and the other on rank 1."""
    return torch.tensor(NAN_ROWS[(int(rank) + int(first)) % 2])


@pytest.mark.parametrize("first", [0, 1], ids=["nan-on-rank-0-first", "rows-swapped"])
@pytest.mark.parametrize("reduction", ["max", "min"])
def test_max_and_min_propagate_nan_whichever_rank_holds_it(mesh2, reduction, first):
    """As torch.maximum / torch.minimum: a NaN on any rank makes that element NaN (gloo's max kept or dropped it
    depending on the rank: [nan, 1, inf, inf] instead of [nan, nan, inf, inf]); all-reduce, in place, and
    reduce-scatter (each rank's row of the (2, 2) result); with no NaN anywhere the values are the plain max/min."""
    rows = [torch.tensor(NAN_ROWS[first]), torch.tensor(NAN_ROWS[1 - first])]
    expected = (torch.maximum if reduction == "max" else torch.minimum)(rows[0], rows[1])
    x = dm.remote(nan_rows, propagate=lambda r, f: torch.empty(4))(mesh2.rank("dp"), first)
    for dp in (0, 1):
        assert torch.allclose(fetch(x.reduce("dp", reduction), dp=dp), expected, equal_nan=True)
    with mesh2.activate():
        y = x.clone()
        y.reduce_("dp", reduction)
        scattered = x.reshape(2, 2).reduce("dp", reduction, scatter=True)
        finite = torch.nan_to_num(x, nan=0.0)
    assert torch.allclose(fetch(y, dp=1), expected, equal_nan=True)
    for dp in (0, 1):
        assert torch.allclose(fetch(scattered, dp=dp), expected.reshape(2, 2)[dp], equal_nan=True)
    plain = (torch.maximum if reduction == "max" else torch.minimum)(*(torch.nan_to_num(r, nan=0.0) for r in rows))
    assert torch.equal(fetch(finite.reduce("dp", reduction), dp=0), plain)


def sparse_ones(rank, which):
    """A sparse COO tensor on the ranks ``which`` names ("all", or a rank), a dense one elsewhere."""
    dense = torch.ones(4) * (int(rank) + 1)
    return dense.to_sparse() if which == "all" or int(which) == int(rank) else dense


@pytest.mark.parametrize("which", ["all", "1"], ids=["every-rank-sparse", "rank-1-sparse"])
def test_a_sparse_tensor_in_a_reduce_fails_that_reduce_not_the_session(mesh2, which):
    """A remote function declared dense that returns a sparse COO tensor on every rank or on one: gloo refused it
    after the exchange ('gloo refused sum: unsupported memory format option Contiguous'), which failed the whole
    session. Now each rank holding a sparse input takes part with zeros, and the reduce's result raises a
    RemoteException naming the reduce and the layout when fetched, on every rank; the session goes on. (A mesh
    tensor cannot be declared sparse: the controller's fake tensors have no sparse storage.)"""
    s = dm.remote(sparse_ones, propagate=lambda r, w: torch.empty(4))(mesh2.rank("dp"), which)
    total = s.reduce("dp", "sum")
    for dp in (0, 1):
        with pytest.raises(dm.RemoteException, match=r"Reduce over \('dp',\) into \S+: the input \S+ has layout "
                                                     r"torch.sparse_coo, but the controller expects torch.strided"):
            fetch(total, dp=dp)
    ok = dm.remote(torch.add)(mesh2.rank("dp"), 1).reduce("dp", "sum")
    assert fetch(ok, dp=1).item() == 3
