"""The default dtype on the ranks (Monarch's ``monarch.builtins.misc``): ``set_default_dtype_remote(dtype)`` and
``get_default_dtype_remote()``. Each runs on every rank of the active mesh and, as Monarch's, its propagation runs
the same torch call on the controller, so the controller's default dtype (which the shapes of later factories such
as ``torch.tensor([1.0])`` come from, and which the session gives the workers before each operation) follows."""

from __future__ import annotations

import torch

from ..controller import remote

__all__ = ["get_default_dtype_remote", "set_default_dtype_remote"]


@remote(propagate=lambda dtype: torch.set_default_dtype(dtype))
def set_default_dtype_remote(dtype: torch.dtype) -> None:
    """``torch.set_default_dtype(dtype)`` on every rank and on the controller (a floating ``torch.dtype``; torch
    raises ``TypeError`` for another)."""
    torch.set_default_dtype(dtype)


@remote(propagate=lambda: torch.get_default_dtype())
def get_default_dtype_remote() -> torch.dtype:
    """Each rank's ``torch.get_default_dtype()``; the value the call returns on the controller is the controller's,
    which the session keeps the ranks' equal to."""
    return torch.get_default_dtype()
