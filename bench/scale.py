"""How the controller's costs grow with the mesh (issue 23 item 7): for each rank count N, a stock CLI cluster
(``dask scheduler``, ``dask worker --nworkers N --nthreads 1``, loopback only) and the public API only:

* ``fetch``: p50 and p90 of ``dm.inspect`` of a 4-element tensor (ms), one after another: the ranks other than the
  fetched one have passed everything they were sent, and their host's relay answers the fetch's barrier for them
  (``worker/relay.py``, "Quiet ranks");
* ``step fetch``: p50 of ``dm.inspect(y)`` right after ``y = x + x`` under ``mesh.activate()`` (ms; the op is
  buffered, so the fetch's flush carries it): every rank has work, and each answers the barrier itself, as in a
  training step that fetches its loss;
* ``op``: controller time per eager op, ``x + x`` under ``mesh.activate()`` (us: the loop's wall time over its ops,
  the sync after it not counted);
* ``op CPU``: the program thread's own CPU time per eager op over the same loops (us, ``time.thread_time``): what
  the controller spends, without the time the other processes (the workers running those ops) take the cores from
  it, which the ``op`` column includes where the cores are fewer than the processes;
* ``compiled``: controller time per call of a compiled 8-op function (``dm.compile``; us: the calls' wall time over
  their number, the sync after them not counted);
* ``sched CPU``: the scheduler process's CPU time (``psutil``) over ``--cpu-seconds`` (default 4) of eager ops
  (``x + x`` under ``activate()``, then one sync) per mesh, after the rounds, over the same wall time, in %. A
  round's op loop (3000 ops in 4 rounds: about 20 ms) is far shorter than the clock tick the CPU time is counted
  in (10 ms) and than the wait of the loop's batch task copies (``task_interval`` times the ranks: 0.4 s at 8
  ranks, 3.2 s at 64), so over those loops the column read 0 or -0;
* ``attach``: seconds of ``dm.attach(client, dims={"dp": N})`` on warm workers (the first attach, which imports
  dask_monarch and torch on every worker, is printed on its own).

One cluster of the largest N workers; a mesh of N ranks is attached on its first N workers, all meshes at once,
and they are measured in turn, round by round, so that each sees the same load (a shared 2-core machine's load
changes by the minute). Each figure is printed with its ratio against the smallest mesh's of the same setting.
``--answer-tree both`` measures the host relays off and on side by side (Dask config ``monarch.answer-tree``), and
``--relay-fanout 8,64`` the relays with each of those ``monarch.relay-fanout`` values side by side (64 ranks on one
host: sub-relays of 8 ranks under the host's relay, against one relay of all 64).

``--controller-cores K`` runs the controller (this program) and the scheduler on the first K physical cores and
the workers on the rest (CPU affinity, inherited by every process the workers start), as on a cluster whose ranks
are other machines: on one host where the workers' threads outnumber the cores, they take cores (and hardware
threads of the same core) from the controller's thread, which the ``op`` and ``op CPU`` columns then include.

Usage: ``python bench/scale.py [--ranks 1,2,4,8] [--fetches 300] [--ops 10000] [--rounds 10]
[--answer-tree on|off|both] [--relay-fanout 8[,64...]] [--cpu-seconds 4] [--controller-cores K]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import dask
import psutil
import torch
from distributed import Client

import dask_monarch as dm


def _dask() -> list[str]:
    exe = shutil.which("dask", path=os.path.dirname(sys.executable)) or shutil.which("dask")
    return [exe] if exe else [sys.executable, "-m", "dask"]  # the same CLI (its dask_cli entry points)


class CliCluster:
    """``dask scheduler`` and ``dask worker --nworkers n --nthreads 1`` on 127.0.0.1, stopped on exit; with
    ``preload`` (a module, e.g. ``"dask_monarch"``), both started with ``--preload`` it (Dask's preload: the module is
    imported when the process starts, so the first attach does not wait for every worker's import of torch)."""

    def __init__(self, n: int, preload: str | None = None, scheduler_cpus=None, worker_cpus=None):
        self.dir = tempfile.mkdtemp(prefix="monarch-scale-")
        file = os.path.join(self.dir, "scheduler.json")
        quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        pinned = lambda cpus: {"preexec_fn": (lambda: os.sched_setaffinity(0, cpus))} if cpus else {}  # noqa: E731
        extra = ["--preload", preload] if preload else []
        self.scheduler = subprocess.Popen(_dask() + ["scheduler", "--host", "127.0.0.1", "--port", "0",
                                                      "--dashboard-address", ":0", "--scheduler-file", file]
                                          + extra, **quiet, **pinned(scheduler_cpus))
        deadline = time.monotonic() + 60
        while not os.path.exists(file):
            if time.monotonic() > deadline or self.scheduler.poll() is not None:
                raise RuntimeError("dask scheduler did not start within 60 s")
            time.sleep(0.1)
        time.sleep(0.2)
        self.workers = subprocess.Popen(_dask() + ["worker", "--scheduler-file", file, "--nworkers", str(n),
                                                    "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"]
                                        + extra, **quiet, **pinned(worker_cpus))
        self.client = Client(scheduler_file=file, set_as_default=False)
        self.client.wait_for_workers(n, timeout=180)

    def close(self) -> None:
        self.client.close()
        for proc in (self.workers, self.scheduler):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)
            except Exception:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except Exception:
                    pass
        shutil.rmtree(self.dir, ignore_errors=True)


class Case:
    """One mesh of ``n`` ranks (the first ``n`` workers) with ``monarch.answer-tree`` ``tree`` and
    ``monarch.relay-fanout`` ``fanout``, and its samples."""

    def __init__(self, client, n: int, tree: bool, fanout: int = 64):
        self.n, self.tree = n, tree
        with dask.config.set({"monarch.answer-tree": tree, "monarch.relay-fanout": fanout}):
            start = time.perf_counter()
            self.mesh = dm.attach(client, dims={"dp": n})
            self.attach = time.perf_counter() - start
        self.step = dm.compile(_chain8)
        with self.mesh.activate():
            self.x = torch.arange(4.0) + 1
            for _ in range(200):
                y = self.x + self.x
            for _ in range(3):  # record, verify, replay
                y = self.step(self.x)
        for _ in range(30):
            dm.inspect(y)
        self.fetches: list = []
        self.steps: list = []
        self.ops: list = []
        self.op_cpu: list = []
        self.compiled: list = []
        self.cpu: list = []

    def round(self, fetches: int, ops: int) -> None:
        x = self.x
        for _ in range(fetches):
            t0 = time.perf_counter()
            dm.inspect(x)
            self.fetches.append(time.perf_counter() - t0)
        for _ in range(fetches):
            with self.mesh.activate():
                y = x + x
            t0 = time.perf_counter()
            dm.inspect(y)
            self.steps.append(time.perf_counter() - t0)
        with self.mesh.activate():
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(ops):
                y = x + x
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        self.ops.append(wall / ops)
        self.op_cpu.append(cpu / ops)
        dm.inspect(y)  # it submits the loop's task copies that wait for their ``task_interval``
        calls = max(1, ops // 20)
        with self.mesh.activate():
            t0 = time.perf_counter()
            for _ in range(calls):
                y = self.step(x)
            self.compiled.append((time.perf_counter() - t0) / calls)
        dm.inspect(y)

    def scheduler_cpu(self, seconds: float, scheduler: psutil.Process) -> None:
        """The scheduler's CPU time over ``seconds`` of eager ops (``x + x`` under ``activate()``, then one sync),
        against the same wall time."""
        x = self.x
        cpu, start = scheduler.cpu_times(), time.perf_counter()
        with self.mesh.activate():
            while time.perf_counter() - start < seconds:
                for _ in range(200):
                    y = x + x
        dm.inspect(y)
        after = scheduler.cpu_times()
        self.cpu.append((after.user + after.system - cpu.user - cpu.system, time.perf_counter() - start))

    def figures(self) -> dict:
        times = sorted(self.fetches)
        return {"fetch p50": statistics.median(times) * 1e3, "fetch p90": times[int(len(times) * 0.9)] * 1e3,
                "step fetch p50": statistics.median(self.steps) * 1e3,
                "op": statistics.median(self.ops) * 1e6, "op CPU": statistics.median(self.op_cpu) * 1e6,
                "compiled": statistics.median(self.compiled) * 1e6,
                "sched CPU": round(100 * max(0.0, sum(c for c, _ in self.cpu)) / sum(w for _, w in self.cpu), 1),
                "attach": self.attach}


UNITS = {"fetch p50": "ms", "fetch p90": "ms", "step fetch p50": "ms", "op": "us", "op CPU": "us", "compiled": "us",
         "sched CPU": "%", "attach": "s"}


def _chain8(x):
    """The compiled case: 8 small ops."""
    for _ in range(4):
        x = x * 0.5 + 1
    return x


def split_cores(k: int) -> tuple[list, list]:
    """The CPUs of the first ``k`` physical cores this process may use (every hardware thread of each, from
    ``/sys/devices/system/cpu/cpu*/topology/thread_siblings_list``), and the CPUs of the other cores. Raises
    ``SystemExit`` where ``k`` leaves no core for the workers."""
    cores: dict = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                core = f.read().strip()
        except OSError:
            core = str(cpu)
        cores.setdefault(core, []).append(cpu)
    groups = list(cores.values())
    if not 0 < k < len(groups):
        raise SystemExit(f"--controller-cores {k}: this machine has {len(groups)} physical cores to split")
    return sorted(c for g in groups[:k] for c in g), sorted(c for g in groups[k:] for c in g)


def pin_this_process(cpus: list) -> None:
    """Every thread of this process, and those it starts later, on ``cpus``."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cpus)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,2,4,8", help="comma-separated rank counts (default 1,2,4,8)")
    parser.add_argument("--fetches", type=int, default=300, help="timed fetches per mesh (default 300)")
    parser.add_argument("--ops", type=int, default=10000, help="timed eager ops per mesh (default 10000)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds the fetches and ops are split in (default 10)")
    parser.add_argument("--answer-tree", choices=("on", "off", "both"), default="on",
                        help="Dask config monarch.answer-tree: the host relays on, off, or both side by side")
    parser.add_argument("--relay-fanout", default="8",
                        help="comma-separated values of Dask config monarch.relay-fanout, side by side (default 8, the default of Dask config monarch.relay-fanout)")
    parser.add_argument("--cpu-seconds", type=float, default=4.0,
                        help="seconds of eager ops per mesh over which the scheduler's CPU is measured (default 4)")
    parser.add_argument("--controller-cores", type=int, default=0,
                        help="run this program (the controller) and the scheduler on the first K physical cores and "
                             "the workers on the others, as on a cluster whose ranks are other machines (default 0: "
                             "every process on every core)")
    args = parser.parse_args(argv)
    controller_cpus, worker_cpus = split_cores(args.controller_cores) if args.controller_cores else (None, None)
    if controller_cpus:
        pin_this_process(controller_cpus)
        print(f"controller and scheduler on CPUs {controller_cpus}, workers on CPUs {worker_cpus}", flush=True)
    counts = [int(v) for v in args.ranks.split(",")]
    fanouts = [int(v) for v in args.relay_fanout.split(",")]
    settings = [(tree, f) for tree in {"on": [True], "off": [False], "both": [False, True]}[args.answer_tree]
                for f in (fanouts if tree else fanouts[:1])]
    cluster = CliCluster(max(counts), scheduler_cpus=controller_cpus, worker_cpus=worker_cpus)
    cases = []
    try:
        scheduler = psutil.Process(cluster.scheduler.pid)
        start = time.perf_counter()
        dm.attach(cluster.client, dims={"dp": max(counts)}).exit()  # the workers' first session (imports, plugin)
        cold = time.perf_counter() - start
        print(f"first attach of {max(counts)} ranks (cold workers): {cold:.1f} s", flush=True)
        cases = [Case(cluster.client, n, tree, f) for n in counts for tree, f in settings]
        for _ in range(args.rounds):  # every mesh in turn, round by round: the same load for each
            for case in cases:
                case.round(max(1, args.fetches // args.rounds), max(1, args.ops // args.rounds))
        for case in cases:
            case.scheduler_cpu(args.cpu_seconds, scheduler)
        rows = {(c.n, setting): c.figures() for c, setting in zip(cases, [s for _ in counts for s in settings])}
    finally:
        for case in cases:
            case.mesh.exit()
        cluster.close()
    where = f", controller on {args.controller_cores} of its cores" if args.controller_cores else ""
    print(f"\nbench/scale.py ({os.cpu_count()} cores{where}; load average {os.getloadavg()[0]:.1f}; {args.fetches} fetches, "
          f"{args.ops} ops per mesh in {args.rounds} rounds, the meshes in turn on one cluster of {max(counts)} "
          f"workers; ratios against the {counts[0]}-rank mesh of the same setting)")
    for tree, fanout in settings:
        print(f"\nmonarch.answer-tree: {str(tree).lower()}" + (f", monarch.relay-fanout: {fanout}" if tree else ""))
        print(f"{'ranks':>5}" + "".join(f"{k + ' (' + UNITS[k] + ')':>22}" for k in UNITS))
        for n in counts:
            row, base = rows[n, (tree, fanout)], rows[counts[0], (tree, fanout)]
            cells = [f"{row[k]:.3g} ({row[k] / base[k]:.2f}x)" if base[k] else f"{row[k]:.3g}" for k in UNITS]
            print(f"{n:>5}" + "".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
