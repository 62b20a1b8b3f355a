"""``to_mesh`` and process groups on GPU workers, through NCCL (issue 16; spec §1 "to_mesh", "UDF process
groups", §5). Skipped without two CUDA devices (CI has none); run them on a GPU machine with
``pytest -m gpu tests/test_gpu_send.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dask_monarch as dm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
    ),
]

TIMEOUT = 120


@pytest.fixture(scope="module")
def gpu_client():
    from distributed import Client

    from dask_monarch.cluster import start_local_cluster

    cluster = start_local_cluster(2, silence_logs=40)
    with Client(cluster) as client:
        client.wait_for_workers(2, timeout=120)
        yield client
    cluster.close()


@pytest.fixture
def mesh(gpu_client):
    m = dm.attach(gpu_client, dims={"gpu": 2}, comm_timeout=120)
    yield m
    try:
        m.exit()
    except Exception:
        pass


def fetch(t, **coords):
    return dm.fetch_shard(t, **coords).result(timeout=TIMEOUT)


def test_to_mesh_between_the_two_gpus(mesh):
    g0, g1 = mesh.slice(gpu=0), mesh.slice(gpu=1)
    with g0.activate():
        x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    y = x.to_mesh(g1)
    assert y.is_cuda
    with g1.activate():
        doubled = y * 2
    assert torch.equal(fetch(doubled), 2 * torch.arange(1 << 20, dtype=torch.float32))


def test_copies_handed_to_another_cuda_stream(mesh):
    """to_mesh onto the same mesh on another stream: each rank copies on the main CUDA stream and hands the copy
    over (a CUDA event) to the other stream."""
    other = dm.Stream("other")
    with mesh.activate():
        x = torch.ones(1000, device="cuda") * (mesh.rank("gpu") + 1)
    y = x.to_mesh(mesh, stream=other)
    with mesh.activate(), other.activate():
        doubled = y * 2
    assert torch.equal(fetch(doubled, gpu=1), torch.full((1000,), 4.0))


def test_sub_mesh_exchange_to_another_stream(mesh):
    other = dm.Stream("other")
    g0, g1 = mesh.slice(gpu=slice(0, 1)), mesh.slice(gpu=slice(1, 2))
    with g0.activate():
        x = torch.full((4, 4), 3.0, device="cuda")
    y = x.to_mesh(g1, stream=other)
    with g1.activate(), other.activate():
        z = y + 1
    assert torch.equal(fetch(z), torch.full((4, 4), 4.0))


def test_a_cpu_tensor_between_gpu_ranks_is_a_clear_error(mesh):
    g0, g1 = mesh.slice(gpu=0), mesh.slice(gpu=1)
    with g0.activate():
        x = torch.ones(3, device="cpu")
    with pytest.raises(dm.RemoteException, match="nccl moves CUDA tensors"):
        fetch(x.to_mesh(g1))


def all_reduce(x, pg):
    y = x.clone()
    dist.all_reduce(y, group=pg)
    return y


def test_process_group_all_reduce_on_nccl(mesh):
    pg = mesh.process_group("gpu")
    with mesh.activate():
        x = torch.ones(8, device="cuda") * (mesh.rank("gpu") + 1)
        total = dm.remote(all_reduce)(x, pg)
    assert torch.equal(fetch(total, gpu=1), torch.full((8,), 3.0))


def test_compiled_to_mesh_on_gpus(mesh):
    g0, g1 = mesh.slice(gpu=0), mesh.slice(gpu=1)

    @dm.compile
    def step(a):
        return (a * 2).to_mesh(g1)

    for k in range(3):
        with g0.activate():
            a = torch.full((16,), float(k), device="cuda")
        assert torch.equal(fetch(step(a)), torch.full((16,), 2.0 * k))
