"""Data-parallel training of a small MLP on scikit-learn's digits, driven by one controller program.

This script is the controller. It never holds the data or the model: each rank of the mesh (a Dask worker)
loads only its own shard of the training set, computes gradients on it, averages them with the other ranks
(``reduce_`` over the "dp" dimension) and updates its copy of the parameters in place. The controller only
sends those steps and, once per epoch, fetches the training loss from rank 0 and the test accuracy.

Run it::

    python examples/train_digits.py                       # an embedded local cluster of 2 workers
    python examples/train_digits.py --workers 4 --epochs 10
    python examples/train_digits.py --scheduler tcp://127.0.0.1:8786   # workers of an existing cluster

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


# ------------------------------------------------------------------------- the model: runs on every worker
HIDDEN = 128
MOMENTUM = 0.9
# All parameters live in one flat tensor: one remote tensor, one reduce and one update per step.
SHAPES = [(N_FEATURES, HIDDEN), (HIDDEN,), (HIDDEN, N_CLASSES), (N_CLASSES,)]
N_PARAMS = sum(math.prod(shape) for shape in SHAPES)


def unflatten(flat: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``flat`` as the weight and bias tensors of the MLP."""
    views, start = [], 0
    for shape in SHAPES:
        views.append(flat[start:start + math.prod(shape)].view(shape))
        start += math.prod(shape)
    return views


def logits(params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = unflatten(params)
    return torch.relu(x @ w1 + b1) @ w2 + b2


def load_shard(mesh, seed: int):
    """Load this rank's shard of a fixed shuffled train/test split (the same split on every rank)."""
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


def init_params(mesh, seed: int):
    """The same initial parameters on every rank (same seed), and a zero momentum buffer. ``mesh`` only says
    where this runs."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for shape in SHAPES:
        if len(shape) == 2:  # a weight matrix: He initialization
            parts.append(torch.randn(shape, generator=g).flatten() * math.sqrt(2 / shape[0]))
        else:  # a bias
            parts.append(torch.zeros(shape))
    params = torch.cat(parts)
    return params, torch.zeros_like(params)


def shuffle_(x: torch.Tensor, y: torch.Tensor, seed: int, epoch: int) -> None:
    """Shuffle this rank's training shard in place, differently in each epoch. Every rank applies the same
    permutation to its own (disjoint, randomly drawn) shard, so each global batch is still a random sample."""
    perm = torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(len(y)))
    x.copy_(x[perm])
    y.copy_(y[perm])


def gradient(params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, start: int, stop: int):
    """Gradient of the cross-entropy loss on rows ``start:stop`` of the shard, and that loss."""
    p = params.detach().requires_grad_()
    loss = F.cross_entropy(logits(p, x[start:stop]), y[start:stop])
    (grad,) = torch.autograd.grad(loss, p)
    return grad, loss.detach()


def gradient_shapes(params, x, y, start, stop):
    """``propagate`` for ``gradient``: its output shapes, without running autograd on the controller."""
    return torch.empty_like(params), torch.empty(())


def sgd_step_(params: torch.Tensor, velocity: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
    """SGD with momentum, in place: ``params`` and ``velocity`` are mutated."""
    velocity.mul_(MOMENTUM).add_(grad)
    params.sub_(velocity, alpha=lr)


def mean(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(values).mean()


def count_correct(params: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[correct, counted]`` on this rank's test shard (padding rows, label -1, are not counted)."""
    counted = y >= 0
    correct = (logits(params, x).argmax(dim=1) == y) & counted
    return torch.stack([correct.sum(), counted.sum()])


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
          progress: bool | None = None) -> float:
    """Train on ``mesh`` and return the test accuracy. ``progress``: show a progress bar per epoch (None: on a
    terminal)."""
    # Every call below runs on every rank of the mesh and returns remote tensors (handles) immediately.
    x, y, x_test, y_test = dm.remote(load_shard, propagate=load_shard_shapes)(mesh, seed)
    params, velocity = dm.remote(init_params)(mesh, seed)
    compute_gradient = dm.remote(gradient, propagate=gradient_shapes)
    update_ = dm.remote(sgd_step_)  # on fake tensors the controller sees params/velocity change: mutated
    steps = x.shape[0] // batch_size
    bar = progress_bar(epochs, progress)

    for epoch in range(1, epochs + 1):
        dm.remote(shuffle_)(x, y, seed, epoch)  # x and y are mutated
        losses = []
        for step in range(steps):
            grad, loss = compute_gradient(params, x, y, step * batch_size, (step + 1) * batch_size)
            dm.reduce_(grad, "dp", "avg")  # average the gradients of all ranks, in place
            update_(params, velocity, grad, lr)
            losses.append(loss)
        counts = dm.remote(count_correct)(params, x_test, y_test).reduce("dp", "sum")
        # The only wait of the epoch: rank 0's mean training loss and the test counts summed over ranks.
        train_loss, (correct, total) = dm.fetch_shard((dm.remote(mean)(losses), counts), dp=0).result()
        accuracy = correct.item() / total.item()
        line = (f"epoch {epoch:3d}  train_loss {train_loss.item():.4f}  test_acc {accuracy:.4f}  "
                f"elapsed {time.perf_counter() - start_time:6.1f} s")
        if bar is None:
            print(line, flush=True)
        else:
            bar.write(line, file=sys.stdout)  # above the bar, on stdout
            bar.set_postfix(train_loss=f"{train_loss.item():.4f}", test_acc=f"{accuracy:.4f}", refresh=False)
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
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar per epoch on stderr (default: when stderr is a terminal)")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be at least 1")

    start = time.perf_counter()
    with dm.attach(args.scheduler, dims={"dp": args.workers}) as mesh:
        print(f"attached to {mesh!r} in {time.perf_counter() - start:.1f} s", flush=True)
        accuracy = train(mesh, args.epochs, args.seed, args.lr, args.batch_size, start, args.progress)
    print(f"test_accuracy={accuracy:.4f}")


if __name__ == "__main__":  # required: the embedded cluster starts its workers with multiprocessing's spawn
    main()
