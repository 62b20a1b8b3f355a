"""Round-trip latency of the controller's waits (issue 13 item 1): how long a program waits for a small answer.

(h) ``dm.inspect`` of a 4-element tensor that lives on the mesh, and (i) ``dm.fetch_shard(...).result()`` of it,
    each timed from the call to the value in hand, for a 1-rank and a 2-rank mesh; (j) ``mesh._session.sync(...)``
    (a ``RequestStatus`` on every rank and its answers). p50 and p90 of ``n`` rounds after a warm-up, each against
    the target of 1 ms p50. The baseline measured in the same run: Dask's ``client.run`` of ``os.getpid`` on one
    worker (Dask's own request/answer with a worker: client -> scheduler -> worker and back, no task).

Usage: imported by ``bench/dispatch.py``; ``python bench/latency.py [--scheduler ADDR] [-n N]`` alone;
``--answer-channel both --repeat 3`` times the answer sockets and the comm channel alone alternately in one run and
prints the ratio socket / comm.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import dask_monarch as dm
from dask_monarch.cluster import cluster_workers

TARGET_MS = 1.0


def _percentiles(seconds: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in seconds)
    return {"p50": statistics.median(ms), "p90": ms[min(len(ms) - 1, int(0.9 * len(ms)))], "n": len(ms)}


def _rounds(fn, n: int, warmup: int = 20) -> dict:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return _percentiles(times)


def bench_mesh(mesh, n: int) -> dict:
    """The three waits on ``mesh`` (any size): p50/p90 in ms of ``n`` rounds each."""
    with mesh.activate():
        t = torch.arange(4.0) + 1
    expected = torch.arange(4.0) + 1
    assert torch.equal(dm.inspect(t), expected), "the mesh computed a different value"
    session = mesh._session
    return {
        "inspect": _rounds(lambda: dm.inspect(t), n),
        "fetch_shard": _rounds(lambda: dm.fetch_shard(t).result(), n),
        "sync": _rounds(lambda: session.sync("latency").result(), n),
    }


def bench_baseline(client, n: int) -> dict:
    """Dask's ``client.run`` of ``os.getpid`` on one worker, the same way timed."""
    worker = sorted(cluster_workers(client))[0]
    return _rounds(lambda: client.run(os.getpid, workers=[worker]), n)


def bench_all(client, n: int = 200, answer_channel=None) -> dict:
    """Every case; ``answer_channel`` as ``attach``'s (default: Dask config ``monarch.answer-channel``)."""
    client.wait_for_workers(2, timeout=120)
    options = {} if answer_channel is None else {"answer_channel": answer_channel}
    figures = {"baseline": bench_baseline(client, n)}
    with dm.attach(client, dims={"w": 1}, **options) as one:
        figures[1] = bench_mesh(one, n)
    with dm.attach(client, dims={"dp": 2}, **options) as two:
        figures[2] = bench_mesh(two, n)
    return figures


def rows(figures: dict) -> list[tuple[str, str, str, str]]:
    """Rows for ``bench/dispatch.py``'s table: (label, through the mesh, baseline, ratio p50 / baseline p50)."""
    base = figures["baseline"]
    out = [("(h) fetch round trip, p50 / p90 (ms)", "", "", "")]
    for ranks in (1, 2):
        for name in ("inspect", "fetch_shard", "sync"):
            f = figures[ranks][name]
            verdict = "MET" if f["p50"] <= TARGET_MS else "NOT MET"
            out.append((f"    {name}, {ranks} rank{'s' if ranks > 1 else ''}",
                        f"{f['p50']:>7.2f} / {f['p90']:<6.2f}  {verdict:<7}",
                        f"{base['p50']:>8.2f} / {base['p90']:<6.2f}", f"{f['p50'] / base['p50']:.2f}"))
    out.append((f"    target p50 <= {TARGET_MS:g} ms; baseline: client.run(os.getpid) on one worker", "", "", ""))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheduler", default=None, help="address of an existing cluster (default: embedded)")
    parser.add_argument("-n", type=int, default=200, help="rounds per case (default 200)")
    parser.add_argument("--answer-channel", choices=["socket", "comm", "both"], default=None,
                        help="the answer channel's path (default: Dask config monarch.answer-channel, else socket); "
                             "both: the two alternately, --repeat times each, in one run")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each path with --answer-channel both")
    args = parser.parse_args(argv)
    from distributed import Client

    from dask_monarch.cluster import start_local_cluster

    cluster = None
    if args.scheduler:
        client = Client(args.scheduler, set_as_default=False)
    else:
        cluster = start_local_cluster(2, silence_logs=40)
        client = Client(cluster, set_as_default=False)
    paths = ["socket", "comm"] * args.repeat if args.answer_channel == "both" else [args.answer_channel]
    runs = []
    try:
        for path in paths:
            runs.append((path, bench_all(client, args.n, path), os.getloadavg()[0]))
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    for path, figures, load in runs:
        print(f"\ndask_monarch latency ({os.cpu_count()} cores; load average {load:.1f}; {args.n} rounds; "
              f"answer channel: {path or 'default'})")
        print(f"{'case':<44}{'through the mesh':>22}{'baseline':>18}{'ratio':>8}")
        for label, value, base, ratio in rows(figures):
            print(f"{label:<44}{value:>22}{base:>18}{ratio:>8}" if value else label)
    if args.answer_channel == "both":
        print("\nratio socket / comm of the p50s (median over the runs):")
        for ranks in (1, 2):
            for name in ("inspect", "fetch_shard", "sync"):
                ratio = [f[ranks][name]["p50"] for p, f, _ in runs if p == "socket"]
                base = [f[ranks][name]["p50"] for p, f, _ in runs if p == "comm"]
                print(f"    {name}, {ranks} rank{'s' if ranks > 1 else ''}: "
                      f"{statistics.median(ratio) / statistics.median(base):.2f}")


if __name__ == "__main__":
    main()
