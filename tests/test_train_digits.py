"""End-to-end runs of examples/train_digits.py as a user runs it: a subprocess, 2 workers, real digits data.

The last line of its output must be ``test_accuracy=0.XXXX`` with a value of at least 0.95; the per-epoch progress
bar goes to stderr, only when asked for (or on a terminal).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from conftest import stop_processes


ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_digits.py"
LAST_LINE = re.compile(r"test_accuracy=(\d\.\d{4})")


def run_example(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


def check_accuracy(stdout: str) -> None:
    lines = stdout.strip().splitlines()
    assert lines, "the example printed nothing"
    match = LAST_LINE.fullmatch(lines[-1])
    assert match, f"last line is {lines[-1]!r}, expected test_accuracy=0.XXXX\nstdout:\n{stdout}"
    assert float(match.group(1)) >= 0.95, stdout
    assert any(line.startswith("epoch ") for line in lines), "no per-epoch progress line"


def test_train_digits_embedded_cluster():
    """With ``--progress``: a progress bar per epoch on stderr, stdout unchanged."""
    proc = run_example("--workers", "2", "--progress")
    check_accuracy(proc.stdout)
    bar = proc.stderr.replace("\r", "\n")
    assert re.search(r"training: +100%.*\b15/15 ", bar), f"no finished per-epoch progress bar on stderr:\n{bar[-2000:]}"
    assert "training" not in proc.stdout


def test_train_digits_existing_cluster(tmp_path):
    """``--scheduler``: workers started with ``dask worker`` in another directory, without the example on their
    import path (the remote functions travel by value)."""
    scheduler_file = tmp_path / "scheduler.json"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
         "--dashboard-address", ":0", "--scheduler-file", str(scheduler_file)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )]
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert scheduler_file.exists(), "dask scheduler did not start"
        time.sleep(0.2)  # let it finish writing
        address = json.loads(scheduler_file.read_text())["address"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        for _ in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1",
                 "--dashboard-address", ":0"],
                cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
        proc = run_example("--scheduler", address, "--workers", "2")
        check_accuracy(proc.stdout)
        assert "training:" not in proc.stderr, "a progress bar although stderr is not a terminal"
    finally:
        stop_processes(procs)  # the workers first, then the scheduler


def test_train_digits_compiled():
    """``--compile``: the training step is a ``dm.compile``d function whose later calls replay one recording; it
    trains to the same bar."""
    proc = run_example("--workers", "2", "--compile")
    check_accuracy(proc.stdout)
