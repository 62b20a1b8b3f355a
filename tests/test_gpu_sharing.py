"""Ranks that would share one GPU under NCCL ("Duplicate GPU detected : rank 0 and rank 1 both on CUDA device",
seen after the workers started on a 1-GPU machine): ``attach`` refuses them at once, before starting anything,
naming the ranks and the GPU. The checks run on CPU with the GPU answers stood in; the ``gpu`` tests run them on
real GPUs (one is enough)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

import dask_monarch as dm
from dask_monarch import cluster as embedded
from dask_monarch.controller.attach import shared_gpus

attach_module = importlib.import_module("dask_monarch.controller.attach")  # the name attach is the function

H200 = "NVIDIA H200"


def gpu(uuid: str, index: int = 0) -> dict:
    return {"uuid": uuid, "name": H200, "index": index}


def test_shared_gpus_names_the_ranks_workers_and_gpu():
    workers = ["tcp://a:1", "tcp://a:2", "tcp://b:1", "tcp://b:2"]
    assert shared_gpus([gpu("GPU-0"), gpu("GPU-1", 1), gpu("GPU-2"), gpu("GPU-3")], workers) == ""
    assert shared_gpus([None, None, None, None], workers) == ""  # CPU workers: gloo, no GPU to share
    text = shared_gpus([gpu("GPU-0"), gpu("GPU-0"), gpu("GPU-2"), None], workers)
    assert text == (f"rank 0 (tcp://a:1, cuda:0), rank 1 (tcp://a:2, cuda:0) would all use GPU GPU-0 ({H200})")


def test_embedded_cluster_refuses_more_ranks_than_gpus_before_starting_anything(monkeypatch):
    """The embedded default on a 1-GPU machine: ``dims={"dp": 2}`` fails in attach, with no process started."""
    assert embedded.gpu_sharing_error(2, []) is None and embedded.gpu_sharing_error(2, ["0", "1"]) is None
    assert embedded.gpu_sharing_error(3, ["0", "1"]).startswith(
        "3 ranks but this machine shows 2 GPUs (CUDA_VISIBLE_DEVICES=0,1): ranks 0, 2 on GPU 0 would share a GPU")
    started = []
    monkeypatch.setattr(embedded, "visible_gpus", lambda: ["0"])
    monkeypatch.setattr(embedded, "SpecCluster", lambda *a, **k: started.append(a) or pytest.fail("started"))
    with pytest.raises(ValueError, match=r"2 ranks but this machine shows 1 GPU \(CUDA_VISIBLE_DEVICES=0\): "
                                         r"ranks 0, 1 on GPU 0 would share a GPU, which NCCL refuses"):
        dm.attach(dims={"dp": 2})
    assert started == []


def test_attach_refuses_workers_that_would_share_a_gpu_before_opening_the_session(client2, monkeypatch):
    """Two workers of an existing cluster that would both compute on one GPU (here: both say so): ``ValueError``
    naming the ranks, their workers and the GPU; no session was opened on the scheduler."""
    def same_gpu(local_ranks, dask_worker=None):  # a closure: travels by value to the workers
        return {"uuid": "GPU-5c3e", "name": H200, "index": 0}

    monkeypatch.setattr(attach_module, "gpu_of_worker", same_gpu)
    workers = sorted(embedded.cluster_workers(client2))
    with pytest.raises(ValueError) as info:
        dm.attach(client2, dims={"dp": 2})
    text = str(info.value)
    assert f"rank 0 ({workers[0]}, cuda:0), rank 1 ({workers[1]}, cuda:0) would all use GPU GPU-5c3e ({H200})" in text
    assert "Duplicate GPU detected" in text
    sessions = client2.sync(client2.scheduler.monarch_sessions)
    assert [s for s in sessions.values() if s["client"] == client2.id] == []


def test_attach_asks_the_workers_and_cpu_workers_pass(client2):
    """The real question to the workers: CPU workers have no GPU, so nothing is refused."""
    from dask_monarch.worker.device import gpu_of_worker

    if not torch.cuda.is_available():
        assert set(client2.run(gpu_of_worker, {}).values()) == {None}
    with dm.attach(client2, dims={"dp": 2}) as mesh:
        assert dm.inspect(mesh.rank("dp")).item() == 0


# --------------------------------------------------------------------------------------------- on real GPUs
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_embedded_two_ranks_on_one_visible_gpu_are_refused_at_attach():
    """``CUDA_VISIBLE_DEVICES=0`` and ``dims={"dp": 2}``: refused in attach, before any worker starts."""
    code = "import dask_monarch as dm\ndm.attach(dims={'dp': 2})\n"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "ValueError: 2 ranks but this machine shows 1 GPU (CUDA_VISIBLE_DEVICES=0): ranks 0, 1 on GPU 0" in (
        proc.stderr), proc.stderr
    assert "Duplicate GPU detected" in proc.stderr and "NCCL" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_workers_that_see_only_one_gpu_are_refused_naming_it():
    """Two Dask workers that both see only GPU 0: attach names ranks 0 and 1 and that GPU's UUID, and opens no
    session (NCCL would fail with "Duplicate GPU detected" after the workers started)."""
    from distributed import Client, LocalCluster

    uuid = f"GPU-{torch.cuda.get_device_properties(0).uuid}"
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]  # this process's cuda:0
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0", silence_logs=40,
                      env={"CUDA_VISIBLE_DEVICES": first}) as cluster, Client(cluster) as client:
        with pytest.raises(ValueError, match=r"rank 0 \(.*cuda:0\), rank 1 \(.*cuda:0\) would all use GPU "
                                             + uuid):
            dm.attach(client, dims={"dp": 2})
        assert not client.sync(client.scheduler.monarch_sessions)
