"""Cases (b) and (d) of ``bench/dispatch.py`` with their loops as there, 9 rounds of 5,000 calls on a 1-worker
cluster: the controller time per ``remote(aten.add)`` call and per ``x + x`` under ``activate()``, the least
disturbed round (min) and the median, in microseconds. On a shared machine the min is the cost and the rest is
interference.

Usage::

    python bench/per_op_min.py [label]
"""
import os
import statistics
import sys
import time

import torch
from distributed import Client

import dask_monarch as dm
from dask_monarch.cluster import start_local_cluster


def small(mesh):
    return torch.ones(4)


cluster = start_local_cluster(1, silence_logs=40)
client = Client(cluster, set_as_default=False)
N, R = 5000, 9
try:
    with dm.attach(client, dims={"w": 1}) as one:
        add = dm.remote(torch.ops.aten.add.Tensor)
        a, b = dm.remote(small)(one), dm.remote(small)(one)
        for _ in range(200):
            add(a, b)
        dm.inspect(add(a, b))
        rb, cb = [], []
        for _ in range(R):
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(N):
                add(a, b)
            rb.append((time.perf_counter() - t0) / N * 1e6)
            cb.append((time.process_time() - c0) / N * 1e6)
            one._session.sync("b").result()
        rd, cd = [], []
        with one.activate():
            x = torch.ones(4, 4)
            for _ in range(200):
                x + x
            dm.inspect(x + x)
            for _ in range(R):
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(N):
                    x + x
                rd.append((time.perf_counter() - t0) / N * 1e6)
                cd.append((time.process_time() - c0) / N * 1e6)
                one._session.sync("d").result()
finally:
    client.close()
    cluster.close()
print(f"{sys.argv[1] if len(sys.argv) > 1 else ''}: (b) min {min(rb):.1f} median {statistics.median(rb):.1f} us  (d) min {min(rd):.1f} median "
      f"{statistics.median(rd):.1f} us  cpu (b) {statistics.median(cb):.1f} (d) {statistics.median(cd):.1f} us  "
      f"load {os.getloadavg()[0]:.1f}", flush=True)
