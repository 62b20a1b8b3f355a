"""Data-parallel training of a small MLP on scikit-learn's digits, driven by one controller program.

This script is the controller. It never holds the data or the model: each rank of the mesh (a Dask worker)
loads only its own shard of the training set, computes gradients on it, averages them with the other ranks
(``reduce_`` over the "dp" dimension) and updates its copy of the parameters in place. The controller only
sends those steps and, once per epoch, fetches the training loss from rank 0 and the test accuracy.

Run it::

    python examples/train_digits.py                       # an embedded local cluster of 2 workers
    python examples/train_digits.py --workers 4 --epochs 10
    python examples/train_digits.py --scheduler tcp://127.0.0.1:8786   # workers of an existing cluster
    python examples/train_digits.py --compile             # each training step replayed from one recording

The last line printed is ``test_accuracy=0.XXXX``. On a terminal a progress bar per epoch runs on stderr
(``--progress``/``--no-progress`` to choose); the epoch lines and the last line go to stdout either way. While it
runs, the Dask dashboard's ``/monarch`` page shows the mesh, each rank's message counters and rates.

The functions that run on the workers are ordinary PyTorch functions defined in this file. Because this file
runs as ``__main__``, dask_monarch sends them by value (cloudpickle), so the workers do not need this file on
their import path: that is what makes ``--scheduler`` work with workers started anywhere.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import dask_monarch as dm

# ----------------------------------------------------------------------------------------------- data layout
N_SAMPLES = 1797  # sklearn.datasets.load_digits(): 1797 images of 8x8 pixels, 10 classes
N_FEATURES = 64
N_CLASSES = 10
N_TEST = 360  # a fixed, shuffled 20% test split; the other 1437 images are the training set


def shard_sizes(world: int) -> tuple[int, int]:
    """Rows per rank of the training and the test shard. Every rank has the same shapes: the training set drops
    its remainder (like ``DistributedSampler(drop_last=True)``); the test set is padded with label -1."""
    return (N_SAMPLES - N_TEST) // world, math.ceil(N_TEST / world)


MOMENTUM = 0.9


# ------------------------------------------------------------------------------------------- model and data
class MLP(nn.Module):
    """64 -> 128 -> 10 with a ReLU: plain PyTorch. Built under ``mesh.activate()``, its parameters live on the
    mesh, one copy per rank."""

    def __init__(self, hidden: int = 128):
        super().__init__()
        self.hidden = nn.Linear(N_FEATURES, hidden)
        self.out = nn.Linear(hidden, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def load_shard(mesh, seed: int):
    """Runs on each rank: load this rank's shard of a fixed shuffled train/test split (the same split on every
    rank). Only this function touches the data, and only on the workers."""
    from sklearn.datasets import load_digits

    rank, world = mesh.dims["dp"].rank, mesh.dims["dp"].size
    digits = load_digits()
    assert len(digits.target) == N_SAMPLES, "load_digits() changed size"
    order = np.random.default_rng(seed).permutation(N_SAMPLES)
    test, train = order[:N_TEST], order[N_TEST:]
    n_train, n_test = shard_sizes(world)

    mine = train[rank * n_train:(rank + 1) * n_train]
    x_train = torch.tensor(digits.data[mine] / 16.0, dtype=torch.float32)
    y_train = torch.tensor(digits.target[mine], dtype=torch.int64)

    mine = test[rank * n_test:(rank + 1) * n_test]
    x_test = torch.zeros(n_test, N_FEATURES)
    y_test = torch.full((n_test,), -1, dtype=torch.int64)  # -1: padding, not counted
    x_test[:len(mine)] = torch.tensor(digits.data[mine] / 16.0, dtype=torch.float32)
    y_test[:len(mine)] = torch.tensor(digits.target[mine], dtype=torch.int64)
    return x_train, y_train, x_test, y_test


def load_shard_shapes(mesh, seed: int):
    """``propagate`` for ``load_shard``: the controller cannot load the data, but knows the shapes."""
    n_train, n_test = shard_sizes(mesh.size("dp"))
    return (torch.empty(n_train, N_FEATURES), torch.empty(n_train, dtype=torch.int64),
            torch.empty(n_test, N_FEATURES), torch.empty(n_test, dtype=torch.int64))


def shuffle_(x: torch.Tensor, y: torch.Tensor, seed: int, epoch: int) -> None:
    """Runs on each rank: shuffle its training shard in place, differently in each epoch. Every rank applies the
    same permutation to its own (disjoint, randomly drawn) shard, so each global batch is still a random sample."""
    perm = torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(len(y)))
    x.copy_(x[perm])
    y.copy_(y[perm])


# ---------------------------------------------------------------------------------------------- controller
def progress_bar(epochs: int, enabled: bool | None):
    """A per-epoch progress bar on stderr (tqdm), or None: when disabled, when ``enabled`` is None and stderr is
    not a terminal, or without tqdm."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=epochs, desc="training", unit="epoch", file=sys.stderr, dynamic_ncols=True)


def train(mesh, epochs: int, seed: int, lr: float, batch_size: int, start_time: float,
          progress: bool | None = None, device: str = "cpu", compiled: bool = False) -> float:
    """Train on ``mesh`` and return the test accuracy. ``progress``: show a progress bar per epoch (None: on a
    terminal). ``device``: where the workers compute ("cuda": each worker's own GPU). ``compiled``: the training
    step is ``dm.compile``d: its first call runs eagerly (``warmup=1``: SGD makes its momentum buffers there),
    the second is recorded, and every later step is one ``CallRecording`` per rank that the workers replay."""
    with mesh.activate():  # from here on every torch operation runs on every rank of the mesh
        dm.remote(torch.manual_seed, propagate="inspect")(seed)  # the same initial parameters on every rank
        with torch.device(device):  # parameters made on the workers' GPUs (or CPUs) directly
            model = MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
        x, y, x_test, y_test = (t.to(device) for t in dm.remote(load_shard, propagate=load_shard_shapes)(mesh, seed))
        steps = x.shape[0] // batch_size
        bar = progress_bar(epochs, progress)

        def train_step(xb, yb):
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            # data parallel: average every gradient over the "dp" dimension, in place (the Reduce message)
            dm.reduce_([p.grad for p in model.parameters()], "dp", "avg")
            optimizer.step()
            return loss.detach()

        if compiled:
            train_step = dm.compile(train_step, warmup=1)

        for epoch in range(1, epochs + 1):
            dm.remote(shuffle_)(x, y, seed, epoch)  # x and y are mutated in place
            losses = []
            for step in range(steps):
                rows = slice(step * batch_size, (step + 1) * batch_size)
                losses.append(train_step(x[rows], y[rows]))
            with torch.no_grad():
                counted = y_test >= 0  # padding rows (label -1) do not count
                correct = (model(x_test).argmax(dim=1) == y_test) & counted
                counts = torch.stack([correct.sum(), counted.sum()]).reduce("dp", "sum")
                train_loss = torch.stack(losses).mean()
            # The only wait of the epoch: rank 0's mean training loss and the test counts summed over ranks.
            train_loss, counts = dm.fetch_shard((train_loss, counts), dp=0).result()
            with dm.no_mesh.activate():  # local tensors again: the fetched values
                train_loss = train_loss.item()
                accuracy = counts[0].item() / counts[1].item()
            line = (f"epoch {epoch:3d}  train_loss {train_loss:.4f}  test_acc {accuracy:.4f}  "
                    f"elapsed {time.perf_counter() - start_time:6.1f} s")
            if bar is None:
                print(line, flush=True)
            else:
                bar.write(line, file=sys.stdout)  # above the bar, on stdout
                bar.set_postfix(train_loss=f"{train_loss:.4f}", test_acc=f"{accuracy:.4f}", refresh=False)
                bar.update(1)
    if bar is not None:
        bar.close()
    return accuracy


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheduler", default=None,
                        help="address of an existing Dask scheduler (default: start a local cluster)")
    parser.add_argument("--workers", type=int, default=2, help="mesh size: number of data-parallel ranks")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=16, help="training rows per rank per step")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the workers compute: cuda uses each worker's own GPU")
    parser.add_argument("--compile", action="store_true",
                        help="dm.compile the training step: later steps replay its recording on the workers")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar per epoch on stderr (default: when stderr is a terminal)")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be at least 1")

    start = time.perf_counter()
    with dm.attach(args.scheduler, dims={"dp": args.workers}) as mesh:
        print(f"attached to {mesh!r} in {time.perf_counter() - start:.1f} s", flush=True)
        accuracy = train(mesh, args.epochs, args.seed, args.lr, args.batch_size, start, args.progress, args.device,
                         args.compile)
    print(f"test_accuracy={accuracy:.4f}")


if __name__ == "__main__":  # required: the embedded cluster starts its workers with multiprocessing's spawn
    main()
