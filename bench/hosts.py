"""Fetch latency and controller time per eager op on a cluster whose workers are on other hosts (issue 23 item 5),
against a 1-rank mesh of the same cluster in the same run.

For the whole cluster (``--dims host=2 gpu=2``: 4 ranks) and then for a 1-rank mesh on its first worker: the fetch
(``dm.inspect`` of a 4-element tensor that lives on the mesh, from the call to the value in hand) p50 and p90 of
``--fetches`` rounds, and the controller time per ``x + x`` under ``activate()`` (``--rounds`` rounds of ``--ops``
ops: the least disturbed round and the median); then each figure of the full mesh over the 1-rank one. Dask's own
request/answer (``client.run(os.getpid)`` on one worker) is the baseline of the fetches.

On one machine, with the hosts as network namespaces (root)::

    python tests/netns_hosts.py            # 4 namespaces, stock dask scheduler/worker; runs this file in one
    python tests/netns_hosts.py --delay-ms 1   # the same, the hosts 1 ms apart (tests/delay_router.py)

Against any cluster::

    python bench/hosts.py tcp://SCHEDULER:8786 --dims host=2 gpu=2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import dask_monarch as dm
from dask_monarch.cluster import cluster_workers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from latency import _rounds  # noqa: E402  (bench/latency.py: p50/p90 of timed rounds)


def eager_op_us(mesh, rounds: int, ops: int, cpu: list | None = None) -> list[float]:
    """The controller time per ``x + x`` under ``mesh.activate()`` (microseconds), one figure per round of
    ``ops`` ops, after a warm-up; the mesh catches up between rounds. ``cpu``: a list that gets, per round, the
    CPU time of the controller's process per op (all its threads), in microseconds."""
    with mesh.activate():
        x = torch.ones(4, 4)
        for _ in range(200):
            x + x
        dm.inspect(x + x)
        per_op = []
        for _ in range(rounds):
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(ops):
                x + x
            per_op.append((time.perf_counter() - t0) / ops * 1e6)
            if cpu is not None:
                cpu.append((time.process_time() - c0) / ops * 1e6)
            mesh._session.sync("bench").result()
    return per_op


def measure(mesh, fetches: int, rounds: int, ops: int) -> dict:
    with mesh.activate():
        small = torch.ones(4) + 0
    fetch = _rounds(lambda: dm.inspect(small), fetches)
    per_op = eager_op_us(mesh, rounds, ops)
    return {"fetch": (fetch["p50"], fetch["p90"]), "op": (min(per_op), statistics.median(per_op))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scheduler")
    parser.add_argument("--dims", nargs="+", default=["host=2", "gpu=2"], help="name=size ...")
    parser.add_argument("--fetches", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ops", type=int, default=3000)
    args = parser.parse_args()
    dims = {k: int(v) for k, v in (d.split("=") for d in args.dims)}
    from distributed import Client

    with Client(args.scheduler, timeout=60, set_as_default=False) as client:
        workers = sorted(cluster_workers(client))
        run = _rounds(lambda: client.run(os.getpid, workers=[workers[0]]), args.fetches)
        run = (run["p50"], run["p90"])
        with dm.attach(client, dims=dims) as mesh:
            full = measure(mesh, args.fetches, args.rounds, args.ops)
            print(f"dashboard: {mesh.dashboard_link}", flush=True)
        first = mesh._session.workers[0]
        with dm.attach(client, dims={"w": 1}, workers=[first]) as one:
            single = measure(one, args.fetches, args.rounds, args.ops)
    ranks = 1
    for size in dims.values():
        ranks *= size
    hosts = sorted({w.split("://")[1].rsplit(":", 1)[0] for w in workers})
    print(f"cluster {args.scheduler}, workers on {len(hosts)} hosts ({', '.join(hosts)}); load "
          f"{os.getloadavg()[0]:.1f}, cores {os.cpu_count()}")
    print(f"client.run baseline          p50 {run[0]:6.2f} ms  p90 {run[1]:6.2f} ms")
    for name, r in ((f"{ranks} ranks {dims}", full), ("1 rank", single)):
        print(f"{name:28s} fetch p50 {r['fetch'][0]:6.2f} ms  p90 {r['fetch'][1]:6.2f} ms   x + x min "
              f"{r['op'][0]:6.1f} us  median {r['op'][1]:6.1f} us")
    print(f"{ranks} ranks / 1 rank: fetch p50 {full['fetch'][0] / single['fetch'][0]:.2f}x  op min "
          f"{full['op'][0] / single['op'][0]:.2f}x  op median {full['op'][1] / single['op'][1]:.2f}x")


if __name__ == "__main__":
    main()
