"""CUDA memory and devices on the ranks (Monarch's ``monarch.builtins.cuda``). Each runs on every rank of the active
mesh; the integers come back as remote int64 scalar tensors, as in Monarch (``dask_monarch.inspect(memory_allocated())``
gives a rank's count). On a worker without CUDA, ``device_count`` and ``is_available`` give 0, the memory counts 0
(torch's own answers there) and ``empty_cache`` does nothing."""

from __future__ import annotations

import torch

from ..controller import remote

__all__ = ["device_count", "empty_cache", "is_available", "memory_allocated", "memory_reserved"]


def _int64():
    return torch.tensor(0)


@remote(propagate=_int64)
def device_count() -> torch.Tensor:
    """``torch.cuda.device_count()`` on each rank: the CUDA devices its worker process sees (int64 scalar)."""
    return torch.tensor(torch.cuda.device_count())


@remote(propagate="inspect")
def empty_cache() -> None:
    """``torch.cuda.empty_cache()`` on each rank: the caching allocator's free blocks go back to the device."""
    torch.cuda.empty_cache()


@remote(propagate=_int64)
def memory_allocated() -> torch.Tensor:
    """``torch.cuda.memory_allocated()`` on each rank: bytes held by tensors on its current device (int64 scalar)."""
    return torch.tensor(torch.cuda.memory_allocated())


@remote(propagate=_int64)
def memory_reserved() -> torch.Tensor:
    """``torch.cuda.memory_reserved()`` on each rank: bytes the caching allocator holds on its current device
    (int64 scalar)."""
    return torch.tensor(torch.cuda.memory_reserved())


@remote(propagate=_int64)
def is_available() -> torch.Tensor:
    """``int(torch.cuda.is_available())`` on each rank: 1 if its worker can use CUDA, else 0 (int64 scalar)."""
    return torch.tensor(int(torch.cuda.is_available()))
