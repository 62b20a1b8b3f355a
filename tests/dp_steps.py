"""The data-parallel training step the compile tests record (``test_compile.py``, ``test_compile_backends.py``,
``test_gpu_compile.py``): forward, cross-entropy, ``zero_grad``, backward, ``reduce_`` avg of every gradient over
one mesh dimension, the optimizer's step; returns the loss."""

from __future__ import annotations

import torch

import dask_monarch as dm


def dp_step(model, optimizer, dim: str):
    def step(xb, yb):
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        dm.reduce_([p.grad for p in model.parameters()], dim, "avg")
        optimizer.step()
        return loss

    return step


def twin_mlps():
    """Two small MLPs (16 -> 32 -> 4) with the same parameters, made where torch puts them now (on the active
    mesh, on its current device): one to train eagerly, one compiled."""
    models = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)) for _ in range(2)]
    with torch.no_grad():
        for a, b in zip(*(m.parameters() for m in models)):
            b.copy_(a)
    return models
