"""Batch inference throughput: the mesh pipeline of ``examples/batch_inference.py`` against (i) the same model
applied with ``ddf.map_partitions`` on the same Dask workers and (ii) Ray Data's ``map_batches`` on this machine
(``pip install 'dask-monarch[bench]'``; skipped with a message without ``ray``). Each a ratio of rows/s in one
run, Parquet in and Parquet out, the same model (trained on the mesh first). Also the bytes the controller
process read and wrote meanwhile (``/proc/self/io``: every file and socket; an upper bound on data through it).

    .venv/bin/python bench/batch_inference.py --repeat 200 --rounds 3
    .venv/bin/python bench/batch_inference.py --rounds 5 --epochs 3 --warmup 1 --group 1 --ahead 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import dask_monarch as dm  # noqa: E402
from batch_inference import prepare, score  # noqa: E402
import train_digits_pipe  # noqa: E402
from train_digits_pipe import FEATURES, MLP, train  # noqa: E402

import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(train_digits_pipe)  # the baselines' workers get MLP by value


def io_bytes() -> int:
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["rchar"]) + int(fields["wchar"])
    except OSError:
        return -1


def local_model(mesh, model) -> MLP:
    state = dm.fetch_shard({k: v for k, v in model.state_dict().items()}).result()
    local = MLP()
    local.load_state_dict(state)
    return local.eval()


def predict_frame(frame, model):
    import pandas as pd

    with torch.no_grad():
        x = torch.from_numpy(frame[FEATURES].to_numpy(dtype=np.float32))
        p = model(x).argmax(dim=1).numpy()
    return pd.DataFrame({"target": frame["target"].to_numpy(), "prediction": p})


def dask_baseline(client, model, data, out) -> float:
    import dask.dataframe as dd

    start = time.perf_counter()
    ddf = dd.read_parquet(data)
    meta = {"target": "int64", "prediction": "int64"}
    ddf.map_partitions(predict_frame, model, meta=meta).to_parquet(out, write_index=False, compute_kwargs={"scheduler": client})
    return time.perf_counter() - start


def ray_baseline(model, data, out, cpus: int) -> float | str:
    try:
        import ray
    except ImportError:
        return "skipped: ray is not installed (pip install 'dask-monarch[bench]')"
    if not ray.is_initialized():
        examples = os.path.dirname(os.path.abspath(train_digits_pipe.__file__))
        path = os.pathsep.join(p for p in (examples, os.environ.get("PYTHONPATH")) if p)
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})

    def batch(b):
        with torch.no_grad():
            x = torch.from_numpy(np.stack([b[c] for c in FEATURES], axis=1).astype(np.float32))
            return {"target": b["target"], "prediction": model(x).argmax(dim=1).numpy()}

    start = time.perf_counter()
    ray.data.read_parquet(data).map_batches(batch, batch_format="numpy", batch_size=8192).write_parquet(out)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=0, help="untimed rounds of each pipeline first")
    parser.add_argument("--group", type=int, default=4, help="partitions per rank per group of the mesh pipeline")
    parser.add_argument("--ahead", type=int, default=1, help="groups the mesh pipeline reads ahead")
    parser.add_argument("--batch", type=int, default=8192, help="rows per rank per scoring step of the mesh")
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        paths = prepare(root, args.repeat, files=16)
        rows = 1797 * args.repeat
        with dm.attach(dims={"dp": args.workers}) as mesh:
            model, acc = train(mesh, paths["train"], paths["test"], args.epochs, log=lambda line: None)
            local = local_model(mesh, model)
            times = {"mesh": [], "map_partitions": [], "ray": []}
            through = []
            for r in range(args.warmup):
                score(mesh, model, paths["score"], os.path.join(root, f"wm{r}"), progress=False, group=args.group,
                      ahead=args.ahead, batch=args.batch)
                dask_baseline(mesh.client, local, paths["score"], os.path.join(root, f"wd{r}"))
            for r in range(args.rounds):
                def run_mesh():
                    before = io_bytes()
                    times["mesh"].append(score(mesh, model, paths["score"], os.path.join(root, f"m{r}"),
                                               progress=False, group=args.group, ahead=args.ahead,
                                               batch=args.batch)["seconds"])
                    through.append(io_bytes() - before)

                def run_baseline():
                    times["map_partitions"].append(dask_baseline(mesh.client, local, paths["score"],
                                                                 os.path.join(root, f"d{r}")))

                for run in ((run_mesh, run_baseline) if r % 2 == 0 else (run_baseline, run_mesh)):
                    run()  # the order alternates from round to round: neither always runs first
        ray_note = None
        if not args.no_ray:
            for r in range(args.rounds):
                t = ray_baseline(local, paths["score"], os.path.join(root, f"r{r}"), args.workers)
                if isinstance(t, str):
                    ray_note = t
                    break
                times["ray"].append(t)
    data_bytes = rows * 65 * 4
    print(f"rows {rows}, workers {args.workers}, rounds {args.rounds} (after {args.warmup} untimed), "
          f"load {os.getloadavg()[0]:.1f}")
    base = statistics.median(times["mesh"])
    print(f"mesh pipeline (iter_from_dask group={args.group} ahead={args.ahead} batch={args.batch}, score, "
          f"to_dask_dataframe.to_parquet): {rows / base:,.0f} rows/s")
    for name in ("map_partitions", "ray"):
        if times[name]:
            t = statistics.median(times[name])
            print(f"{name}: {rows / t:,.0f} rows/s; mesh / {name} = {t / base:.2f}")
    paired = [b / m for m, b in zip(times["mesh"], times["map_partitions"])]
    print(f"mesh / map_partitions per round (the two run back to back): {' '.join(f'{x:.2f}' for x in paired)}; "
          f"median {statistics.median(paired):.2f}")
    if ray_note:
        print(f"ray: {ray_note}")
    print(f"controller process I/O during the mesh pipeline (median): {statistics.median(through):,} bytes "
          f"(the data: {data_bytes:,} bytes as float32)")


if __name__ == "__main__":
    main()
