"""Where attach's time goes, and the scheduler's CPU with and without a session (issue 23 item 6: attach <= 15 s
and scheduler CPU <= 10 % at 64 ranks). One stock CLI cluster (``dask scheduler``, ``dask worker --nworkers N
--nthreads 1``, loopback only; ``bench/scale.py``'s ``CliCluster``) and the public API only:

* ``sched CPU, no session``: the scheduler process's CPU time over ``--idle`` seconds of wall time (``psutil``),
  before any attach: what N workers' heartbeats alone cost it;
* ``cold attach``: ``dm.attach(client, dims={"dp": N})`` on workers that never ran a session (the first attach,
  which imports dask_monarch and torch on every worker), with its steps (``Session.attach_phases``: the plugins,
  the GPU check, the session's record on the scheduler, the answer channels' handshakes, the host relays, the
  answer sockets);
* ``sched CPU, idle session``: as the first, with that session open and idle;
* ``sched CPU, op loop``: during ``--loop`` seconds of eager ops (``x + x`` under ``mesh.activate()``, a fetch
  every 1,000 ops as a training step fetches its loss), over the loop's wall time: long enough to hold several
  task periods (``Session.task_period``), whose task copies come in bursts;
* ``warm attach``: ``--warm`` more attaches (each ended before the next) on the same workers, the median of each
  step.

With ``--py-spy DIR`` (py-spy on PATH or beside this Python), the scheduler is sampled during each of the three
CPU windows (``py-spy record --format raw``: collapsed stacks, one file per window), and the functions that took
the most samples are printed.

With ``--preload MODULE`` the scheduler and the workers start with Dask's ``--preload MODULE``: with
``dask_monarch``, every process imports dask_monarch and torch as it starts (the cluster's start takes that time),
and the first attach finds them imported.

Usage: ``python bench/attach.py [--ranks 8] [--idle 10] [--loop 10] [--warm 3] [--py-spy DIR] [--preload MODULE]``.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import subprocess
import sys
import time

import psutil
import torch

import dask_monarch as dm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale import CliCluster  # noqa: E402  (bench/ is not a package)


class Sampler:
    """py-spy on ``pid`` for one window, writing collapsed stacks to ``path`` (nothing if ``path`` is None)."""

    def __init__(self, pid: int, path: str | None):
        self.path, self.proc = path, None
        if path is None:
            return
        exe = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
        if exe is None:
            raise SystemExit("--py-spy: py-spy is not installed (pip install py-spy)")
        self.proc = subprocess.Popen([exe, "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
                                      "--output", path, "--nonblocking"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # py-spy attaches

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(2)  # SIGINT: py-spy writes its file and exits
            self.proc.wait(30)


def top_functions(path: str, n: int = 12) -> list[tuple[str, int, int]]:
    """``(what, samples, total samples)`` of a py-spy raw file, the most frequent first: what the event loop ran
    (the frame under asyncio's ``Handle._run``, with the first ``distributed``/``dask_monarch`` frame under it that
    is not a generic wrapper), or the thread's outermost frame for a thread off the loop."""
    counts: collections.Counter = collections.Counter()
    total = 0
    generic = ("utils.py", "core.py:8", "_handle_comm", "handle_stream", "Handle._run", "wrapper")
    with open(path) as f:
        for line in f:
            stack, _, k = line.rstrip("\n").rpartition(" ")
            k = int(k)
            total += k
            frames = stack.split(";")
            at = next((i for i, fr in enumerate(frames) if fr.startswith("Handle._run")), None)
            if at is None:
                counts[frames[0]] += k
                continue
            inner = [fr for fr in frames[at + 1:] if not any(g in fr for g in generic)]
            counts[" > ".join(inner[:2]) or frames[at + 1] if len(frames) > at + 1 else "idle"] += k
    return [(what, c, total) for what, c in counts.most_common(n)]


def cpu_window(scheduler: psutil.Process, seconds: float, sampler: Sampler, work=None) -> float:
    """The scheduler's CPU % over ``seconds`` of waiting, or over ``work()``'s wall time."""
    before = scheduler.cpu_times()
    t0 = time.perf_counter()
    if work is None:
        time.sleep(seconds)
    else:
        work()
    wall = time.perf_counter() - t0
    after = scheduler.cpu_times()
    sampler.stop()
    return 100 * (after.user + after.system - before.user - before.system) / wall


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8, help="workers and ranks (default 8)")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of each idle CPU window (default 10)")
    parser.add_argument("--loop", type=float, default=10.0, help="seconds of the op loop (default 10)")
    parser.add_argument("--warm", type=int, default=3, help="warm attaches after the cold one (default 3)")
    parser.add_argument("--py-spy", metavar="DIR", help="sample the scheduler with py-spy into DIR")
    parser.add_argument("--preload", metavar="MODULE", help="start the scheduler and the workers with Dask's "
                        "--preload MODULE (e.g. dask_monarch: torch is imported as each process starts)")
    args = parser.parse_args(argv)
    n = args.ranks
    if args.py_spy:
        os.makedirs(args.py_spy, exist_ok=True)
    spy = (lambda name: os.path.join(args.py_spy, f"scheduler-{name}.txt")) if args.py_spy else (lambda name: None)
    started = time.perf_counter()
    cluster = CliCluster(n, preload=args.preload)
    print(f"cluster of {n} workers up in {time.perf_counter() - started:.1f} s"
          + (f" (--preload {args.preload})" if args.preload else ""), flush=True)
    cpu, attaches = {}, []
    try:
        scheduler = psutil.Process(cluster.scheduler.pid)
        time.sleep(2.0)  # the workers' registration settles
        cpu["no session"] = cpu_window(scheduler, args.idle, Sampler(scheduler.pid, spy("no-session")))
        for i in range(1 + args.warm):
            t0 = time.perf_counter()
            mesh = dm.attach(cluster.client, dims={"dp": n})
            total = time.perf_counter() - t0
            attaches.append((total, dict(getattr(mesh._session, "attach_phases", {}))))  # {} before 67aa12f
            print(f"{'cold' if i == 0 else 'warm'} attach: {total:.2f} s", flush=True)
            if i == 0:
                x = torch.arange(4.0) + 1
                with mesh.activate():
                    y = x + x
                dm.inspect(y)
                cpu["idle session"] = cpu_window(scheduler, args.idle, Sampler(scheduler.pid, spy("idle-session")))

                def loop():
                    deadline = time.perf_counter() + args.loop
                    while time.perf_counter() < deadline:
                        with mesh.activate():
                            for _ in range(1000):
                                y = x + x
                        dm.inspect(y)
                        ops[0] += 1000

                ops = [0]

                cpu["op loop"] = cpu_window(scheduler, 0, Sampler(scheduler.pid, spy("op-loop")), loop)
                print(f"  op loop: {ops[0]} ops, task period {mesh._session.task_period:.2f} s", flush=True)
            t0 = time.perf_counter()
            mesh.exit()
            print(f"  exit: {time.perf_counter() - t0:.2f} s", flush=True)
    finally:
        cluster.close()
    print(f"\nbench/attach.py ({os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}; {n} ranks; torch "
          f"{torch.__version__})")
    print("\nscheduler CPU: " + ", ".join(f"{k} {v:.1f} %" for k, v in cpu.items()))
    cold_total, cold = attaches[0]
    warm = attaches[1:]
    names = list(cold) + [k for _, p in warm for k in p if k not in cold]
    print(f"\n{'attach step':<18}{'cold (s)':>10}{'warm median (s)':>18}")
    for name in names:
        w = [p[name] for _, p in warm if name in p]
        print(f"{name:<18}{cold.get(name, 0):>10.3f}{(statistics.median(w) if w else 0):>18.3f}")
    w = [t for t, _ in warm]
    print(f"{'total':<18}{cold_total:>10.3f}{(statistics.median(w) if w else 0):>18.3f}")
    if args.py_spy:
        for name in ("no-session", "idle-session", "op-loop"):
            path = spy(name)
            if not os.path.exists(path):
                continue
            print(f"\nscheduler, {name}: the functions in the most samples")
            for frame, c, total in top_functions(path):
                print(f"  {100 * c / total:5.1f} %  {frame[:150]}")


if __name__ == "__main__":
    main()
