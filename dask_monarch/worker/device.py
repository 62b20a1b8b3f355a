"""Which device a tensor worker computes on, and pinning it in every thread that issues work
(spec §2 "Worker state": the device; spec/dask-notes.md §5.2, §6 #11/#12).

* No CUDA: the CPU.
* ``CUDA_VISIBLE_DEVICES`` set in the worker's environment (the embedded cluster, ``dask cuda worker``'s rotated
  lists, or one GPU per worker): device 0, which is this worker's own GPU.
* Otherwise (several workers on one host that all see every GPU): the session's local rank on this host, modulo
  the GPUs visible, so that no two ranks of a host share a GPU (NCCL refuses a duplicate GPU).

The CUDA device and current stream are per thread, so the dispatcher and every stream thread call ``pin``.
"""

from __future__ import annotations

import os

import torch

__all__ = ["select_device", "pin"]


def select_device(local_rank: int = 0) -> torch.device:
    """The device of a tensor worker whose session rank is the ``local_rank``-th on its host."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return torch.device("cuda", 0)
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def pin(device: torch.device) -> None:
    """Make ``device`` the current CUDA device of the calling thread (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
