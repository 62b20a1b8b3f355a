"""Where the controller applies an answer (issue 13 item 1, option (a)): A/B in one process.

``thread``: every answer chunk that comes on an answer channel is handed to the session's answers thread, and
acknowledged on the next turn of the event loop (``Session.INLINE_CHUNK = 0``, ``Channels.ACK_DELAY = 0``);
``inline``: the defaults (a small chunk of ``Status`` / ``FetchResult`` answers applied on the event loop, its
acknowledgement carried by the rank's next batch or sent alone ``ACK_DELAY`` later). The two alternate in blocks of
``--block`` rounds of ``dm.inspect`` of a 4-element tensor and of ``mesh._session.sync``, on a 1-rank and a
2-rank mesh, so that both see the same load; prints p50 and p10 in ms of each and the ratio inline / thread.

Usage: ``python bench/answer_path.py [-n 400] [--block 25]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import dask_monarch as dm
from dask_monarch.controller.channel import Channels
from dask_monarch.controller.session import Session

CONFIGS = {
    "thread": {"INLINE_CHUNK": 0, "ACK_DELAY": 0.0},
    "inline": {"INLINE_CHUNK": Session.INLINE_CHUNK, "ACK_DELAY": Channels.ACK_DELAY},
}


def _use(name: str) -> None:
    Session.INLINE_CHUNK = CONFIGS[name]["INLINE_CHUNK"]
    Channels.ACK_DELAY = CONFIGS[name]["ACK_DELAY"]


def bench_mesh(mesh, n: int, block: int) -> dict:
    with mesh.activate():
        t = torch.arange(4.0) + 1
    session = mesh._session
    cases = {"inspect": lambda: dm.inspect(t), "sync": lambda: session.sync("answer path").result()}
    out = {}
    for case, fn in cases.items():
        times: dict = {name: [] for name in CONFIGS}
        for _ in range(20):
            fn()
        for _ in range(max(1, n // block)):
            for name in CONFIGS:
                _use(name)
                fn()
                for _ in range(block):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
        out[case] = {name: sorted(v) for name, v in times.items()}
    _use("inline")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=400, help="rounds per case and configuration (default 400)")
    parser.add_argument("--block", type=int, default=25, help="rounds of one configuration in a row (default 25)")
    args = parser.parse_args(argv)
    from distributed import Client

    from dask_monarch.cluster import start_local_cluster

    cluster = start_local_cluster(2, silence_logs=40)
    client = Client(cluster, set_as_default=False)
    figures = {}
    try:
        client.wait_for_workers(2, timeout=120)
        for ranks, dims in ((1, {"w": 1}), (2, {"dp": 2})):
            with dm.attach(client, dims=dims) as mesh:
                figures[ranks] = bench_mesh(mesh, args.n, args.block)
    finally:
        client.close()
        cluster.close()
    print(f"\nwhere answers are applied ({os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}; "
          f"{args.n} rounds each, blocks of {args.block})")
    print(f"{'case':<18}{'thread p50 / p10':>20}{'inline p50 / p10':>20}{'ratio p50':>11}")
    for ranks, cases in figures.items():
        for case, times in cases.items():
            a, b = times["thread"], times["inline"]
            pa, pb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
            qa, qb = a[len(a) // 10] * 1e3, b[len(b) // 10] * 1e3
            print(f"{case + f', {ranks} rank' + ('s' if ranks > 1 else ''):<18}{pa:>10.3f} / {qa:<7.3f}"
                  f"{pb:>10.3f} / {qb:<7.3f}{pb / pa:>9.2f}")


if __name__ == "__main__":
    main()
