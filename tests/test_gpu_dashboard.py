"""On a GPU worker the dashboard's memory history is the CUDA memory allocated on the worker's device (issue 18),
labelled so (issue 25 item 6): a session holding 64 MiB on the GPU shows a point of at least that in its ``held``
series, the rank's device is ``cuda:0``, and the table and the plot's title say CUDA memory. One GPU; skipped without CUDA. Run: ``pytest -m gpu tests/test_gpu_dashboard.py``."""

from __future__ import annotations

import time

import pytest
import torch

import dask_monarch as dm
from dask_monarch.controller.task_keys import session_tag

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ELEMENTS = 16 * 2**20  # 64 MiB of float32


def test_memory_history_shows_cuda_memory_allocated():
    from distributed import Client, LocalCluster

    from dask_monarch.dashboard.data import memory_title, select
    from dask_monarch.dashboard.install import read_scheduler

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0",
                      silence_logs=40) as cluster, Client(cluster) as client:
        client.wait_for_workers(1, timeout=120)
        mesh = dm.attach(client, dims={"gpu": 1}, comm_timeout=120)
        tag = session_tag(mesh.session_id)

        def view(dask_scheduler):
            plugin = dask_scheduler.plugins["dask-monarch"]
            v = select(plugin.dashboard.update(*read_scheduler(dask_scheduler), time.time()), tag)
            return {"held": v["held"]["ys"], "device": v["ranks"]["device"], "memory": v["ranks"]["bytes_text"]}

        try:
            with mesh.activate():
                x = torch.ones(ELEMENTS, device="cuda")
            assert dm.inspect(x[:2]).tolist() == [1.0, 1.0]
            deadline = time.monotonic() + 60
            while True:
                seen = client.run_on_scheduler(view)
                if seen["held"] and max(seen["held"][0], default=0) >= ELEMENTS * 4:
                    break
                assert time.monotonic() < deadline, f"no CUDA memory in the held series: {seen}"
                time.sleep(0.5)
            assert seen["device"][0].startswith("cuda"), seen["device"]
            # labelled by what it measures (issue 25 item 6): CUDA memory, in the table and the plot's title
            assert seen["memory"][0].endswith(" CUDA"), seen["memory"]
            assert memory_title(seen["device"]).startswith("CUDA memory allocated"), memory_title(seen["device"])
        finally:
            mesh.exit()
