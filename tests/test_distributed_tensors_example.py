"""examples/distributed_tensors.py, Monarch's tutorial told again for dask_monarch (issue 24), run as a user runs it:
``python examples/distributed_tensors.py``, a subprocess on the embedded default cluster of 4 CPU workers. Every
cell must run (the last line is ``all cells ran``) and show what it teaches."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_tutorial_runs_every_cell():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "distributed_tensors.py")], capture_output=True,
                          text=True, timeout=500, cwd=ROOT)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{out[-4000:]}\nstderr:\n{err[-4000:]}"
    assert out.rstrip().splitlines()[-1] == "all cells ran"
    assert out.startswith("gpu | 0 ")  # the first cell's mesh.to_table()
    assert "host \\ gpu" in out and "pp \\ tp" in out and "dp=0" in out  # the reshaped meshes' tables
    # a failed command comes back as an error naming the allocation, and the mesh goes on
    assert "DefaultCPUAllocator: can't allocate memory" in err and "RECOVERED!" in out
    assert re.search(r"^\d+ GiB can be reserved on every rank; \d+ GiB cannot \(RemoteException\)$", out, re.MULTILINE)
    # the all-reduce: rank 0's and rank 1's tables of r are the same
    tables = re.findall(r"rank \d \(gpu=\d\): float32 \[3, 4\]\n((?:.*\n){5})", out)
    assert len(tables) >= 6 and tables[4] == tables[5], tables
    assert out.count("DDP step done; replicas hold the same parameters: True") == 3
