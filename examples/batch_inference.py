"""Batch inference on a mesh: Parquet in, predictions out, no row through the controller (issue 15).

scikit-learn's digits, repeated to a few hundred thousand rows, are written to Parquet and read with
``dask.dataframe.read_parquet``; ``dm.iter_from_dask`` makes them, a few partitions per rank at a time, tensors
sharded over the mesh's "dp" ranks (each rank's block assembled on its own worker, the next group read while the
mesh scores this one); the digits MLP (trained here first, from a pipe:
``train_digits_pipe.py``) scores every row on the mesh, with a progress bar; ``dm.to_dask_dataframe`` makes the
predictions a Dask DataFrame whose partitions stay on the workers, and ``to_parquet`` writes them from there.
Run it::

    python examples/batch_inference.py                    # an embedded local cluster of 2 workers
    python examples/batch_inference.py --repeat 200 --batch 8192 --group 4 --ahead 1

The last line printed is ``accuracy=0.XXXX`` (the predictions read back from the written Parquet files).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import deque

import torch
from distributed import wait

import dask_monarch as dm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits_pipe import FEATURES, N_TEST, digits_frame, train, write_parquet  # noqa: E402


def score(mesh, model, data_path: str, out_path: str, batch: int = 8192, progress: bool | None = None,
          group: int = 4, ahead: int = 1) -> dict:
    """Read ``data_path`` (Parquet: ``p0``..``p63``, ``target``), score every row with ``model`` on ``mesh``,
    write ``target`` and ``prediction`` to ``out_path`` (Parquet, from the workers). Returns the row count, the
    accuracy counted on the mesh and the seconds taken.

    The partitions come in ``group`` per rank at a time (``dm.iter_from_dask``, which reads ``ahead`` groups ahead
    on the workers): the controller sends a group's scoring and its write without waiting for them, so the
    workers read and convert the next group (Dask's threads) while the mesh scores this one (the streams'
    threads), and write it once scored. A group whose rows do not split evenly over the ranks is padded with
    rows of -1 (``pad=-1``), which no digit's target is: they count neither in the rows nor in the accuracy (only
    the progress bar counts them), and are filtered out before writing."""
    import dask.dataframe as dd

    start = time.perf_counter()
    ddf = dd.read_parquet(data_path)
    ranks = mesh.size("dp")
    bar = _bar(progress)
    marks, writes = deque(), []
    groups = dm.iter_from_dask(ddf, mesh, partitions=group, ahead=ahead, columns=FEATURES + ["target"],
                               dtype=torch.float32, pad=-1)
    with torch.no_grad():
        with mesh.activate():
            correct = torch.zeros((), dtype=torch.int64)  # hits so far, per rank
            scored = torch.zeros((), dtype=torch.int64)   # rows so far, per rank (padding left out)
        for rows in groups:  # this group's rows, one float32 block per rank, read where they are scored
            n = rows.shape[0]
            with mesh.activate():
                predictions, starts, marked = [], range(0, n, batch), 0
                every = -(-len(starts) // 4)  # a progress mark per quarter of the group
                for i, lo in enumerate(starts):
                    x, y = rows[lo:lo + batch, :64], rows[lo:lo + batch, 64].long()
                    p = model(x).argmax(dim=1)
                    predictions.append(torch.stack([y, p], dim=1))
                    correct = correct + (p == y).sum()
                    if (i + 1) % every == 0 or i + 1 == len(starts):
                        # not waited for here: the fetch answers once these slices are done on every rank
                        end = min(lo + batch, n)
                        marks.append((dm.fetch_shard(correct), (end - marked) * ranks))
                        marked = end
                scored = scored + (rows[:, 64] >= 0).sum()
            # the snapshot comes next in the mesh's order; Dask writes it once the mesh has scored the group
            writes.append(_write(torch.cat(predictions), out_path, len(writes)))
            _advance(bar, marks, n * ranks, wait=False)
        with mesh.activate():
            totals = torch.stack([correct, scored]).reduce("dp", "sum")
    _advance(bar, marks, 0, wait=True)
    correct, total = (int(v) for v in dm.fetch_shard(totals).result())
    if bar is not None:
        bar.close()
    wait(writes, timeout=300.0)
    for w in writes:
        w.result()  # raises a write's error
    return {"rows": total, "accuracy": correct / total, "seconds": time.perf_counter() - start}


def _write(predictions, out_path: str, group: int):
    """Start writing a group's predictions (their padding left out) to Parquet files ``part.<group>.<i>.parquet``
    under ``out_path``, from the workers holding them; returns the Dask future of the write. Its tasks wait for
    their snapshots without holding a Dask thread (``to_dask``), so the next group's reading goes on meanwhile."""
    frame = dm.to_dask_dataframe(predictions, columns=["target", "prediction"])
    frame = frame[frame["target"] >= 0]
    write = frame.to_parquet(out_path, write_index=False, compute=False, write_metadata_file=False,
                             name_function=lambda i: f"part.{group}.{i}.parquet")
    # optimized here: Client.compute leaves the filter and the writer as tasks of their own (five per partition)
    return predictions.mesh.client.compute(write.optimize())


def _advance(bar, marks: deque, more: int, wait: bool) -> None:
    """Move the progress bar past the slices whose fetch answered (all of them, waiting, with ``wait``); its
    total grows by ``more`` rows (a group just sent)."""
    if bar is not None and more:
        bar.total += more
        bar.refresh()
    while marks and (wait or marks[0][0].done()):
        mark, rows = marks.popleft()
        mark.result()  # this slice is done on every rank
        if bar is not None:
            bar.update(rows)


def _bar(enabled: bool | None):
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=0, desc="scoring", unit="row", unit_scale=True, file=sys.stderr, dynamic_ncols=True)


def prepare(root: str, repeat: int, files: int) -> dict:
    """Write the training, test and scoring sets as Parquet under ``root``; returns their paths."""
    frame = digits_frame()
    paths = {name: os.path.join(root, name) for name in ("train", "test", "score", "predictions")}
    write_parquet(frame.iloc[N_TEST:], paths["train"], files=4)
    write_parquet(frame.iloc[:N_TEST], paths["test"], files=2)
    write_parquet(digits_frame(repeat), paths["score"], files=files)
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheduler", default=None, help="an existing Dask scheduler (default: embedded cluster)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=200, help="copies of the 1797 digits to score")
    parser.add_argument("--files", type=int, default=16, help="Parquet files of the scoring set")
    parser.add_argument("--batch", type=int, default=8192, help="rows per rank per scoring step")
    parser.add_argument("--group", type=int, default=4, help="partitions per rank per from_dask")
    parser.add_argument("--ahead", type=int, default=1, help="groups read ahead on the workers")
    parser.add_argument("--epochs", type=int, default=10, help="training epochs before scoring")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        paths = prepare(root, args.repeat, args.files)
        with dm.attach(args.scheduler, dims={"dp": args.workers}) as mesh:
            model, test_accuracy = train(mesh, paths["train"], paths["test"], args.epochs,
                                         log=lambda line: print(line, flush=True))
            print(f"trained: test_accuracy={test_accuracy:.4f}", flush=True)
            result = score(mesh, model, paths["score"], paths["predictions"], args.batch, args.progress, args.group,
                           args.ahead)
            print(f"scored {result['rows']} rows in {result['seconds']:.1f} s "
                  f"({result['rows'] / result['seconds']:,.0f} rows/s), accuracy on the mesh "
                  f"{result['accuracy']:.4f}", flush=True)
        import pandas as pd

        written = pd.read_parquet(paths["predictions"])
        accuracy = float((written["target"] == written["prediction"]).mean())
        print(f"{len(written)} predictions written to Parquet")
    print(f"accuracy={accuracy:.4f}")


if __name__ == "__main__":
    main()
