"""``dm.compile`` on GPU workers (issue 11): replays on a CUDA stream, ``cuda_graph=True`` (each stream's replay
captured as a CUDA graph after a first replay), what a graph cannot hold, and a compiled training step. One GPU
is enough for all but the last test (NCCL inside a graph, 2 GPUs). Skipped without CUDA (CI has none); run with
``pytest -m gpu tests/test_gpu_compile.py`` on a GPU machine."""

from __future__ import annotations

import pytest
import torch

import dask_monarch as dm
from dp_steps import dp_step, twin_mlps
from dask_monarch.cluster import cluster_workers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

TIMEOUT = 120


@pytest.fixture(scope="module")
def gpu_client():
    from distributed import Client

    from dask_monarch.cluster import start_local_cluster

    n = min(torch.cuda.device_count(), 2)
    cluster = start_local_cluster(n, silence_logs=40)
    with Client(cluster) as client:
        client.wait_for_workers(n, timeout=120)
        yield client
    cluster.close()


@pytest.fixture
def mesh(gpu_client):
    m = dm.attach(gpu_client, dims={"gpu": 1}, comm_timeout=120, workers=[sorted(cluster_workers(gpu_client))[0]])
    yield m
    try:
        m.exit()
    except Exception:
        pass


def fetch(t, **coords):
    return dm.fetch_shard(t, **coords).result(timeout=TIMEOUT)


def chain(x, n):
    for i in range(n):
        x = x * 1.0001 + 0.5 if i % 2 else torch.relu(x - 0.25)
    return x


def graph_calls(client, session_id) -> list:
    """On every worker of the session: for each recording program, whether a CUDA graph was captured."""

    def probe(dask_worker=None):
        tw = dask_worker.plugins["dask-monarch"].sessions.get(session_id)
        if tw is None:
            return []
        return [p.graph is not None for r in tw.recordings.complete.values() for p in r.programs.values()]

    return [flag for flags in client.run(probe).values() for flag in flags]


def test_cuda_graph_replay_matches_eager(mesh, gpu_client):
    with mesh.activate():
        step = dm.compile(lambda x: chain(x, 64), verify=False, cuda_graph=True)
        xs = [torch.ones(16, 16, device="cuda") * k for k in range(1, 5)]
        outs = [step(x) for x in xs]  # call 1: a plain replay; call 2 captures; calls 3 and 4 launch the graph
        eager = [chain(x, 64) for x in xs]
    assert step.recordings == 1
    got, expected = fetch((outs, eager))
    for a, b in zip(got, expected):
        assert a.is_cuda is False and torch.equal(a, b)
    assert graph_calls(gpu_client, mesh.session_id) == [True]


def _host_sync(x):
    return x * x.sum().item()  # .item() waits for the GPU: a CUDA graph cannot capture it


def test_host_synchronization_cannot_be_captured(mesh):
    sync = dm.remote(_host_sync, propagate=lambda x: torch.empty_like(x))
    with mesh.activate():
        step = dm.compile(lambda x: sync(x + 1), verify=False, cuda_graph=True)
        x = torch.ones(4, device="cuda")
        first = step(x)  # a plain replay
        second = step(x)  # the capture fails, naming the operation
    assert fetch(first).tolist() == [16.0] * 4
    with pytest.raises(dm.RemoteException, match="cannot be captured in a CUDA graph") as info:
        fetch(second)
    assert "_host_sync" in str(info.value) and "operation 1" in str(info.value)


def test_cpu_tensor_cannot_be_captured(mesh):
    with mesh.activate():
        step = dm.compile(lambda x: (x + 1, torch.ones(3, device="cpu") * 2), verify=False, cuda_graph=True)
        x = torch.ones(4, device="cuda")
        step(x)
        y, z = step(x)
    with pytest.raises(dm.RemoteException, match="tensor on cpu"):
        fetch(z)


def _train(mesh, cuda_graph: bool, backend=None):
    with mesh.activate(), torch.device("cuda"):
        dm.remote(torch.manual_seed, propagate="inspect")(0)
        models = twin_mlps()
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
        x = torch.randn(64, 16)
        y = torch.randint(0, 4, (64,))
        eager = dp_step(models[0], optimizers[0], "gpu")
        compiled = dm.compile(dp_step(models[1], optimizers[1], "gpu"), warmup=1, cuda_graph=cuda_graph,
                              backend=backend)
        for i in range(7):
            xb, yb = x[8 * i:8 * i + 8], y[8 * i:8 * i + 8]
            eager(xb, yb)
            compiled(xb, yb)
    eager_params, compiled_params = fetch([list(m.parameters()) for m in models])
    for a, b in zip(eager_params, compiled_params):
        # Inductor's fused kernels may round in another order than eager's
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6) if backend else torch.equal(a, b)
    return compiled  # its recordings live as long as it does


def test_compiled_training_step_on_gpu_matches_eager(mesh):
    _train(mesh, cuda_graph=False)


def test_compiled_training_step_as_cuda_graph_matches_eager(mesh, gpu_client):
    compiled = _train(mesh, cuda_graph=True)  # held: dropping it deletes its recordings on the workers
    assert any(graph_calls(gpu_client, mesh.session_id))
    del compiled


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_training_step_compiled_by_inductor_on_gpu_matches_eager(mesh, gpu_client, cuda_graph):
    """Issue 27: the step's runs of aten ops compiled by Inductor (Triton kernels) on the worker, alone and captured
    in a CUDA graph (call 2 plain, call 3 compiles, call 4 captures)."""
    compiled = _train(mesh, cuda_graph=cuda_graph, backend="inductor")
    if cuda_graph:
        assert any(graph_calls(gpu_client, mesh.session_id))
    del compiled


@two_gpus
def test_nccl_reduce_inside_a_cuda_graph(gpu_client):
    with dm.attach(gpu_client, dims={"gpu": 2}, comm_timeout=120) as mesh, mesh.activate():
        step = dm.compile(lambda t: (t * 2).reduce("gpu", "sum"), verify=False, cuda_graph=True)
        x = torch.ones(1024, device="cuda") + mesh.rank("gpu")
        outs = [step(x * k) for k in range(1, 5)]
        values = fetch(outs, gpu=1)
        assert [v[0].item() for v in values] == [2.0 * k * 3 for k in range(1, 5)]
        assert all(graph_calls(gpu_client, mesh.session_id))
