"""Actors with CUDA tensors (issue 17): the method runs on the stream's thread and CUDA stream of its rank's GPU
worker, sees that rank's CUDA tensors, and its rref results stay on the GPU. Skipped without two CUDA devices;
run with ``pytest -m gpu tests/test_gpu_actors.py``."""

from __future__ import annotations

import pytest
import torch

import dask_monarch as dm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
    ),
]

TIMEOUT = 120


class Scaler:
    def __init__(self, factor: float):
        self.factor = factor

    def where(self, x):
        """The tensor's device, and whether this thread issues work into the CUDA stream it was made on."""
        return str(x.device), torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream

    @dm.endpoint(propagate=lambda x: torch.empty_like(x))
    def scale(self, x):
        return x * self.factor


def stream_of(x):
    return torch.tensor(torch.cuda.current_stream().cuda_stream)


@pytest.fixture(scope="module")
def gpu_client():
    from distributed import Client

    from dask_monarch.cluster import start_local_cluster

    cluster = start_local_cluster(2, silence_logs=40)
    with Client(cluster) as client:
        client.wait_for_workers(2, timeout=120)
        yield client
    cluster.close()


def test_an_actor_gets_each_ranks_cuda_tensor_on_its_stream(gpu_client):
    with dm.attach(gpu_client, dims={"gpu": 2}, comm_timeout=120) as mesh:
        scaler = mesh.spawn(Scaler, 3.0)
        with mesh.activate():
            x = torch.ones(4, device="cuda") + mesh.rank("gpu")
            streams = dm.remote(stream_of, propagate=lambda x: torch.empty((), dtype=torch.int64))(x)
            seen = list(scaler.where.call(x).result(timeout=TIMEOUT).values())
            assert [s[0] for s in seen] == ["cuda:0", "cuda:0"]  # each worker sees its own GPU as cuda:0
            assert [s[2] for s in seen] == [dm.inspect(streams, gpu=r).item() for r in range(2)]
            y = scaler.scale.rref(x)
            assert y.device.type == "cuda"
            total = (y + 1).reduce("gpu", "sum")
            assert torch.equal(dm.inspect(total), torch.full((4,), 3.0 * 1 + 3.0 * 2 + 2))
