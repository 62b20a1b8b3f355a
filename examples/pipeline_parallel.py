"""Pipeline parallelism (2 stages) times data parallelism (2 replicas) on scikit-learn's digits: 4 workers.

The mesh is ``dp=2 x pp=2``. Stage 0 (the ranks with ``pp=0``) holds the first layer of an MLP, stage 1 (``pp=1``)
the rest; each stage is a sub-mesh ``mesh.slice(pp=i)`` with one dimension, ``dp``. Every training step splits
each replica's batch into micro-batches and runs a GPipe schedule:

* forward: stage 0 computes a micro-batch's activations, which go to stage 1 with ``to_mesh`` (each stage-0 rank
  sends to the stage-1 rank of its ``dp`` coordinate), where the loss is computed;
* backward: stage 1 back-propagates to its copy of the activations, whose gradients go back to stage 0 with
  ``to_mesh``; stage 0 back-propagates them through its layer (``h.backward(grad)``);
* then each stage averages its parameters' gradients over ``dp`` (``reduce_``) and takes an SGD step.

The controller only issues the messages; the stages work concurrently, stage 0 starting the next micro-batch while
stage 1 works on the previous one (each rank's stream runs in order; nothing waits but the per-epoch fetch).
Autograd does not cross meshes, so the activations travel detached (``h.detach().to_mesh(...)``) and their copy
is made a leaf that requires grad, as in a hand-written pipeline schedule.

Run it::

    python examples/pipeline_parallel.py                         # an embedded local cluster of 4 workers
    python examples/pipeline_parallel.py --micro-batches 4 --epochs 10
    python examples/pipeline_parallel.py --scheduler tcp://127.0.0.1:8786
    python examples/pipeline_parallel.py --compile               # each step replayed from one recording

The last line printed is ``test_accuracy=0.XXXX``.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import dask_monarch as dm

N_SAMPLES, N_FEATURES, N_CLASSES, N_TEST = 1797, 64, 10, 360  # load_digits(); a fixed 20% test split
MOMENTUM = 0.9


def shard_sizes(world: int) -> tuple[int, int]:
    """Training and test rows per data-parallel replica (the training set drops its remainder, the test set is
    padded with label -1)."""
    return (N_SAMPLES - N_TEST) // world, math.ceil(N_TEST / world)


def load_shard(mesh, seed: int):
    """Runs on each rank of a stage: the shard of its ``dp`` replica (both stages load the same rows)."""
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


def shuffle_(rows: torch.Tensor, seed: int, epoch: int) -> None:
    """Runs on each rank: permute its replica's rows in place, the same way on both stages (stage 0 shuffles the
    images, stage 1 their labels)."""
    perm = torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(len(rows)))
    rows.copy_(rows[perm])


class Stage0(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.layer = nn.Linear(N_FEATURES, hidden)

    def forward(self, x):
        return torch.relu(self.layer(x))


class Stage1(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.layer = nn.Linear(hidden, hidden // 2)
        self.out = nn.Linear(hidden // 2, N_CLASSES)

    def forward(self, h):
        return self.out(torch.relu(self.layer(h)))


def train(mesh, epochs: int, seed: int, lr: float, batch_size: int, micro_batches: int, hidden: int,
          compiled: bool, start: float) -> float:
    stage0, stage1 = mesh.slice(pp=0), mesh.slice(pp=1)
    with mesh.activate():
        dm.remote(torch.manual_seed, propagate="inspect")(seed)
    with stage0.activate():
        first = Stage0(hidden)
        opt0 = torch.optim.SGD(first.parameters(), lr=lr, momentum=MOMENTUM)
        x, _, x_test, _ = dm.remote(load_shard, propagate=load_shard_shapes)(stage0, seed)
    with stage1.activate():
        rest = Stage1(hidden)
        opt1 = torch.optim.SGD(rest.parameters(), lr=lr, momentum=MOMENTUM)
        _, y, _, y_test = dm.remote(load_shard, propagate=load_shard_shapes)(stage1, seed)
    micro = batch_size // micro_batches

    def train_step(xb, yb):
        """One GPipe step on one batch per replica: ``xb`` on stage 0, ``yb`` on stage 1."""
        sent, received = [], []
        for m in range(micro_batches):  # forward: stage 0, then the activations to stage 1
            with stage0.activate():
                h = first(xb[m * micro:(m + 1) * micro])
            a = h.detach().to_mesh(stage1)
            sent.append(h)
            received.append(a)
        losses = []
        for m, (h, a) in enumerate(zip(sent, received)):  # backward: stage 1, the gradients back, stage 0
            with stage1.activate():
                a.requires_grad_()
                loss = F.cross_entropy(rest(a), yb[m * micro:(m + 1) * micro]) / micro_batches
                loss.backward()
                losses.append(loss.detach())
            with stage0.activate():
                h.backward(a.grad.to_mesh(stage0))
        for stage, model, opt in ((stage0, first, opt0), (stage1, rest, opt1)):
            with stage.activate():
                dm.reduce_([p.grad for p in model.parameters()], "dp", "avg")
                opt.step()
                opt.zero_grad()
        with stage1.activate():
            return torch.stack(losses).sum()

    if compiled:
        train_step = dm.compile(train_step, warmup=1)

    steps = x.shape[0] // batch_size
    for epoch in range(1, epochs + 1):
        dm.remote(shuffle_)(x, seed, epoch)  # on stage 0
        dm.remote(shuffle_)(y, seed, epoch)  # on stage 1
        losses = []
        for step in range(steps):
            rows = slice(step * batch_size, (step + 1) * batch_size)
            losses.append(train_step(x[rows], y[rows]))
        with torch.no_grad():
            with stage0.activate():
                h_test = first(x_test)
            with stage1.activate():
                counted = y_test >= 0
                correct = (rest(h_test.to_mesh(stage1)).argmax(dim=1) == y_test) & counted
                counts = torch.stack([correct.sum(), counted.sum()]).reduce("dp", "sum")
                train_loss = torch.stack(losses).mean()
        train_loss, counts = dm.fetch_shard((train_loss, counts), dp=0).result()
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
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (divides batch size)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--compile", action="store_true", help="dm.compile the training step")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.micro_batches < 1 or args.batch_size % args.micro_batches:
        parser.error("--epochs and --micro-batches must be at least 1, and --micro-batches must divide --batch-size")
    start = time.perf_counter()
    with dm.attach(args.scheduler, dims={"dp": 2, "pp": 2}) as mesh:
        print(f"attached to {mesh!r} in {time.perf_counter() - start:.1f} s", flush=True)
        accuracy = train(mesh, args.epochs, args.seed, args.lr, args.batch_size, args.micro_batches, args.hidden,
                         args.compile, start)
    print(f"test_accuracy={accuracy:.4f}")


if __name__ == "__main__":
    main()
