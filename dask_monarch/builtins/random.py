"""Seeding and generator states on the ranks (Monarch's ``monarch.builtins.random``), one remote function per
torch call: each runs on every rank of the active mesh, on that rank's torch generators (its worker process's).
The CUDA ones do nothing on workers without CUDA (torch's ``torch.cuda.manual_seed`` is lazy there) and the
``_all_cuda`` states are then empty lists."""

from __future__ import annotations

import torch

from ..controller import remote

__all__ = [
    "get_rng_state_all_cuda_remote", "get_rng_state_remote", "manual_seed_all_cuda_remote", "manual_seed_cuda_remote",
    "random_seed_remote", "seed_remote", "set_manual_seed_remote", "set_rng_state_all_cuda_remote",
    "set_rng_state_remote",
]

#: bytes in the state of torch's CPU generator (``torch.get_rng_state()``), the same on the workers' torch
_CPU_STATE_BYTES = torch.get_rng_state().numel()


@remote(propagate="inspect")
def set_manual_seed_remote(seed: int, process_idx: int = 0) -> None:
    """``torch.manual_seed(seed ^ process_idx)`` on every rank: the same ``seed`` gives the same draws; a different
    ``process_idx`` (an int, or a remote int tensor such as ``mesh.rank("dp")`` for a seed per rank) gives other
    ones."""
    torch.manual_seed(int(seed) ^ int(process_idx))


@remote(propagate=lambda: torch.empty(_CPU_STATE_BYTES, dtype=torch.uint8))
def get_rng_state_remote() -> torch.Tensor:
    """Each rank's CPU generator state, a remote ``uint8`` tensor (``torch.get_rng_state()``)."""
    return torch.get_rng_state()


@remote(propagate="inspect")
def set_rng_state_remote(new_state: torch.Tensor) -> None:
    """``torch.set_rng_state(new_state)`` on every rank (a state from ``get_rng_state_remote``)."""
    torch.set_rng_state(new_state)


@remote(propagate="inspect")
def seed_remote() -> None:
    """``torch.seed()`` on every rank: a non-deterministic seed (the seed itself is not returned, as in Monarch)."""
    torch.seed()


@remote(propagate="inspect")
def random_seed_remote() -> None:
    """``torch.random.seed()`` on every rank (the same call as ``seed_remote``)."""
    torch.random.seed()


@remote(propagate="inspect")
def manual_seed_cuda_remote(seed: int) -> None:
    """``torch.cuda.manual_seed(seed)`` on every rank (its current CUDA device)."""
    torch.cuda.manual_seed(seed)


@remote(propagate="inspect")
def manual_seed_all_cuda_remote(seed: int) -> None:
    """``torch.cuda.manual_seed_all(seed)`` on every rank (every CUDA device its worker sees)."""
    torch.cuda.manual_seed_all(seed)


# the list's length is the number of devices the workers see: learned on the mesh's first rank
@remote(propagate="cached")
def get_rng_state_all_cuda_remote() -> list:
    """Each rank's CUDA generator states, one remote ``uint8`` tensor per device its worker sees
    (``torch.cuda.get_rng_state_all()``; an empty list without CUDA)."""
    return torch.cuda.get_rng_state_all()


@remote(propagate="inspect")
def set_rng_state_all_cuda_remote(states: list) -> None:
    """``torch.cuda.set_rng_state_all(states)`` on every rank (states from ``get_rng_state_all_cuda_remote``)."""
    torch.cuda.set_rng_state_all(states)
