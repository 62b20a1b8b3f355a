"""The digits training loop of ``train_digits.py``, fed by a pipe over a ``dask.dataframe`` (issue 15).

The training set is written to Parquet first and read with ``dask.dataframe.read_parquet``; every epoch,
``dm.create_pipe(ddf, mesh, batch_size=16, label="target")`` feeds each rank batches of its own partitions (the
workers read and convert the next batches while the mesh computes; no row passes through the controller), and
``pipe.recv()`` (here: iterating the pipe) gives each step its ``(x, y)``. The test set comes in with
``dm.from_dask``. Run it::

    python examples/train_digits_pipe.py                  # an embedded local cluster of 2 workers
    python examples/train_digits_pipe.py --epochs 20 --workers 2

The last line printed is ``test_accuracy=0.XXXX`` (the bar: 0.95).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import dask_monarch as dm

FEATURES = [f"p{i}" for i in range(64)]
N_TEST = 360


class MLP(nn.Module):
    """64 -> 128 -> 10 with a ReLU (``train_digits.MLP``)."""

    def __init__(self, hidden: int = 128):
        super().__init__()
        self.hidden = nn.Linear(64, hidden)
        self.out = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def digits_frame(repeat: int = 1, seed: int = 0):
    """scikit-learn's digits (1797 images of 8x8 pixels scaled to [0, 1], float32 columns ``p0``..``p63``, int64
    ``target``) in a fixed shuffled order, repeated ``repeat`` times."""
    import pandas as pd
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    frame = pd.DataFrame((digits.data[order] / 16.0).astype(np.float32), columns=FEATURES)
    frame["target"] = digits.target[order].astype(np.int64)
    if repeat > 1:
        frame = pd.concat([frame] * repeat, ignore_index=True)
    return frame


def write_parquet(frame, path: str, files: int) -> str:
    """``frame`` as ``files`` Parquet files in directory ``path`` (pyarrow), for ``dd.read_parquet``."""
    os.makedirs(path, exist_ok=True)
    for i, part in enumerate(np.array_split(np.arange(len(frame)), files)):
        frame.iloc[part].to_parquet(os.path.join(path, f"part.{i:03d}.parquet"), index=False)
    return path


def train(mesh, train_path: str, test_path: str, epochs: int = 15, lr: float = 0.1, batch_size: int = 16,
          seed: int = 0, log=print):
    """Train an ``MLP`` on ``mesh`` from the Parquet training set (a pipe per epoch) and return ``(model,
    test accuracy)``."""
    import dask.dataframe as dd

    with mesh.activate():
        dm.remote(torch.manual_seed, propagate="inspect")(seed)  # the same initial parameters on every rank
        model = MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, foreach=True)
    # the test rows need not split evenly over the ranks (360 rows over 16): the last ranks' blocks are padded with
    # rows of -1, a label no digit has, which the accuracy below leaves out
    test = dm.from_dask(dd.read_parquet(test_path), mesh, columns=FEATURES + ["target"], dtype=torch.float32, pad=-1)
    with mesh.activate():
        x_test, y_test = test[:, :64], test[:, 64].long()
    ddf = dd.read_parquet(train_path)
    accuracy = 0.0
    for epoch in range(1, epochs + 1):
        shuffled = ddf.sample(frac=1.0, random_state=seed + epoch)  # a new order within each partition
        pipe = dm.create_pipe(shuffled, mesh, batch_size=batch_size, columns=FEATURES, label="target", prefetch=4)
        losses = []
        with mesh.activate():
            for xb, yb in pipe:                # one PipeRecv per step; StopIteration after len(pipe) batches
                loss = F.cross_entropy(model(xb), yb)
                optimizer.zero_grad()
                loss.backward()
                dm.reduce_([p.grad for p in model.parameters()], "dp", "avg")
                optimizer.step()
                losses.append(loss.detach())
            with torch.no_grad():
                real = y_test >= 0
                correct = ((model(x_test).argmax(dim=1) == y_test) & real).sum()
                counts = torch.stack([correct, real.sum()]).reduce("dp", "sum")
                train_loss = torch.stack(losses).mean()
        pipe.close()
        train_loss, counts = dm.fetch_shard((train_loss, counts)).result()
        accuracy = counts[0].item() / counts[1].item()
        log(f"epoch {epoch:3d}  steps {len(pipe)}  train_loss {train_loss.item():.4f}  test_acc {accuracy:.4f}")
    return model, accuracy


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheduler", default=None, help="an existing Dask scheduler (default: embedded cluster)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per rank per step")
    parser.add_argument("--data", default=None, help="directory for the Parquet files (default: a temporary one)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data or tmp
        frame = digits_frame()
        write_parquet(frame.iloc[N_TEST:], os.path.join(root, "train"), files=4)
        write_parquet(frame.iloc[:N_TEST], os.path.join(root, "test"), files=2)
        with dm.attach(args.scheduler, dims={"dp": args.workers}) as mesh:
            print(f"attached to {mesh!r} in {time.perf_counter() - start:.1f} s", flush=True)
            _, accuracy = train(mesh, os.path.join(root, "train"), os.path.join(root, "test"), args.epochs,
                                batch_size=args.batch_size, log=lambda line: print(line, flush=True))
    print(f"elapsed {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(f"test_accuracy={accuracy:.4f}")


if __name__ == "__main__":
    main()
