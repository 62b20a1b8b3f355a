"""The ``/monarch`` page's cost at 64 ranks (issue 23 item 8), against 2 ranks in the same run.

A real 2-rank session (the embedded cluster's pieces: ``start_local_cluster(2)``) runs eager ops, a compiled
step and ``dm.report``; the scheduler's ``(sessions, metrics)`` are read as the page reads them
(``dashboard.install.read_scheduler``). From those real metric dicts, sessions of 2 and of 64 synthetic ranks are
built (8 ranks per host, each rank a copy of a real rank's heartbeat with its own counters, one rank stuck at 64).
For ``--beats`` successive heartbeats each is timed through what the page does: ``DashboardData.update`` (the data
source, every 0.5 s on the scheduler), ``MonarchPage.show`` (the Bokeh models), and the serialization of a new
page's document (``Document.to_json``: what a browser's first load of the page gets), the last also in CPU time
of this process (less disturbed by other processes on a loaded machine). Prints p50 and max of each, in
milliseconds, and 64 ranks / 2 ranks. The browser's own drawing is not measured here (no browser on the
development machine; tests/test_dashboard_browser.py loads the page in Chromium where there is one).

Usage::

    python bench/dashboard_scale.py [--beats 20] [--ranks 64]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
from bokeh.document import Document
from distributed import Client

import dask_monarch as dm
from dask_monarch.cluster import start_local_cluster
from dask_monarch.dashboard.data import DashboardData
from dask_monarch.dashboard.install import read_scheduler
from dask_monarch.dashboard.page import MonarchPage


def grab(dask_scheduler):
    return read_scheduler(dask_scheduler)


def real_metrics() -> tuple[str, dict, dict]:
    """A live 2-rank session's id, its scheduler table entry and its workers' ``metrics["monarch"]``."""
    cluster = start_local_cluster(2, silence_logs=40)
    client = Client(cluster, set_as_default=False)
    try:
        with dm.attach(client, dims={"gpu": 2}) as mesh:
            @dm.compile(verify=False)
            def step(w):
                w.add_(1)
                return w.sum()

            with mesh.activate():
                w = torch.zeros(8)
                for i in range(50):
                    loss = step(w)
                    dm.report(loss=loss)
                for _ in range(200):
                    w * 2
            dm.inspect(loss)
            time.sleep(3)  # a heartbeat or two carry the session's numbers to the scheduler
            sessions, metrics = client.run_on_scheduler(grab)
            sid = mesh.session_id
            return sid, sessions[sid], {a: m for a, m in metrics.items() if m and sid in (m.get("sessions") or {})}
    finally:
        client.close()
        cluster.close()


def synthetic(sid: str, info: dict, metrics: dict, ranks: int, beat: int) -> tuple[dict, dict]:
    """``ranks`` ranks, 8 per host, from the real ranks' heartbeats; heartbeat number ``beat``."""
    real = [metrics[a] for a in info["workers"]]
    workers = [f"tcp://10.231.{h // 200}.{10 + h % 200}:{4000 + g}" for h in range((ranks + 7) // 8)
               for g in range(8)][:ranks]
    out = {}
    for r, address in enumerate(workers):
        m = copy.deepcopy(real[r % len(real)])
        snap = m["sessions"][sid]
        snap["rank"], snap["world_size"] = r, ranks
        snap["received"] = int(snap["received"]) + 100 * beat + r
        if snap.get("progress") is not None:
            snap["progress"] = int(snap["progress"]) + 100 * beat - (r % 5)
        snap["queued"] = r % 5
        if r == ranks - 3 and ranks > 2:  # one rank stuck on one message
            snap["now"] = [{"stream": "0", "busy": True, "kind": "CallFunction", "seq": 7, "name": "job.step",
                            "for_s": 90.0 + beat, "flagged": True}] + list(snap.get("now") or [])[1:]
        m["time"] = float(m.get("time", 0)) + beat
        out[address] = m
    return {sid: {**info, "workers": workers, "dims": {"host": (ranks + 7) // 8, "gpu": min(8, ranks)}}}, out


def measure(sid, info, metrics, ranks: int, beats: int) -> dict:
    data = DashboardData()
    page = MonarchPage(None, data=data)
    times = {"data": [], "page": [], "document": [], "document CPU": []}
    start = time.time()
    for beat in range(beats):
        sessions, m = synthetic(sid, info, metrics, ranks, beat)
        t0 = time.perf_counter()
        view = data.update(sessions, m, start + beat)
        t1 = time.perf_counter()
        page.show(view)
        t2 = time.perf_counter()
        doc = Document()
        doc.add_root(MonarchPage(None, data=data).root)
        fresh = doc.roots[0]
        t3, c3 = time.perf_counter(), time.process_time()
        fresh_page = MonarchPage(None, data=data)  # a new browser tab: its page's models, filled, serialized
        fresh_page.show(view)
        doc = Document()
        doc.add_root(fresh_page.root)
        json = doc.to_json()
        t4, c4 = time.perf_counter(), time.process_time()
        times["document CPU"].append(c4 - c3)
        times["data"].append(t1 - t0)
        times["page"].append(t2 - t1)
        times["document"].append(t4 - t3)
        del fresh, json
    return {k: (statistics.median(v) * 1e3, max(v) * 1e3) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--beats", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=64)
    args = parser.parse_args()
    sid, info, metrics = real_metrics()
    results = {n: measure(sid, info, metrics, n, args.beats) for n in (2, args.ranks)}
    names = {"data": "DashboardData.update", "page": "MonarchPage.show", "document": "new page: show + to_json",
             "document CPU": "  the same, CPU time"}
    for key, name in names.items():
        a, b = results[2][key], results[args.ranks][key]
        print(f"{name:26s} 2 ranks p50 {a[0]:7.1f} ms max {a[1]:7.1f}   {args.ranks} ranks p50 {b[0]:7.1f} ms max "
              f"{b[1]:7.1f}   ratio p50 {b[0] / a[0]:.1f}x")
    total = sum(results[args.ranks][k][1] for k in ("data", "page", "document"))
    print(f"{args.ranks} ranks, every stage's max added: {total:.1f} ms (target: under 1,000 ms); {args.beats} "
          f"heartbeats; load {os.getloadavg()[0]:.1f}, cores {os.cpu_count()}")


if __name__ == "__main__":
    main()
