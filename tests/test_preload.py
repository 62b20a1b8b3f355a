"""``dask worker --preload dask_monarch`` (Dask's preload, ``dask_monarch.dask_setup``): every worker imports
dask_monarch and torch as it starts, so the first ``attach`` finds them imported instead of waiting for every
worker's import (docs/clusters.md; on the 16-core host the cold attach of 64 workers was that import)."""

from __future__ import annotations

import sys

import distributed
import torch

import dask_monarch as dm
from conftest import _cli_cluster


def test_workers_started_with_the_preload_have_torch_before_the_first_attach(tmp_path):
    preload = ("--preload", "dask_monarch")
    for address, _ in _cli_cluster(tmp_path, [preload, preload]):
        with distributed.Client(address, timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
            assert set(map(tuple, client.run(lambda: [m for m in ("torch", "dask_monarch") if m in sys.modules]).values())) == {("torch", "dask_monarch")}
            mesh = dm.attach(client, dims={"dp": 2})
            try:
                x = torch.arange(4.0)
                with mesh.activate():
                    y = x * 2 + 1
                assert torch.equal(dm.inspect(y, dp=1), torch.arange(4.0) * 2 + 1)
            finally:
                mesh.exit()
