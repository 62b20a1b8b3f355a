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

__all__ = ["select_device", "pin", "gpu_identity", "gpu_of_worker", "guard_set_device"]


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


def guard_set_device() -> None:
    """Check ``torch.cuda.set_device`` in remote functions, as Monarch's worker does: the rank's device is chosen
    and pinned by dask_monarch on every stream thread, so a remote function that asks for another device gets a
    ``ValueError`` naming the devices available ("Only devices ... are available to monarch worker, but
    torch.cuda.set_device(d) was called", Monarch's words), instead of computing on a device the session did not
    give it (or, on a CPU worker, an obscure error from torch). Setting the rank's own device is allowed. Outside a
    stream thread (other Dask work in the worker process) ``set_device`` is torch's own. Installed once per
    process, by the first session's ``TensorWorker``."""
    if getattr(torch.cuda.set_device, "_dask_monarch_guard", False):
        return
    original = torch.cuda.set_device

    def set_device(device) -> None:
        from .context import current_stream

        stream = current_stream()
        if stream is not None:
            own = stream.tw.device
            wanted = None
            if own.type == "cuda":
                try:
                    wanted = torch.cuda._get_device_index(device, optional=True)
                except (ValueError, RuntimeError, TypeError):
                    wanted = None
            if wanted is None or wanted != own.index:
                available = str(own.index) if own.type == "cuda" else "None"
                raise ValueError(
                    f"Only devices {available} are available to monarch worker, but torch.cuda.set_device({device}) "
                    f"was called (rank {stream.tw.rank}, a {'CUDA' if own.type == 'cuda' else 'CPU'} worker): "
                    f"dask_monarch sets each rank's device ({own}) on its streams; compute on it (device='cuda' "
                    "or torch.cuda.current_device()) instead of choosing another")
        return original(device)

    set_device._dask_monarch_guard = True
    set_device.__wrapped__ = original
    set_device.__doc__ = original.__doc__
    torch.cuda.set_device = set_device


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
