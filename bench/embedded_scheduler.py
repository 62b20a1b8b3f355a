"""The embedded default's eager op cost with its scheduler in the controller's process (as before issue 23 item 4:
``start_local_cluster(..., scheduler_process=False)``) and in a process of its own (now), in one run: the
controller time per ``x + x`` under ``activate()`` on a 1-rank mesh, 9 rounds of 5,000 ops each, the least
disturbed round (min) and the median, in microseconds, and the CPU time of the controller's process per op (all
its threads: with the scheduler in it, the scheduler's work too; less disturbed by other processes on a loaded
machine than the wall time); and the ratio of the two. The clusters alternate
(in-process, own process, in-process, own process) so that a change in the machine's load falls on both.

Usage::

    python bench/embedded_scheduler.py [--ranks 1] [--rounds 9] [--ops 5000] [--repeat 2]
"""
import argparse
import os
import statistics
import sys

from distributed import Client

import dask_monarch as dm
from dask_monarch.cluster import start_local_cluster

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hosts import eager_op_us  # noqa: E402  (bench/hosts.py)


def measure(scheduler_process: bool, ranks: int, rounds: int, ops: int, cpu: list) -> list[float]:
    cluster = start_local_cluster(ranks, silence_logs=40, scheduler_process=scheduler_process)
    client = Client(cluster, set_as_default=False)
    try:
        with dm.attach(client, dims={"w": ranks}) as mesh:
            return eager_op_us(mesh, rounds, ops, cpu)
    finally:
        client.close()
        cluster.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--ops", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=2, help="how many times each cluster is started, alternately")
    args = parser.parse_args()
    results = {False: [], True: []}
    cpu = {False: [], True: []}
    for scheduler_process in (False, True) * args.repeat:
        results[scheduler_process] += measure(scheduler_process, args.ranks, args.rounds, args.ops,
                                              cpu[scheduler_process])
    names = {False: "scheduler in the controller's process", True: "scheduler in its own process"}
    for key in (False, True):
        r, c = results[key], cpu[key]
        print(f"{names[key]:40s} x + x: min {min(r):6.1f} us  median {statistics.median(r):6.1f} us;  controller "
              f"process CPU per op: min {min(c):6.1f} us  median {statistics.median(c):6.1f} us  "
              f"({len(r)} rounds of {args.ops})")
    print(f"own process / in-process: min {min(results[True]) / min(results[False]):.2f}x  median "
          f"{statistics.median(results[True]) / statistics.median(results[False]):.2f}x;  CPU min "
          f"{min(cpu[True]) / min(cpu[False]):.2f}x  median {statistics.median(cpu[True]) / statistics.median(cpu[False]):.2f}x"
          f"  ranks {args.ranks}  load {os.getloadavg()[0]:.1f}  cores {os.cpu_count()}")


if __name__ == "__main__":
    main()
