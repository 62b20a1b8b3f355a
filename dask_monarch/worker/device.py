"""Which device a tensor worker computes on, and pinning it in every thread that issues work
(spec §2 "Worker state": the device; spec/dask-notes.md §5.2, §6 #11/#12).

* No CUDA: the CPU.
* ``CUDA_VISIBLE_DEVICES`` set in the worker's environment (the embedded cluster, ``dask cuda worker``'s rotated
  lists, or one GPU per worker): device 0, which is this worker's own GPU.
* Otherwise (several workers on one host that all see every GPU): the session's local rank on this host, modulo
  the GPUs visible, so that no two ranks of a host share a GPU (NCCL refuses a duplicate GPU).

The CUDA device and current stream are per thread, so the dispatcher and every stream thread call ``pin``.
``gpu_identity`` names the physical GPU a rank would take, so that attach can refuse two ranks on one GPU before
NCCL does ("Duplicate GPU detected").
"""

from __future__ import annotations

import asyncio
import os

import torch

__all__ = ["select_device", "pin", "gpu_identity", "gpu_of_worker"]


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


def gpu_identity(local_rank: int = 0) -> dict | None:
    """The GPU ``select_device(local_rank)`` picks, as ``{"uuid", "name", "index"}`` (the UUID is the same in every
    process that sees that GPU, whatever its ``CUDA_VISIBLE_DEVICES``); None on a CPU worker."""
    device = select_device(local_rank)
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return {"uuid": f"GPU-{props.uuid}", "name": props.name, "index": device.index}


async def gpu_of_worker(local_ranks: dict, dask_worker=None) -> dict | None:
    """``gpu_identity`` of this Dask worker for its local rank in ``local_ranks`` (worker address -> local rank),
    run with ``Client.run``; on a thread, since it may initialize CUDA, which must not block the event loop."""
    local_rank = int(local_ranks.get(dask_worker.address, 0))
    return await asyncio.to_thread(gpu_identity, local_rank)
