"""Eager cases of ``bench/dispatch.py`` alone, in one process: (b) controller time per ``remote(aten.add)`` call,
(d) per torch op (``x + x``) under ``activate()``, (e) the 2048-iteration chain end to end, (c) the digits train
step (controller time per step and steps/s), with the full run's counts (10,000 calls, 100 steps, median of 3).

Usage::

    python bench/eager.py [label]    # one line: the figures, the label and the load average
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import dask_monarch as dm

# run_path, not import: the bench's functions (small_tensor) then travel to the workers by value, as when
# dispatch.py runs as __main__ (the workers cannot import bench/)
_bench = runpy.run_path(str(Path(__file__).with_name("dispatch.py")), run_name="dispatch_bench")
bench_dispatch, bench_program, bench_remote, bench_train_step = (
    _bench[name] for name in ("bench_dispatch", "bench_program", "bench_remote", "bench_train_step"))


def main(label: str = "") -> None:
    from distributed import Client

    from dask_monarch.cluster import start_local_cluster

    cluster = start_local_cluster(2, silence_logs=40)
    client = Client(cluster, set_as_default=False)
    try:
        with dm.attach(client, dims={"w": 1}) as one:
            rem = bench_remote(one, 10_000, 3)
            disp = bench_dispatch(one, 10_000, 3)
            prog = bench_program(one, 2048, 3)
        with dm.attach(client, dims={"dp": 2}) as two:
            step = bench_train_step(two, 100, 3)
    finally:
        client.close()
        cluster.close()
    print(f"{label}: (b) {rem['call_us']:.1f} us/call  (d) {disp['call_us']:.1f} us/op  (e) {prog['seconds']:.3f} s  "
          f"(c) {step['loop_ms']:.2f} ms/step, {step['rate']:.1f} step/s  load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
