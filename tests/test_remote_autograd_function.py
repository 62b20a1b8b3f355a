"""``remote_autograd_function`` (Monarch's ``monarch.cached_remote_function``): a ``torch.autograd.Function`` whose
forward and backward run on every rank, with the controller's autograd driving the backward."""

from __future__ import annotations

import pytest
import torch

import dask_monarch as dm
from dask_monarch.cached_remote_function import RemoteAutogradFunction, remote_autograd_function
from test_gradients import TIMEOUT, fetch, mesh  # noqa: F401 (mesh: a module-scoped {"dp": 2} mesh fixture)


class ScaledProduct(torch.autograd.Function):
    """x * y * scale when x requires grad, else x + y; also returns y, a constant, and a Python value."""

    @staticmethod
    def forward(ctx, x, y, scale):
        ctx.save_for_backward(x, y)
        ctx.scale = scale
        out = x * y * scale if x.requires_grad else x + y
        return out, y.clone(), torch.ones(2), 7

    @staticmethod
    def backward(ctx, d_out, d_y, d_const, d_value):
        x, y = ctx.saved_tensors
        return d_out * y * ctx.scale, d_out * x * ctx.scale + d_y, None


def test_forward_and_backward_run_on_each_rank_and_give_torchs_gradients(mesh):
    remote_fn = remote_autograd_function(ScaledProduct)
    assert issubclass(remote_fn, RemoteAutogradFunction) and remote_fn.__name__ == "Remote_ScaledProduct"
    with mesh.activate():
        r = mesh.rank("dp")
        x = (torch.arange(3.0) + r).requires_grad_(True)
        y = (torch.ones(3) * (r + 2)).requires_grad_(True)
        out, y_again, const, value = remote_fn.apply(x, y, 0.5)
        assert value == 7 and tuple(const.shape) == (2,)
        ((out * out).sum() + y_again.sum()).backward()
        got = {rank: [fetch(t, dp=rank) for t in (out, x.grad, y.grad)] for rank in (0, 1)}
    for rank in (0, 1):
        lx = (torch.arange(3.0) + rank).requires_grad_(True)
        ly = (torch.ones(3) * (rank + 2)).requires_grad_(True)
        lout, ly_again, _, _ = ScaledProduct.apply(lx, ly, 0.5)
        ((lout * lout).sum() + ly_again.sum()).backward()
        for a, b in zip(got[rank], (lout.detach(), lx.grad, ly.grad)):
            assert torch.allclose(a, b), (rank, a, b)


def test_the_ranks_see_which_arguments_require_grad(mesh):
    remote_fn = remote_autograd_function(ScaledProduct)
    with mesh.activate():
        x = torch.ones(3)  # does not require grad: forward takes its x + y branch on the ranks
        y = torch.full((3,), 2.0, requires_grad=True)
        out, _, _, _ = remote_fn.apply(x, y, 0.5)
        out.sum().backward()
        assert x.grad is None
        local_out, y_grad = fetch(out, dp=1), fetch(y.grad, dp=1)
    assert torch.equal(local_out, torch.full((3,), 3.0))
    assert torch.equal(y_grad, torch.full((3,), 0.5))  # d_out * x * scale


def test_bad_classes():
    with pytest.raises(TypeError, match="torch.autograd.Function subclass"):
        remote_autograd_function(torch.nn.Linear)

    class Local(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

    with pytest.raises(TypeError, match="inside a function"):
        remote_autograd_function(Local)
    made = remote_autograd_function(ScaledProduct)
    with pytest.warns(UserWarning, match="already a remote autograd.Function"):
        assert remote_autograd_function(made) is made
