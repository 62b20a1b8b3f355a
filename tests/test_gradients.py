"""Gradients one at a time on a mesh (issue 24 item 1; Monarch's ``monarch.gradient_generator``: ``grad_generator``,
``grad_function``, ``gradient_execution_order``), as a Monarch program uses them: a data-parallel step that reduces
each gradient as soon as backward has produced it. Values are checked against ``torch.autograd.grad`` run locally on
each rank's fetched inputs."""

from __future__ import annotations

import pytest
import torch

import dask_monarch as dm
from dask_monarch.gradient_generator import gradient_execution_order
from test_controller import record_sends

TIMEOUT = 120


@pytest.fixture(scope="module")
def mesh(shared_client2):
    mesh = dm.attach(shared_client2, dims={"dp": 2}, comm_timeout=60)
    yield mesh
    mesh.exit()


def fetch(obj, **coords):
    return dm.fetch_shard(obj, coords).result(timeout=TIMEOUT)


def _model(rank, residual=True):
    """Three tanh layers (residual ones by default) on rank-dependent data: (loss, params). Local when ``rank`` is a
    number, remote when it is ``mesh.rank("dp")`` (under ``mesh.activate()``)."""
    params = []
    x = torch.linspace(-1.0, 1.0, 12).reshape(3, 4) * (rank + 1)
    h = x
    for i in range(3):
        w = (torch.arange(16.0).reshape(4, 4) / 20 - 0.3 * i).requires_grad_()
        b = torch.full((4,), 0.1 * i).requires_grad_()
        params += [w, b]
        h = torch.tanh(h @ w + b) + (h if i and residual else 0)
    return (h * h).sum(), params


def _local_grads(rank, order=None, residual=True):
    loss, params = _model(float(rank), residual)
    wrt = params if order is None else [params[i] for i in order]
    return torch.autograd.grad(loss, wrt)


def test_gradients_come_in_the_order_asked_with_autograds_values(mesh):
    with mesh.activate():
        loss, params = _model(mesh.rank("dp"))
        order = gradient_execution_order(loss, params)
        assert order == [5, 4, 3, 2, 1, 0]  # the last layer's bias and weight first, as backward reaches them
        shuffled = [params[i] for i in (2, 5, 0, 3, 1, 4)]
        grads = list(dm.grad_generator(loss, shuffled))
        assert all(isinstance(g, dm.Tensor) for g in grads) and all(p.grad is None for p in params)
    for rank in range(2):
        expected = _local_grads(rank, (2, 5, 0, 3, 1, 4))
        for got, want in zip(fetch(grads, dp=rank), expected):
            assert torch.allclose(got, want, atol=1e-6)


def test_each_gradient_is_reduced_before_backward_computes_the_next(mesh):
    """Monarch's data-parallel overlap: the reduce of gradient k goes to the mesh before backward's ops for k + 1
    (in a network without residual connections: see the docs for those)."""
    sent = record_sends(mesh._session)
    with mesh.activate():
        loss, params = _model(mesh.rank("dp"), residual=False)
        wrt = [params[i] for i in gradient_execution_order(loss, params)]
        start = len(sent)
        reduced = [g.reduce("dp", "avg") for g in dm.grad_generator(loss, wrt)]
    kinds = [kind for kind, _, _ in sent[start:]]
    reduces = [i for i, kind in enumerate(kinds) if kind == "Reduce"]
    assert len(reduces) == 6
    between = [kinds[a + 1:b].count("CallFunction") for a, b in zip(reduces, reduces[1:])]
    assert all(n > 0 for n in between), (between, kinds)  # backward's ops of the next gradient come after each reduce
    assert kinds[: reduces[0]].count("CallFunction") > 0 and "CallFunction" not in kinds[reduces[-1] + 1:]
    per_rank = [_local_grads(rank, [5, 4, 3, 2, 1, 0], residual=False) for rank in range(2)]
    for got, a, b in zip(fetch(reduced), *per_rank):
        assert torch.allclose(got, (a + b) / 2, atol=1e-6)


def _dp_step(model, optimizer, overlap: bool):
    """One data-parallel SGD step: backward then ``reduce_`` of every gradient, or (``overlap``) Monarch's pattern,
    each gradient reduced as ``grad_generator`` yields it."""
    params = list(model.parameters())

    def step(xb, yb):
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        if overlap:
            wrt = [params[i] for i in gradient_execution_order(loss, params)]
            for p, g in zip(wrt, dm.grad_generator(loss, wrt)):
                p.grad = g.reduce("dp", "avg")
        else:
            loss.backward()
            dm.reduce_([p.grad for p in params], "dp", "avg")
        optimizer.step()
        return loss

    return step


def test_the_overlapped_step_eager_and_compiled_equals_backward_then_reduce(mesh):
    with mesh.activate():
        dm.remote(torch.manual_seed, propagate="inspect")(0)
        models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
                  for _ in range(3)]
        with torch.no_grad():
            for first, *others in zip(*(m.parameters() for m in models)):
                for p in others:
                    p.copy_(first)
        steps = [_dp_step(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), overlap)
                 for m, overlap in zip(models, (False, True, True))]
        steps[2] = dm.compile(steps[2], warmup=1)
        x = torch.randn(32, 8) + mesh.rank("dp")
        y = torch.randint(0, 4, (32,))
        start = [p.detach().clone() for p in models[0].parameters()]
        for i in range(4):
            for step in steps:
                step(x[8 * i:8 * i + 8], y[8 * i:8 * i + 8])
        assert steps[2].recordings == 2  # recorded, verified, then replayed
    for dp in (0, 1):
        plain, overlapped, compiled, before = fetch([list(m.parameters()) for m in models] + [start], dp=dp)
        for a, b, c, s in zip(plain, overlapped, compiled, before):
            assert torch.equal(a, b) and torch.equal(a, c) and not torch.equal(a, s)


def test_the_gradient_of_an_intermediate_and_of_a_root_given_its_gradient(mesh):
    with mesh.activate():
        x = (torch.arange(6.0).reshape(2, 3) + mesh.rank("dp")).requires_grad_()
        w = torch.ones(3, 3).requires_grad_()
        h = x @ w
        y = torch.relu(h) * h  # not a scalar: its gradient is given
        g = torch.full((2, 3), 0.5)
        gh, gx, gw = dm.grad_generator(y, [h, x, w], [g])
    for rank in range(2):
        lx = (torch.arange(6.0).reshape(2, 3) + rank).requires_grad_()
        lw = torch.ones(3, 3).requires_grad_()
        lh = lx @ lw
        expected = torch.autograd.grad(torch.relu(lh) * lh, [lh, lx, lw], torch.full((2, 3), 0.5))
        for got, want in zip(fetch((gh, gx, gw), dp=rank), expected):
            assert torch.allclose(got, want)


def test_backward_runs_on_the_stream_of_the_forward_pass(mesh):
    """Monarch's generator restores the forward's stream: here the roots' stream, while another is active."""
    side = dm.Stream("side")
    with mesh.activate():
        with side.activate():
            w = torch.full((4,), 2.0).requires_grad_()
            loss = (w * w * (mesh.rank("dp") + 1)).sum()
        (gw,) = dm.grad_generator(loss, [w])
        assert gw.stream is side
    assert torch.equal(fetch(gw, dp=1), torch.full((4,), 8.0))


def test_gradient_execution_order_as_monarch_documents_it(mesh):
    with mesh.activate():
        t = torch.rand(3, 3).requires_grad_()
        w1, w2, w3 = (torch.rand(3, 3).requires_grad_() for _ in range(3))
        a = torch.relu(torch.relu(torch.relu(t @ w1) @ w2) @ w3)
        std, _ = torch.std_mean(a)
        assert gradient_execution_order([std + std], [w2, w3, w1, a]) == [3, 1, 0, 2]


def test_grad_function_runs_a_hand_written_backward_on_the_mesh(mesh):
    def scaled_square(k, x):
        def backward(grad):
            return None, grad * 2 * k * x  # d(k x^2)/dx, from the closure's saved x and k

        return k * x * x, backward

    f = dm.grad_function(scaled_square)
    with mesh.activate():
        k = torch.full((3,), 3.0) + mesh.rank("dp")
        x = torch.arange(3.0).requires_grad_()
        y = f(k, x)
        y.sum().backward()
        assert isinstance(x.grad, dm.Tensor)
    assert torch.equal(fetch(y, dp=1), 4 * torch.arange(3.0) ** 2)
    assert torch.equal(fetch(x.grad, dp=0), 6 * torch.arange(3.0))
    with pytest.raises(TypeError, match="must return \\(result, backward function\\)"):
        dm.grad_function(lambda x: (x, 1))(torch.ones(2, requires_grad=True))


def test_bad_arguments_name_what_is_wrong():
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"with_respect_to\[1\] .* does not require grad"):
        dm.grad_generator((x * 2).sum(), [x, torch.ones(2)])
    with pytest.raises(TypeError, match=r"roots\[0\] must be a tensor"):
        dm.grad_generator([3.0], [x])
    with pytest.raises(ValueError, match="2 grad_roots for 1 roots"):
        dm.grad_generator((x * 2).sum(), [x], [None, None])
    unused = torch.ones(2, requires_grad=True)
    assert list(dm.grad_generator((x * 3).sum(), [unused, x]))[0] is None
