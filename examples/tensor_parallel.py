"""Tensor parallelism (2 shards) times data parallelism (2 replicas) on scikit-learn's digits: 4 workers.

The mesh is ``dp=2 x tp=2``. The MLP's hidden layer is split over ``tp`` the Megatron way: each ``tp`` rank holds
half of the first layer's output units (a column-parallel linear) and the matching half of the second layer's
inputs (a row-parallel linear), so it computes half of the hidden activations and a partial sum of the logits;
an all-reduce over ``tp`` completes the logits. That layer runs inside remote functions, which receive real
``torch.distributed`` process groups: ``mesh.process_group(("tp",))`` (each rank's peers along ``tp``) for the
all-reduce of the forward pass, and ``mesh.process_group(("dp",))`` to average gradients over the replicas. Each
training step is one remote call per rank: forward, local autograd backward, gradient averaging and an SGD step
on the rank's own shards, in place.

At the start the script checks, on every rank, that the sharded layer computes what the whole layer computes.

Run it::

    python examples/tensor_parallel.py                      # an embedded local cluster of 4 workers
    python examples/tensor_parallel.py --hidden 256 --epochs 10
    python examples/tensor_parallel.py --scheduler tcp://127.0.0.1:8786

The last line printed is ``test_accuracy=0.XXXX``.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dask_monarch as dm

N_SAMPLES, N_FEATURES, N_CLASSES, N_TEST = 1797, 64, 10, 360  # load_digits(); a fixed 20% test split
MOMENTUM = 0.9


def shard_sizes(world: int) -> tuple[int, int]:
    return (N_SAMPLES - N_TEST) // world, math.ceil(N_TEST / world)


def load_shard(mesh, seed: int):
    """Runs on each rank: its ``dp`` replica's rows (both ``tp`` ranks of a replica load the same ones)."""
    from sklearn.datasets import load_digits

    rank, world = mesh.dims["dp"].rank, mesh.dims["dp"].size
    digits = load_digits()
    order = np.random.default_rng(seed).permutation(N_SAMPLES)
    test, train = order[:N_TEST], order[N_TEST:]
    n_train, n_test = shard_sizes(world)
    mine = train[rank * n_train:(rank + 1) * n_train]
    x_train = torch.tensor(digits.data[mine] / 16.0, dtype=torch.float32)
    y_train = torch.tensor(digits.target[mine], dtype=torch.int64)
    mine = test[rank * n_test:(rank + 1) * n_test]
    x_test = torch.zeros(n_test, N_FEATURES)
    y_test = torch.full((n_test,), -1, dtype=torch.int64)
    x_test[:len(mine)] = torch.tensor(digits.data[mine] / 16.0, dtype=torch.float32)
    y_test[:len(mine)] = torch.tensor(digits.target[mine], dtype=torch.int64)
    return x_train, y_train, x_test, y_test


def load_shard_shapes(mesh, seed: int):
    n_train, n_test = shard_sizes(mesh.size("dp"))
    return (torch.empty(n_train, N_FEATURES), torch.empty(n_train, dtype=torch.int64),
            torch.empty(n_test, N_FEATURES), torch.empty(n_test, dtype=torch.int64))


def shuffle_(x: torch.Tensor, y: torch.Tensor, seed: int, epoch: int) -> None:
    perm = torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(len(y)))
    x.copy_(x[perm])
    y.copy_(y[perm])


# ---------------------------------------------------------------------------------- the tensor-parallel layer
def full_layers(seed: int, hidden: int):
    """The whole (unsharded) MLP, the same on every rank for a seed."""
    torch.manual_seed(seed)
    return nn.Linear(N_FEATURES, hidden), nn.Linear(hidden, N_CLASSES)


def init_shards(mesh, seed: int, hidden: int):
    """Runs on each rank: this ``tp`` rank's shards of the MLP, and zero momentum buffers for them."""
    first, second = full_layers(seed, hidden)
    tp, n = mesh.dims["tp"].rank, mesh.dims["tp"].size
    units = slice(tp * hidden // n, (tp + 1) * hidden // n)
    with torch.no_grad():
        params = [first.weight[units].clone(), first.bias[units].clone(),  # column-parallel: its output units
                  second.weight[:, units].clone(), second.bias.clone()]  # row-parallel: those inputs; bias whole
    return params + [torch.zeros_like(p) for p in params]


def init_shards_shapes(mesh, seed: int, hidden: int):
    k = hidden // mesh.size("tp")
    shapes = [(k, N_FEATURES), (k,), (N_CLASSES, k), (N_CLASSES,)]
    return [torch.empty(s) for s in shapes] * 2


class AllReduce(torch.autograd.Function):
    """Sum over the group in the forward pass, identity in the backward pass (Megatron's ``g``): the gradient of
    each partial sum is the gradient of the whole."""

    @staticmethod
    def forward(ctx, partial, group):
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def tp_logits(x, w1, b1, w2, b2, tp_group):
    h = torch.relu(x @ w1.T + b1)  # this rank's half of the hidden units
    return AllReduce.apply(h @ w2.T, tp_group) + b2  # the partial logits, summed over tp


def train_step_(w1, b1, w2, b2, m1, mb1, m2, mb2, x, y, lr, tp_group, dp_group):
    """Runs on each rank: one SGD step on its shards, in place; returns the batch loss. Gradients are averaged
    over the replicas (``dp_group``); the ``tp`` ranks of a replica see the same loss."""
    params, momenta = [w1, b1, w2, b2], [m1, mb1, m2, mb2]
    leaves = [p.detach().requires_grad_() for p in params]
    loss = F.cross_entropy(tp_logits(x, *leaves, tp_group), y)
    grads = torch.autograd.grad(loss, leaves)
    with torch.no_grad():
        for p, buf, g in zip(params, momenta, grads):
            dist.all_reduce(g, group=dp_group)
            g /= dp_group.size()
            buf.mul_(MOMENTUM).add_(g)
            p.sub_(lr * buf)
    return loss.detach()


def test_counts(w1, b1, w2, b2, x, y, tp_group):
    """Runs on each rank: ``[correct, counted]`` on its replica's test rows (padding rows have label -1)."""
    with torch.no_grad():
        predicted = tp_logits(x, w1, b1, w2, b2, tp_group).argmax(dim=1)
    counted = y >= 0
    return torch.stack([((predicted == y) & counted).sum(), counted.sum()])


def check_against_full(w1, b1, w2, b2, x, tp_group, seed, hidden):
    """Runs on each rank: the largest difference between the sharded layer's logits and the whole layer's."""
    first, second = full_layers(seed, hidden)
    with torch.no_grad():
        full = second(torch.relu(first(x)))
        return (tp_logits(x, w1, b1, w2, b2, tp_group) - full).abs().max()


# --------------------------------------------------------------------------------------------- controller
def train(mesh, epochs: int, seed: int, lr: float, batch_size: int, hidden: int, start: float) -> float:
    tp_group = mesh.process_group(("tp",))
    dp_group = mesh.process_group(("dp",))
    params = dm.remote(init_shards, propagate=init_shards_shapes)(mesh, seed, hidden)
    shards, momenta = params[:4], params[4:]
    x, y, x_test, y_test = dm.remote(load_shard, propagate=load_shard_shapes)(mesh, seed)
    diff = dm.remote(check_against_full)(*shards, x_test, tp_group, seed, hidden).reduce((), "max")
    print(f"sharded layer vs the whole layer: max |logit difference| = {dm.inspect(diff).item():.2e}", flush=True)
    steps = x.shape[0] // batch_size
    step = dm.remote(train_step_)
    for epoch in range(1, epochs + 1):
        dm.remote(shuffle_)(x, y, seed, epoch)
        losses = []
        for k in range(steps):
            rows = slice(k * batch_size, (k + 1) * batch_size)
            losses.append(step(*shards, *momenta, x[rows], y[rows], lr, tp_group, dp_group))
        with mesh.activate():
            counts = dm.remote(test_counts)(*shards, x_test, y_test, tp_group).reduce("dp", "sum")
            train_loss = torch.stack(losses).mean()
        train_loss, counts = dm.fetch_shard((train_loss, counts), dp=0, tp=0).result()
        with dm.no_mesh.activate():
            accuracy = counts[0].item() / counts[1].item()
            print(f"epoch {epoch:3d}  train_loss {train_loss.item():.4f}  test_acc {accuracy:.4f}  "
                  f"elapsed {time.perf_counter() - start:6.1f} s", flush=True)
    return accuracy


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheduler", default=None, help="address of an existing Dask scheduler (default: local)")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=16, help="training rows per replica per step")
    parser.add_argument("--hidden", type=int, default=128, help="hidden units (split over the 2 tp ranks)")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.hidden % 2:
        parser.error("--epochs and --batch-size must be at least 1, --hidden even")
    start = time.perf_counter()
    with dm.attach(args.scheduler, dims={"dp": 2, "tp": 2}) as mesh:
        print(f"attached to {mesh!r} in {time.perf_counter() - start:.1f} s", flush=True)
        accuracy = train(mesh, args.epochs, args.seed, args.lr, args.batch_size, args.hidden, start)
    print(f"test_accuracy={accuracy:.4f}")


if __name__ == "__main__":
    main()
