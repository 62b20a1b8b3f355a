"""End-to-end runs of examples/pipeline_parallel.py and examples/tensor_parallel.py as a user runs them: a
subprocess, an embedded cluster of 4 workers, real digits data (issue 16). The last line must be
``test_accuracy=0.XXXX`` with a value of at least 0.95."""

from __future__ import annotations

import re
import subprocess
import sys

from test_train_digits import ROOT, check_accuracy


def run(script: str, *args: str, timeout: float = 400) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_pipeline_parallel_compiled_reaches_the_digits_bar():
    """pp=2 x dp=2, 2 micro-batches per step, activations and their gradients moved with to_mesh; the step
    compiled (run eagerly, the same schedule printed the same losses in 3-epoch runs, in about 6 times the time)."""
    out = run("pipeline_parallel.py", "--compile")
    check_accuracy(out)
    assert "dp=2, pp=2" in out


def test_tensor_parallel_reaches_the_digits_bar_and_matches_the_whole_layer():
    out = run("tensor_parallel.py")
    check_accuracy(out)
    diff = float(re.search(r"max \|logit difference\| = (\S+)", out).group(1))
    assert diff < 1e-5, out
