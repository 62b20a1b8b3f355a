"""What a fetch costs in memory (issue 26 item 4): the peak RSS growth of the worker and of the controller while
``dm.inspect`` brings one float32 tensor of 0.25, 1 and 2 GiB from a worker, and what the controller still holds
once the fetched tensor is dropped.

Each size runs in a fresh controller process with a ``LocalCluster`` of one worker process (``memory_limit``, 8 GiB
by default, its nanny restarting it beyond that as Dask does) and answer sockets (the default path). The tensor is
made on the worker (``torch.ones``: its pages touched) before the baselines are taken; a thread samples both
processes' RSS (``psutil``) every 2 ms during the fetch. ``--baseline PATH`` runs the same measurement with the
``dask_monarch`` package of another checkout (e.g. ``/work/main``) first, in the same run, and prints the ratio
this tree / baseline.

Usage: ``python bench/fetch_memory.py [--sizes 0.25 1 2] [--baseline /work/main] [--memory-limit 8GiB]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

GIB = 2**30
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one(size_gib: float, memory_limit: str) -> dict:
    """Measure one fetch of ``size_gib`` GiB (in this process, the controller)."""
    import gc
    import threading

    import psutil
    import torch
    from distributed import Client, LocalCluster

    import dask_monarch as dm

    numel = int(size_gib * GIB) // 4
    with LocalCluster(n_workers=1, threads_per_worker=1, memory_limit=memory_limit, dashboard_address=":0",
                      silence_logs=50) as cluster, Client(cluster, set_as_default=False) as client:
        pid = next(iter(client.run(os.getpid).values()))
        worker, me = psutil.Process(pid), psutil.Process()
        error = None
        mesh = dm.attach(client, dims={"dp": 1}, comm_timeout=300)
        try:
            with mesh.activate():
                x = torch.ones(numel)
            dm.inspect(x[:1])  # the tensor exists on the worker, and the sockets are warm
            gc.collect()
            time.sleep(0.5)
            base_w, base_c = worker.memory_info().rss, me.memory_info().rss
            peaks = [base_w, base_c]
            stop = threading.Event()

            def sample():
                while not stop.is_set():
                    try:
                        peaks[0] = max(peaks[0], worker.memory_info().rss)
                    except psutil.Error:
                        pass
                    peaks[1] = max(peaks[1], me.memory_info().rss)
                    time.sleep(0.002)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            start = time.monotonic()
            try:
                t = dm.fetch_shard(x).result(timeout=600)
                assert t.shape == (numel,) and t[0].item() == 1.0 and t[-1].item() == 1.0
            except Exception as e:
                t, error = None, f"{type(e).__name__}: {str(e)[:200]}"
            seconds = time.monotonic() - start
            stop.set()
            sampler.join()
            del t
            gc.collect()
            time.sleep(0.5)
            kept = me.memory_info().rss - base_c
            try:
                kept_w = worker.memory_info().rss - base_w
            except psutil.Error:
                kept_w = float("nan")
        finally:
            try:
                mesh.exit()
            except Exception as e:  # a failed session (the worker restarted) raises its error here
                error = error or f"{type(e).__name__}: {str(e)[:200]}"
    return {"size_gib": size_gib, "worker_peak_gib": (peaks[0] - base_w) / GIB,
            "controller_peak_gib": (peaks[1] - base_c) / GIB, "controller_kept_gib": kept / GIB,
            "worker_kept_gib": kept_w / GIB, "seconds": seconds, "error": error}


def _run(tree: str, size: float, memory_limit: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", str(size), "--memory-limit",
                           memory_limit], env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"size_gib": size, "error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.25, 1.0, 2.0], help="GiB fetched")
    parser.add_argument("--baseline", help="a checkout whose dask_monarch is measured first (e.g. /work/main)")
    parser.add_argument("--memory-limit", default="8GiB", help="the worker's Dask memory limit")
    parser.add_argument("--one", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(_one(args.one, args.memory_limit)), flush=True)
        return
    trees = ([("baseline", os.path.abspath(args.baseline))] if args.baseline else []) + [("this tree", HERE)]
    print(f"peak RSS growth during one dm.inspect of a float32 tensor; worker memory_limit {args.memory_limit}")
    print(f"{'GiB':>5} {'tree':>10} {'worker peak':>12} {'/GiB':>6} {'ctrl peak':>10} {'/GiB':>6} "
          f"{'ctrl kept':>10} {'s':>6}  error")
    results = {}
    for size in args.sizes:
        for name, tree in trees:
            r = results[size, name] = _run(tree, size, args.memory_limit)
            if "worker_peak_gib" not in r:
                print(f"{size:5.2f} {name:>10}  failed: {r['error']}", flush=True)
                continue
            print(f"{size:5.2f} {name:>10} {r['worker_peak_gib']:10.2f} G {r['worker_peak_gib'] / size:6.2f} "
                  f"{r['controller_peak_gib']:8.2f} G {r['controller_peak_gib'] / size:6.2f} "
                  f"{r['controller_kept_gib']:8.2f} G {r['seconds']:6.2f}  {r['error'] or ''}", flush=True)
        base, new = results.get((size, "baseline")), results.get((size, "this tree"))
        if base and new and "worker_peak_gib" in base and "worker_peak_gib" in new and not base["error"]:
            print(f"{size:5.2f} {'ratio':>10} {new['worker_peak_gib'] / base['worker_peak_gib']:10.2f}x "
                  f"{'':6} {new['controller_peak_gib'] / base['controller_peak_gib']:8.2f}x  (this tree / baseline)",
                  flush=True)


if __name__ == "__main__":
    main()
