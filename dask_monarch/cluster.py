"""The embedded default cluster that ``dask_monarch.attach()`` starts when given no cluster
(DESIGN.md "The picture"): a ``distributed.LocalCluster`` of worker processes, one per GPU if there are GPUs,
else CPU workers, started and stopped with the mesh.
"""

from __future__ import annotations

import os

import torch
from distributed import LocalCluster

__all__ = ["default_worker_count", "start_local_cluster"]


def default_worker_count() -> int:
    """The number of workers the embedded cluster starts without ``dims``: the visible GPUs, else the CPU
    cores (at least 1)."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(1, os.cpu_count() or 1)


def start_local_cluster(n_workers: int, **kwargs) -> LocalCluster:
    """A ``LocalCluster`` of ``n_workers`` single-threaded worker processes (each under a nanny, started with
    spawn, so CUDA is safe). With GPUs, worker ``i`` gets ``CUDA_VISIBLE_DEVICES`` rotated to start at GPU
    ``i`` (as dask-cuda does), so its own GPU is device 0 and every GPU stays visible. Extra keyword arguments
    go to ``LocalCluster``."""
    options = dict(n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0")
    options.update(kwargs)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus or "CUDA_VISIBLE_DEVICES" in os.environ:
        return LocalCluster(**options)
    options["n_workers"] = 0
    cluster = LocalCluster(**options)
    spec = dict(cluster.new_worker_spec())
    template = next(iter(spec.values()))
    for i in range(n_workers):
        rotated = ",".join(str((i + k) % gpus) for k in range(gpus))
        worker_options = {**template.get("options", {}), "env": {"CUDA_VISIBLE_DEVICES": rotated}}
        cluster.worker_spec[f"gpu{i}"] = {**template, "options": worker_options}
    cluster.sync(cluster._correct_state)
    return cluster
