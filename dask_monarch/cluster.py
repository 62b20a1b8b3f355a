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
    spawn, so CUDA is safe). Extra keyword arguments go to ``LocalCluster``."""
    options = dict(n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0")
    options.update(kwargs)
    return LocalCluster(**options)
