"""Where a fetch's time goes at N ranks (issue 23 items 1 and 6): CPU time and wake-ups per fetch of every thread of
the controller, the host relay's worker (rank 0, the leader) and a plain rank's worker (the last rank), over a loop
of ``dm.inspect`` of a 4-element tensor on a stock CLI cluster (``bench/scale.py``'s ``CliCluster``, loopback).

For each process, each thread's CPU time (``/proc/<pid>/task/<tid>/stat`` utime + stime) and its voluntary context
switches (``/proc/<pid>/task/<tid>/status``: the times it blocked and was woken again) are read before and after the
loop and divided by the fetches; threads are named as Python names them (``threading.enumerate``). With
``--py-spy DIR``, ``py-spy record --threads --idle -f raw`` of the three processes during the loop goes to
``DIR/{ctl,leader,rank}.txt`` (sampling adds load: the figures of such a run are not the clean ones). With
``--strace``, ``strace -c -f`` of the plain rank's worker during the loop counts its syscalls per fetch (it slows the
rank a lot: take its counts, not its times).

With ``--loop op`` the loop is of eager ops instead (``x + x`` under ``mesh.activate()``, 1,000 at a time, each
thousand followed by a fetch so that the workers keep up), and the figures are per op: what an op costs the
controller, the relay's worker and a plain rank's worker; with ``--loop step``, of training-step fetches (``y = x +
x`` under ``activate()``, then ``dm.inspect(y)``: every rank has work, and answers the fetch's barrier itself).

Usage: ``python bench/fetch_costs.py [--ranks 8] [--seconds 15] [--loop fetch|op|step] [--py-spy DIR] [--strace]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

import psutil
import torch

import dask_monarch as dm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale import CliCluster  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def threads_of(pid: int) -> dict:
    """``{tid: (cpu seconds, voluntary context switches)}`` of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                switches = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except (OSError, StopIteration):
            continue
        out[tid] = ((int(fields[11]) + int(fields[12])) / _TICK, switches)
    return out


def _thread_names() -> dict:
    return {str(t.native_id): t.name for t in threading.enumerate()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=15.0, help="length of the fetch loop (default 15)")
    parser.add_argument("--py-spy", dest="pyspy", default=None, help="a folder for py-spy's raw profiles")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of the idle baseline (default 5)")
    parser.add_argument("--strace", action="store_true", help="count the plain rank's syscalls (strace -c -f)")
    parser.add_argument("--loop", choices=("fetch", "op", "step"), default="fetch",
                        help="what the timed loop does: fetches (default), eager ops, or an op then a fetch")
    args = parser.parse_args(argv)
    cluster = CliCluster(args.ranks)
    try:
        dm.attach(cluster.client, dims={"dp": args.ranks}).exit()  # the workers' first session (imports)
        mesh = dm.attach(cluster.client, dims={"dp": args.ranks})
        session = mesh._session
        pids = cluster.client.run(os.getpid)
        leader, plain = session.workers[0], session.workers[-1]
        procs = {"ctl": os.getpid(), "leader": pids[leader], "rank": pids[plain]}
        x = torch.arange(4.0) + 1
        with mesh.activate():
            x = x + 0
        for _ in range(100):
            dm.inspect(x)
        names = {"ctl": _thread_names(), **{k: cluster.client.run(_thread_names, workers=[a])[a]
                                            for k, a in (("leader", leader), ("rank", plain))}}
        tools = []
        if args.pyspy:
            os.makedirs(args.pyspy, exist_ok=True)
            spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or "py-spy"
            for key, pid in procs.items():
                tools.append(subprocess.Popen(
                    [spy, "record", "-p", str(pid), "-d", str(int(args.seconds)), "-r", "100", "-f", "raw",
                     "--threads", "--idle", "--nonblocking", "-o", os.path.join(args.pyspy, f"{key}.txt")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if args.strace:
            tools.append(subprocess.Popen(["strace", "-c", "-f", "-p", str(procs["rank"]), "-o", "/dev/stderr"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        idle0 = {k: threads_of(p) for k, p in procs.items()}
        time.sleep(args.idle)  # the baseline: what each thread spends with no fetch (heartbeats, monitors)
        idle1 = {k: threads_of(p) for k, p in procs.items()}
        time.sleep(1.0 if tools else 0)
        before = {k: threads_of(p) for k, p in procs.items()}
        loop_start = time.monotonic()
        total0 = {k: sum(psutil.Process(p).cpu_times()[:2]) for k, p in
                  [*procs.items(), ("sched", cluster.scheduler.pid)]}
        times = []
        end = time.monotonic() + args.seconds - (2 if tools else 0)
        while time.monotonic() < end:
            t0 = time.perf_counter()
            if args.loop == "fetch":
                dm.inspect(x)
            elif args.loop == "step":
                with mesh.activate():
                    y = x + x
                dm.inspect(y)
            else:
                with mesh.activate():
                    for _ in range(1000):
                        y = x + x
                dm.inspect(y)
            times.append(time.perf_counter() - t0)
        after = {k: threads_of(p) for k, p in procs.items()}
        loop_wall = time.monotonic() - loop_start
        total1 = {k: sum(psutil.Process(p).cpu_times()[:2]) for k, p in
                  [*procs.items(), ("sched", cluster.scheduler.pid)]}
        n = len(times) * (1000 if args.loop == "op" else 1)
        strace_out = ""
        for tool in tools:
            if tool.args[0] == "strace":
                tool.send_signal(2)
                strace_out = tool.communicate(timeout=30)[1]
            else:
                tool.wait(60)
        mesh.exit()
    finally:
        cluster.close()
    times.sort()
    each = {"fetch": "fetch", "step": "step", "op": "op"}[args.loop]
    print(f"bench/fetch_costs.py: {args.ranks} ranks, {n} {each}{'es' if each == 'fetch' else 's'} in {args.seconds:.0f} s ({os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}): p50 {statistics.median(times) * 1e3:.3f} ms, "
          f"p90 {times[int(len(times) * 0.9)] * 1e3:.3f} ms" + (" (a thousand ops and a fetch)" if each == "op" else ""))
    print(f"process CPU per {each} (us): " + ", ".join(f"{k} {(total1[k] - total0[k]) / n * 1e6:.0f}" for k in total1))
    for key in procs:
        rows = []
        scale = loop_wall / args.idle  # the idle baseline over as long as the loop ran
        for tid, (cpu, sw) in after[key].items():
            cpu0, sw0 = before[key].get(tid, (0.0, 0))
            i0, i1 = idle0[key].get(tid, (0.0, 0)), idle1[key].get(tid, (0.0, 0))
            base_cpu, base_sw = (i1[0] - i0[0]) * scale, (i1[1] - i0[1]) * scale
            if cpu - cpu0 > 0 or sw - sw0 > 0:
                rows.append(((cpu - cpu0) / n * 1e6, (sw - sw0) / n, (cpu - cpu0 - base_cpu) / n * 1e6,
                             (sw - sw0 - base_sw) / n, names[key].get(tid, f"tid {tid}")))
        rows.sort(reverse=True)
        print(f"  {key} (pid {procs[key]}): thread: CPU us / wake-ups per {each}; the same less the idle baseline")
        for cpu, sw, net_cpu, net_sw, name in rows[:12]:
            print(f"    {name[:44]:<44} {cpu:8.1f} {sw:6.2f}   {net_cpu:8.1f} {net_sw:6.2f}")
    if strace_out:
        print(f"  rank's syscalls over {n} {each}{'es' if each == 'fetch' else 's'} (strace -c -f; per {each} = calls / {n}):")
        for line in strace_out.splitlines():
            parts = line.split()
            if len(parts) >= 5 and parts[3].isdigit():
                print(f"    {parts[-1]:<20} {int(parts[3]) / n:6.2f}")


if __name__ == "__main__":
    main()
