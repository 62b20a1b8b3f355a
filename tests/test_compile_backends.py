"""How a compiled function's recording replays (issue 27): runs of aten operations as one generated Python function
(``worker/blocks.py``, the default) and, with ``compile(fn, backend="inductor")``, compiled by Inductor on each rank
(``worker/inductor.py``). Both give eager's values; Inductor's fused kernels may round differently in the last bits
(``allclose``), the generated replay does not (``equal``). What Inductor cannot compile replays as Python and the
next call warns once."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import dask_monarch as dm
from dask_monarch.controller import compile_notices
from dp_steps import dp_step, twin_mlps

TIMEOUT = 120
F = torch.nn.functional


def fetch(x, **coords):
    return dm.fetch_shard(x, **coords).result(timeout=TIMEOUT)


def mixed(x, w, acc):
    """Ops of every shape of a step: Tensor[] returns (split), several returns (layer_norm), views, a matmul, an
    in-place update of a captured tensor, temporaries freed on the way."""
    a, b = torch.split(x * 2 - 1, 4, dim=1)
    h = F.layer_norm(a + b.relu(), (4,)) @ w
    acc.add_(h.sum(0))
    return h.t().contiguous().view(-1), torch.tanh(acc)


def test_generated_replay_matches_eager(mesh1):
    with mesh1.activate():
        torch.manual_seed(0)
        w = torch.randn(4, 3)
        acc_eager, acc_compiled = torch.zeros(3), torch.zeros(3)
        step = dm.compile(lambda x: mixed(x, w, acc_compiled))
        xs = [torch.randn(5, 8) for _ in range(4)]
        compiled = [step(x) for x in xs]  # recorded, verified, replayed twice
        eager = [mixed(x, w, acc_eager) for x in xs]
        got = fetch((compiled, eager, acc_compiled, acc_eager, xs, w))
    with dm.no_mesh.activate():
        compiled, eager, acc_c, acc_e, xs, w = got
        acc_local = torch.zeros(3)
        for (c, e), x in zip(zip(compiled, eager), xs):
            local = mixed(x, w, acc_local)
            for u, v, t in zip(c, e, local):
                assert torch.equal(u, v) and torch.allclose(u, t)
        assert torch.equal(acc_c, acc_e)


def _train(mesh, backend):
    with mesh.activate():
        dm.remote(torch.manual_seed, propagate="inspect")(0)
        models = twin_mlps()
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=True) for m in models]
        x = torch.randn(48, 16) + mesh.rank("dp")
        y = torch.randint(0, 4, (48,))
        eager = dp_step(models[0], optimizers[0], "dp")
        compiled = dm.compile(dp_step(models[1], optimizers[1], "dp"), warmup=1, backend=backend)
        losses = []
        for i in range(6):  # eager (warm-up), recorded, verified (Inductor compiles), replayed
            xb, yb = x[8 * i:8 * i + 8], y[8 * i:8 * i + 8]
            losses.append((eager(xb, yb).detach(), compiled(xb, yb)))
        return compiled, fetch(([list(m.parameters()) for m in models], losses), dp=1)


def test_inductor_training_step_matches_eager(client2):
    """A data-parallel step (forward, backward, reduce_ of the gradients, SGD with momentum) compiled by Inductor on
    both ranks: the reduces stay between the compiled regions, the parameters follow eager's, and no rank warns."""
    with dm.attach(client2, dims={"dp": 2}, comm_timeout=60) as mesh:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            compiled, ((eager_params, compiled_params), losses) = _train(mesh, "inductor")
        regions = _regions(client2, mesh.session_id)
    assert compiled.recordings == 2
    assert regions and all(n >= 1 for n in regions.values())  # each rank compiled regions, none fell back
    with dm.no_mesh.activate():
        for a, b in zip(eager_params, compiled_params):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        assert not torch.equal(eager_params[0], compiled_params[0] * 0)
        (e1, c1), *rest = losses[1:]
        assert torch.equal(e1, c1)  # the recorded call replays as Python: eager's very value
        for e, c in rest:
            assert torch.allclose(e, c, rtol=1e-5, atol=1e-6)


def _regions(client, session_id) -> dict:
    """Per worker: how many regions Inductor compiled (and did not fall back from) in the session's recordings."""

    def probe(dask_worker=None):
        from dask_monarch.worker.inductor import Region

        tw = dask_worker.plugins["dask-monarch"].sessions.get(session_id)
        programs = [p for r in tw.recordings.complete.values() for p in r.programs.values()] if tw else []
        return sum(1 for p in programs for r in p.runners if type(r) is Region and r.fallback is None)

    return client.run(probe)


def test_what_inductor_cannot_compile_replays_as_python_and_warns(mesh1):
    """A generator among an operation's arguments stops Dynamo: that run replays as Python (the values stay
    eager's) and the next call warns once, naming the recording, the rank and Dynamo's reason."""
    gen = torch.Generator().manual_seed(0)

    def noisy(x):
        y = (x * 2 + 1).relu()
        return y * torch.rand(4, generator=gen) + y.sin() - 0.5

    local_gen = torch.Generator().manual_seed(0)
    step = dm.compile(noisy, backend="inductor", verify=False)  # the generator's state is part of the recording
    caught, outs = [], []
    with mesh1.activate():
        x = torch.ones(4)
        deadline = time.monotonic() + TIMEOUT
        while not caught and time.monotonic() < deadline:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                outs.append(fetch(step(x)))
            caught = [str(m.message) for m in w if m.category is RuntimeWarning]
            time.sleep(0.2)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            outs.append(fetch(step(x)))
        assert not [m for m in w if m.category is RuntimeWarning]  # once
    (text,) = caught
    assert "Inductor could not compile" in text and "on rank 0" in text and "Unsupported" in text
    session = mesh1._session
    assert session.id in compile_notices._sessions
    mesh1.exit()  # the session's end drops what was kept for it, and its topic's subscription
    assert session.id not in compile_notices._sessions
    assert not [k for k in compile_notices._owners if k[0] == session.id]
    with dm.no_mesh.activate():
        for out in outs:
            y = (torch.ones(4) * 2 + 1).relu()
            assert torch.equal(out, y * torch.rand(4, generator=local_gen) + y.sin() - 0.5)


def test_bad_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        dm.compile(lambda x: x, backend="tvm")
