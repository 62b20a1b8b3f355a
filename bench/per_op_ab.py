"""A/B of the controller's per-op time: ``bench/per_op_min.py`` run alternately against two checkouts of
dask_monarch in one session of this script (the same machine, the same load), and the medians of each side.

Each run is a fresh process, ``PYTHONPATH=<tree>[:$PYTHONPATH] python bench/per_op_min.py <label>`` (this file's
``per_op_min.py`` for both sides, so only the library differs), whose line gives, in microseconds, the least
disturbed and the median of 9 rounds of 5,000 calls of (b) ``remote(aten.add)`` and (d) ``x + x`` under
``activate()`` on a 1-worker cluster, and the controller process's CPU time per call (median of the rounds). This prints every run's line, then per side the median over runs of each
figure, and the ratio B/A.

Usage::

    python bench/per_op_ab.py A_TREE B_TREE [--runs 5]   # e.g. a worktree of main, and this one
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

_BENCH = Path(__file__).with_name("per_op_min.py")
_LINE = re.compile(r"\(b\) min ([\d.]+) median ([\d.]+) us\s+\(d\) min ([\d.]+) median ([\d.]+) us\s+"
                   r"cpu \(b\) ([\d.]+) \(d\) ([\d.]+) us")
_FIELDS = ("(b) min", "(b) median", "(d) min", "(d) median", "(b) cpu", "(d) cpu")


def run_once(tree: str, label: str) -> tuple:
    """One run of ``per_op_min.py`` with dask_monarch from ``tree``: its four figures (us) and its output line."""
    path = os.pathsep.join(filter(None, (os.path.abspath(tree), os.environ.get("PYTHONPATH"))))
    env = dict(os.environ, PYTHONPATH=path)
    out = subprocess.run([sys.executable, str(_BENCH), label], env=env, cwd=tree, capture_output=True, text=True,
                         timeout=600)
    match = _LINE.search(out.stdout)
    if out.returncode != 0 or match is None:
        raise RuntimeError(f"per_op_min.py against {tree} failed (rc {out.returncode}):\n{out.stdout}\n{out.stderr}")
    return tuple(float(v) for v in match.groups()), out.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="checkout A (the baseline)")
    parser.add_argument("b", help="checkout B")
    parser.add_argument("--runs", type=int, default=5, help="runs of each, alternating (default 5)")
    args = parser.parse_args()
    figures: dict = {"A": [], "B": []}
    for i in range(args.runs):
        for side, tree in (("A", args.a), ("B", args.b)):
            values, line = run_once(tree, f"{side}{i}")
            figures[side].append(values)
            print(line, flush=True)
    medians = {side: [statistics.median(run[k] for run in runs) for k in range(len(_FIELDS))] for side, runs in figures.items()}
    for side, tree in (("A", args.a), ("B", args.b)):
        print(f"{side} ({tree}): " + "  ".join(f"{name} {v:.1f}" for name, v in zip(_FIELDS, medians[side])) + " us")
    print("B/A: " + "  ".join(f"{name} {b / a:.2f}" for name, a, b in zip(_FIELDS, medians["A"], medians["B"])))


if __name__ == "__main__":
    main()
