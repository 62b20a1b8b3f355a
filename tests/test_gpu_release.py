"""On a GPU worker a session's end gives its device memory back at once (issue 12): after ``exit()``, and after a
failure, ``torch.cuda.memory_allocated()`` on the worker is back at its value from before the session, without
Python's cyclic garbage collector; a clean end also empties the caching allocator's free blocks. One GPU; skipped
without CUDA. Run: ``pytest -m gpu tests/test_gpu_release.py``."""

from __future__ import annotations

import pytest
import torch

import dask_monarch as dm
from dask_monarch.protocol import ArgsKwargs, CallFunction, FunctionPath, StreamRef

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TIMEOUT = 120
ELEMENTS = 64 * 2**20  # 256 MiB of float32 per tensor


@pytest.fixture(scope="module")
def gpu_client():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0",
                      silence_logs=40) as cluster, Client(cluster) as client:
        client.wait_for_workers(1, timeout=120)
        client.run(_set_gc(False))  # the memory must come back without the cyclic collector
        yield client
        client.run(_set_gc(True))


def _set_gc(enabled: bool):
    def set_gc():
        import gc

        gc.enable() if enabled else gc.disable()

    return set_gc


def _memory():
    def memory():
        import torch

        return torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)

    return memory


def worker_memory(client) -> tuple[int, int]:
    return next(iter(client.run(_memory()).values()))


def sessions(client) -> int:
    return sum(client.run(lambda dask_worker: len(dask_worker.plugins["dask-monarch"].sessions)).values())


def test_device_memory_returns_to_the_baseline_after_exit(gpu_client):
    client = gpu_client
    allocated, _ = worker_memory(client)
    for _ in range(3):
        with dm.attach(client, dims={"gpu": 1}, comm_timeout=60) as mesh:
            with mesh.activate():
                x = torch.ones(ELEMENTS, device="cuda")
                y = x.reduce("gpu", "sum")  # NCCL
                z = y * 2
            assert dm.fetch_shard(z[:2]).result(timeout=TIMEOUT).tolist() == [2.0, 2.0]
            during, _ = worker_memory(client)
            assert during - allocated >= 3 * ELEMENTS * 4  # x, y and z live on the worker's GPU
        assert sessions(client) == 0
        after, reserved = worker_memory(client)
        assert after == allocated, (allocated, during, after)
        assert reserved < ELEMENTS * 4, reserved  # a clean end empties the allocator's cache (empty_cache)


def test_device_memory_returns_to_the_baseline_after_a_failure(gpu_client):
    client = gpu_client
    allocated, _ = worker_memory(client)
    mesh = dm.attach(client, dims={"gpu": 1}, comm_timeout=60)
    with mesh.activate():
        x = torch.ones(ELEMENTS, device="cuda")
        y = x.reduce("gpu", "sum")
    assert dm.fetch_shard(y[:1]).result(timeout=TIMEOUT).tolist() == [1.0]
    session = mesh._session  # a fatal error (a message for an unknown stream) fails the session
    session.send(CallFunction(session.new_seq(), [None], [], FunctionPath("torch.ops.aten.ones.default"),
                              ArgsKwargs(([1],)), StreamRef(99), []))
    with pytest.raises(dm.SessionError, match="unknown stream 99"):
        session.sync("after a fatal error").result(timeout=TIMEOUT)
    mesh.exit()
    assert sessions(client) == 0
    after, _ = worker_memory(client)
    assert after == allocated, (allocated, after)
