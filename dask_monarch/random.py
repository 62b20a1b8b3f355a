"""Random-number state of the ranks of a mesh (Monarch's ``monarch.random``): ``make_deterministic``, ``get_state``,
``set_state``, ``new_state``.

Every function here is a remote function: call it under ``mesh.activate()`` (or with remote tensors of a mesh) and
it runs on every rank of that mesh, in order with the other work sent there. Each rank's generators are the torch
generators of its worker process (CPU, and on a GPU worker the CUDA generator of its device), so a state is per
rank: ``get_state()`` gives remote tensors whose values differ from rank to rank if the ranks were seeded
differently. Sessions that share a worker process share its generators, as they share its torch.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from .controller import Tensor, remote

__all__ = ["State", "get_state", "make_deterministic", "new_state", "set_state"]


class State(NamedTuple):
    """The generator states of each rank, as remote ``uint8`` tensors (``torch.get_rng_state()``'s format):
    ``cpu``, the CPU generator's (5056 bytes with torch's Mersenne Twister); ``cuda``, the current CUDA device's
    (``torch.cuda.get_rng_state()``), empty (0 bytes) on a worker without CUDA."""

    cpu: Tensor
    cuda: Tensor


def _cuda_state() -> torch.Tensor:
    if torch.cuda.is_available():
        return torch.cuda.get_rng_state()
    return torch.empty(0, dtype=torch.uint8)


# propagate="cached": whether the workers have CUDA (hence the size of ``cuda``) is learned on the mesh's first rank
@remote(propagate="cached")
def _get_state() -> tuple:
    return torch.get_rng_state(), _cuda_state()


@remote(propagate="inspect")
def _set_state(cpu: torch.Tensor, cuda: torch.Tensor) -> None:
    torch.set_rng_state(cpu)
    if cuda.numel():
        torch.cuda.set_rng_state(cuda)


@remote(propagate="inspect")
def _manual_seed(seed) -> None:
    torch.manual_seed(int(seed.item()) if isinstance(seed, torch.Tensor) else int(seed))


@remote(propagate="inspect")
def _make_deterministic() -> None:
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # cuBLAS needs a fixed workspace for deterministic results (torch.use_deterministic_algorithms's documentation)
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"


def make_deterministic() -> None:
    """Make every rank's torch deterministic (Monarch's ``monarch.random.make_deterministic``):
    ``torch.use_deterministic_algorithms(True)``, cuDNN deterministic and without benchmarking, and
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in the worker's environment. These are settings of the worker process, as
    torch has them: they stay after the session ends, for later work in that process. Raises ``ValueError``
    without an active mesh."""
    _make_deterministic()


def get_state() -> State:
    """Every rank's generator states as a ``State`` of remote ``uint8`` tensors (Monarch's ``get_state``); fetch one
    rank's with ``dm.inspect(state)``, give them back with ``set_state``. Raises ``ValueError`` without an active
    mesh."""
    cpu, cuda = _get_state()
    return State(cpu, cuda)


def set_state(state: State) -> None:
    """Set every rank's generators to ``state`` (a ``State`` or a ``(cpu, cuda)`` pair of remote tensors from
    ``get_state``/``new_state``, each rank its own), so the draws after it repeat those after the state was taken
    (Monarch's ``set_state``). A state that is not one raises ``RuntimeError`` on the workers, as
    ``torch.set_rng_state`` does, and that call's failure reaches what depends on it (spec §3)."""
    cpu, cuda = state
    _set_state(cpu, cuda)


def new_state(seed) -> State:
    """The generator states that seeding with ``seed`` gives, without changing the current ones (Monarch's
    ``new_state``): ``seed`` is an int, or a remote integer tensor for a seed per rank (``mesh.rank("dp") + 4``).
    Use it with ``set_state``."""
    current = get_state()
    _manual_seed(seed)
    seeded = get_state()
    set_state(current)
    return seeded
