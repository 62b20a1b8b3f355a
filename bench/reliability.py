"""Reliability figures of docs/benchmarks.md (issue 12): what a session leaves on the workers, and how long faults take
to become errors. Starts its own cluster with the command lines (``dask scheduler`` and two ``dask worker``
processes with nannies, ``--nthreads 1``), as an outside tester would.

* ``leak``: ``--sessions`` sessions in a row, each holding ``--mib`` MiB per rank with a reduce (as large again)
  and ending with ``mesh.exit()``; worker RSS, OS threads, open fds and TCP connections after the first and
  after the last, with the workers' cyclic garbage collector disabled (nothing may rely on it).
* ``killed-controller``: the same session from ``--controllers`` controller processes SIGKILLed mid-session.
* ``errors``: the time from a fault to the controller's error, and its first line: a rank SIGKILLed, SIGSTOPped
  (``heartbeat_timeout=5``) and restarted (``Client.restart_workers``) while its peer waits for it in an
  all-reduce (``comm_timeout=240``), and a rank killed after answering but before the controller collected the
  answer (forced); with how long the survivor then took to end the session's threads and free its gloo
  threads and sockets, and whether the next session works.

Usage::

    python bench/reliability.py                       # all cases (about 2 minutes)
    python bench/reliability.py --cases leak --sessions 6 --mib 300
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import torch
from distributed import Client

import dask_monarch as dm
from dask_monarch.cluster import cluster_workers

MIB = 2**20


def start_cluster(tmp: Path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    dask_cli = [str(Path(sys.executable).with_name("dask"))]
    if not Path(dask_cli[0]).exists():
        dask_cli = [sys.executable, "-m", "dask"]
    sched_file = tmp / "scheduler.json"
    procs = [subprocess.Popen([*dask_cli, "scheduler", "--port", "0", "--dashboard-address", ":0",
                               "--scheduler-file", str(sched_file)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    deadline = time.time() + 60
    while not sched_file.exists() and time.time() < deadline:
        time.sleep(0.2)
    address = json.loads(sched_file.read_text())["address"]
    for _ in range(2):
        procs.append(subprocess.Popen([*dask_cli, "worker", address, "--nthreads", "1", "--no-dashboard"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return address, procs


def usage(dask_worker):
    import threading

    import psutil

    me = psutil.Process()
    plugin = dask_worker.plugins.get("dask-monarch")
    return {
        "rss_mb": me.memory_info().rss / 1e6,
        "threads": me.num_threads(),
        "fds": me.num_fds(),
        "tcp": len(me.net_connections("tcp")),
        "sessions": len(plugin.sessions) if plugin is not None else 0,
        "monarch_threads": sum(t.name.startswith("monarch-") for t in threading.enumerate()),
    }


def set_gc(enabled):
    import gc

    gc.enable() if enabled else gc.disable()


def settled(client, workers=None, timeout=60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = client.run(usage, workers=workers)
        if all(u["sessions"] == 0 and u["monarch_threads"] == 0 for u in state.values()):
            return state
        if time.monotonic() > deadline:
            return state
        time.sleep(0.25)


def show(label, state) -> None:
    for address, u in sorted(state.items()):
        print(f"  {label:<28} {address:<24} RSS {u['rss_mb']:7.0f} MB  threads {u['threads']:3d}  fds {u['fds']:3d}"
              f"  tcp {u['tcp']:3d}", flush=True)


def one_session(client, mib: int) -> None:
    with dm.attach(client, dims={"dp": 2}, comm_timeout=60) as mesh:
        with mesh.activate():
            x = torch.ones(mib * MIB // 4)
            total = x.reduce("dp", "sum")
            assert dm.inspect(total[:2]).tolist() == [2.0, 2.0]


def case_leak(client, args) -> None:
    print(f"leak: {args.sessions} sessions of {args.mib} MiB per rank with a reduce, workers' cyclic GC disabled")
    client.run(set_gc, False)
    try:
        one_session(client, args.mib)
        show("after session 1", settled(client))
        for _ in range(args.sessions - 1):
            one_session(client, args.mib)
        show(f"after session {args.sessions}", settled(client))
    finally:
        client.run(set_gc, True)
    print(f"  controller threads named monarch-*: {sum(t.name.startswith('monarch-') for t in threading.enumerate())}")


CONTROLLER = """
import os, signal, torch, dask_monarch as dm
mesh = dm.attach({address!r}, dims={{"dp": 2}}, comm_timeout=60)
with mesh.activate():
    x = torch.ones({elements})
    total = x.reduce("dp", "sum")
    assert dm.inspect(total[:2]).tolist() == [2.0, 2.0]
    y = x * 2
os.kill(os.getpid(), signal.SIGKILL)
"""


def case_killed_controller(client, args) -> None:
    print(f"killed-controller: {args.controllers} controllers SIGKILLed mid-session, {args.mib} MiB per rank, "
          "workers' cyclic GC disabled")
    script = textwrap.dedent(CONTROLLER.format(address=client.scheduler.address, elements=args.mib * MIB // 4))
    client.run(set_gc, False)
    try:
        for i in range(args.controllers):
            subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
            if i == 0:
                show("after controller 1", settled(client))
        show(f"after controller {args.controllers}", settled(client))
    finally:
        client.run(set_gc, True)


def slow_on_rank_1(x, rank):
    if int(rank) == 1:
        time.sleep(30)
    return x + 1


def first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return text if len(text) <= 220 else text[:219] + "…"


def fault_during_allreduce(client, fault: str) -> None:
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=240, heartbeat_timeout=5)
    before = client.run(usage)
    x = dm.remote(torch.add)(mesh.rank("dp"), 1)
    assert dm.inspect(x.reduce("dp", "sum")).item() == 3
    y = dm.remote(slow_on_rank_1, propagate=lambda x, rank: torch.empty_like(x))(x, mesh.rank("dp"))
    future = dm.fetch_shard(y.reduce("dp", "sum"))
    time.sleep(2)  # rank 0 waits in the all-reduce for rank 1
    survivor, victim = mesh.workers[0], mesh.workers[1]
    victim_pid = client.run(os.getpid, workers=[victim])[victim]
    start = time.monotonic()
    if fault == "SIGKILL":
        os.kill(victim_pid, signal.SIGKILL)
    elif fault == "SIGSTOP":
        os.kill(victim_pid, signal.SIGSTOP)
    else:
        threading.Thread(target=client.restart_workers, args=([victim],), kwargs={"timeout": 60}, daemon=True).start()
    try:
        try:
            future.result(timeout=200)
            error = "none"
        except Exception as e:
            error = first_line(e)
        failed = time.monotonic() - start
        mesh.exit()
        freed = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            u = client.run(usage, workers=[survivor])[survivor]
            if (u["sessions"] == 0 and u["monarch_threads"] == 0
                    and u["threads"] <= before[survivor]["threads"] and u["fds"] <= before[survivor]["fds"]):
                freed = time.monotonic() - start
                break
            time.sleep(0.1)
    finally:
        if fault == "SIGSTOP":
            os.kill(victim_pid, signal.SIGCONT)
    client.wait_for_workers(2, timeout=60)
    settled(client)
    t = time.monotonic()
    one_session(client, 1)
    freed_text = "not within 60 s" if freed is None else f"{freed:.2f} s"
    print(f"  {fault:<16} error after {failed:5.2f} s; survivor freed after {freed_text}; next session "
          f"{time.monotonic() - t:.2f} s\n    {error}", flush=True)


def lost_answer(client) -> None:
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=60, heartbeat_timeout=600, liveness_interval=600)
    session = mesh._session
    x = dm.remote(torch.add)(mesh.rank("dp"), 1)
    assert dm.fetch_shard(x, dp=1).result(timeout=60).item() == 2
    killed = threading.Event()
    real = session._on_sync_done

    def after_the_kill(fut):
        if fut.key.split("-")[3] == "1":
            killed.wait(60)
        real(fut)

    session._on_sync_done = after_the_kill
    future = dm.fetch_shard(x, dp=1)
    while not all(f.status == "finished" for f in future.futures):
        time.sleep(0.05)
    victim = mesh.workers[1]
    os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
    while victim in cluster_workers(client):
        time.sleep(0.05)
    killed.set()
    start = time.monotonic()
    try:
        future.result(timeout=120)
        error = "none"
    except Exception as e:
        error = first_line(e)
    failed = time.monotonic() - start
    mesh.exit()
    client.wait_for_workers(2, timeout=60)
    t = time.monotonic()
    one_session(client, 1)
    new_client = Client(client.scheduler.address, set_as_default=False)
    one_session(new_client, 1)
    new_client.close()
    print(f"  {'lost answer':<16} error {failed:5.2f} s after the answer was handled; next sessions (same and "
          f"new Client) {time.monotonic() - t:.2f} s\n    {error}", flush=True)


def case_errors(client, args) -> None:
    print("errors: a rank's fault while its peer waits for it in an all-reduce (comm_timeout=240, "
          "heartbeat_timeout=5)")
    for fault in ("SIGKILL", "SIGSTOP", "restart_workers"):
        fault_during_allreduce(client, fault)
    lost_answer(client)


CASES = {"leak": case_leak, "killed-controller": case_killed_controller, "errors": case_errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--sessions", type=int, default=30)
    parser.add_argument("--controllers", type=int, default=4)
    parser.add_argument("--mib", type=int, default=100)
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    with tempfile.TemporaryDirectory() as tmp:
        address, procs = start_cluster(Path(tmp))
        try:
            client = Client(address, set_as_default=False)
            client.wait_for_workers(2, timeout=60)
            for case in cases:
                CASES[case](client, args)
            client.close()
        finally:
            for p in procs[::-1]:
                p.terminate()
            for p in procs:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()


if __name__ == "__main__":
    main()
