"""Compiled functions (``dm.compile``) against local eager PyTorch and a plain ``torch.distributed`` script,
each a ratio measured in the same run (issue 11). ``bench/dispatch.py`` prints these as its cases (f) and (g).

(f) Monarch's test_many chain, ``chain(torch.ones(16, 16), 2048)`` (4,096 dependent small ops), compiled: ``k``
    calls back to back, then one status round trip; the time per call is the replay's (the worker runs the
    recording's 4,096 operations from one ``CallRecording``). Against the same chain in local eager PyTorch (in
    this process, outside any mesh), and against the chain sent eagerly and inside ``coalescing()`` through the
    mesh (end to end, through a fetch). Also: the controller's time per compiled call, for this chain and for a
    16-op one (a replay's controller cost does not grow with the recording's length).
(h) With ``--device cuda`` (one GPU): the chain on 16x16 CUDA tensors, compiled with ``cuda_graph=True`` (each
    call after the second launches one CUDA graph) and without, against the chain in local eager PyTorch on the
    same GPU and against the chain captured locally as a ``torch.cuda.CUDAGraph`` and replayed.
(g) The data-parallel training step of examples/train_digits.py (forward, backward, ``reduce_`` avg of the
    gradients over "dp", SGD with momentum, ``zero_grad``), compiled, on 2 workers; against (i) the same step on
    the global batch in one local process and (ii) a plain ``torch.distributed`` script running the same step on
    2 gloo processes on the same machine (per-parameter ``all_reduce``).

    python bench/compiled.py            # about a minute
    python bench/compiled.py --quick
    python bench/compiled.py --device cuda   # (h) on a GPU machine
    python bench/compiled.py --chain-only    # (f) alone: the 4096-op chain against local eager, 5 rounds
    python bench/compiled.py --chain-only --backend inductor --ops 512   # and compiled by Inductor
    python bench/compiled.py --device cuda --backend inductor            # (h), also by Inductor
"""

from __future__ import annotations

import argparse
import os
import runpy
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _torchrun import run_ranks

import dask_monarch as dm

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"
F = torch.nn.functional


def chain(x: torch.Tensor, n: int) -> torch.Tensor:
    """Monarch's test_many: ``n`` iterations of dependent small ops (two ops each)."""
    for i in range(n):
        x = x * 1.0001 + 0.5 if i % 2 else torch.relu(x - 0.25)
    return x


def local_seconds(fn, repeats: int = 5) -> float:
    """Best of ``repeats`` runs of ``fn()`` in this process (the machine is shared: the minimum is the cost)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ------------------------------------------------------------------------------------------- (f) the chain
def bench_chain(mesh, n: int = 2048, repeats: int = 5, calls: int = 20, backend: str | None = None) -> dict:
    """Replay time of the compiled chain and local eager time, measured in the same rounds (``repeats`` rounds of
    ``calls`` replays, then 5 local chains, back to back: a shared machine's load moves both alike; figures are
    medians over the rounds), the controller's time per call, and the chain eager and coalesced through the mesh,
    end to end. ``backend``: ``compile``'s (``"inductor"``: the chain fused by Inductor on the worker)."""
    session = mesh._session
    step = dm.compile(lambda x: chain(x, n), backend=backend)
    short = dm.compile(lambda x: chain(x, 8))
    with mesh.activate():
        x = torch.ones(16, 16)
        for _ in range(3):  # record, verify (Inductor compiles), replay
            result, _ = step(x), short(x)
        value = dm.inspect(result)
    replay, local, controller, controller_short = [], [], [], []
    for _ in range(repeats):
        with mesh.activate():
            t0 = time.perf_counter()
            for _ in range(calls):
                result = step(x)
            t1 = time.perf_counter()
            session.sync("compiled chain").result()
            t2 = time.perf_counter()
            for _ in range(calls):
                short(x)
            t3 = time.perf_counter()
            session.sync("short chain").result()
        replay.append((t2 - t0) / calls)
        controller.append((t1 - t0) / calls)
        controller_short.append((t3 - t2) / calls)
        t0 = time.perf_counter()
        for _ in range(5):
            chain(torch.ones(16, 16), n)
        local.append((time.perf_counter() - t0) / 5)
    eager, coalesced = [], []
    with mesh.activate():
        for _ in range(min(repeats, 3)):
            t0 = time.perf_counter()
            dm.inspect(chain(torch.ones(16, 16), n))
            eager.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with dm.coalescing():
                out = chain(torch.ones(16, 16), n)
            dm.inspect(out)
            coalesced.append(time.perf_counter() - t0)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if backend else {"atol": 0, "rtol": 0}
    assert torch.allclose(value, chain(torch.ones(16, 16), n), **tolerance), "the replay computed another value"
    return {"ops": 2 * n, "replay": statistics.median(replay), "replays": replay, "local": statistics.median(local),
            "locals": local, "ratio": statistics.median(a / b for a, b in zip(local, replay)), "backend": backend,
            "controller_us": statistics.median(controller) * 1e6,
            "controller_short_us": statistics.median(controller_short) * 1e6,
            "eager": statistics.median(eager), "coalesced": statistics.median(coalesced)}


# ------------------------------------------------------------------------------- (h) the chain on one GPU
def _cuda_seconds(fn, repeats: int = 5, calls: int = 20) -> float:
    """Best of ``repeats`` rounds of ``calls`` calls of ``fn()`` on this GPU, per call, until the GPU is done."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def bench_chain_cuda(mesh, n: int = 2048, repeats: int = 3, calls: int = 50, backend: str | None = None) -> dict:
    """Per call: the chain compiled with and without ``cuda_graph`` on the worker's GPU (``calls`` calls, then a
    fetch of the last result, which waits for the GPU; median of ``repeats``), local eager on this GPU, and a
    local CUDA graph of it (until ``torch.cuda.synchronize()``). ``backend="inductor"``: also compiled by Inductor,
    with and without ``cuda_graph``."""
    figures = {}
    modes = [("graph", True, None), ("plain", False, None)]
    if backend:
        modes += [("inductor", False, backend), ("inductor_graph", True, backend)]
    for label, graph, how in modes:
        step = dm.compile(lambda x: chain(x, n), verify=False, cuda_graph=graph, backend=how)
        with mesh.activate():
            x = torch.ones(16, 16, device="cuda")
            for _ in range(4):  # a replay, (Inductor compiles,) the capture, a launch
                result = step(x)
            value = dm.inspect(result)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(calls):
                    result = step(x)
                dm.inspect(result)  # a copy to the host: after the GPU ran every call
                times.append((time.perf_counter() - t0) / calls)
        figures[label] = statistics.median(times)
        assert torch.allclose(value, chain(torch.ones(16, 16), n), rtol=1e-4), "the replay computed another value"
    x = torch.ones(16, 16, device="cuda")
    figures["local"] = _cuda_seconds(lambda: chain(x, n), calls=5)
    static = torch.ones(16, 16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(static, n)  # warm-up before the capture, as torch.cuda.graphs advises
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        chain(static, n)
    figures["local_graph"] = _cuda_seconds(graph.replay)
    figures["ops"] = 2 * n
    return figures


# ---------------------------------------------------------------------------------- (g) the digits step
def make_step(model, optimizer, reduce: bool):
    """The step of examples/train_digits.py on one batch."""

    def step(xb, yb):
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        if reduce:
            dm.reduce_([p.grad for p in model.parameters()], "dp", "avg")
        optimizer.step()
        return loss

    return step


def _example():
    # run_path, not import: the example's functions get a module name the workers cannot import, so they travel
    # by value exactly as when the example runs as __main__
    return runpy.run_path(str(EXAMPLE), run_name="train_digits_bench")


def bench_digits(mesh, steps: int = 100, repeats: int = 3, batch: int = 16) -> dict:
    """Steps/s of the compiled digits step on ``mesh`` (a "dp" mesh), median of ``repeats`` rounds."""
    ex = _example()
    session = mesh._session
    with mesh.activate():
        dm.remote(torch.manual_seed, propagate="inspect")(0)
        model = ex["MLP"]()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=ex["MOMENTUM"])
        x, y, _, _ = dm.remote(ex["load_shard"], propagate=ex["load_shard_shapes"])(mesh, 0)
        n_rows = x.shape[0]
        step = dm.compile(make_step(model, optimizer, True), warmup=1)

        def run(count: int, offset: int = 0):
            loss = None
            for i in range(offset, offset + count):
                start = (i * batch) % (n_rows - batch)
                loss = step(x[start:start + batch], y[start:start + batch])
            return loss

        dm.inspect(run(20))
        rates, loops = [], []
        for r in range(repeats):
            t0 = time.perf_counter()
            loss = run(steps, offset=r * steps)
            t1 = time.perf_counter()
            session.sync("compiled steps").result()
            rates.append(steps / (time.perf_counter() - t0))
            loops.append((t1 - t0) / steps)
        final_loss = dm.inspect(loss).item()
    return {"rate": statistics.median(rates), "rates": rates, "loop_us": statistics.median(loops) * 1e6,
            "recordings": step.recordings, "loss": final_loss, "world": mesh.size("dp"), "batch": batch}


def local_digits(world: int, steps: int = 100, batch: int = 16) -> float:
    """Steps/s of the same step on the global batch (``world`` x ``batch`` rows) in this process."""
    from sklearn.datasets import load_digits

    ex = _example()
    digits = load_digits()
    lx = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    ly = torch.tensor(digits.target, dtype=torch.int64)
    torch.manual_seed(0)
    model = ex["MLP"]()
    step = make_step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=ex["MOMENTUM"]), False)
    rows = world * batch

    def run():
        for i in range(steps):
            start = (i * rows) % (len(ly) - rows)
            step(lx[start:start + rows], ly[start:start + rows])

    return steps / local_seconds(run, 3)


def _gloo_worker(rank: int, world: int, steps: int, batch: int) -> float:
    """One process of the plain torch.distributed script: its shard, the same step, gradients all-reduced."""
    ex = _example()
    torch.manual_seed(0)
    model = ex["MLP"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=ex["MOMENTUM"])

    class Mesh:  # load_shard's view of its rank
        dims = {"dp": type("Dim", (), {"rank": rank, "size": world})()}

    x, y, _, _ = ex["load_shard"](Mesh(), 0)

    def step(xb, yb):
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # gloo has no AVG: sum, then divide
            p.grad.div_(world)
        optimizer.step()

    def run(count: int, offset: int = 0):
        for i in range(offset, offset + count):
            start = (i * batch) % (len(y) - batch)
            step(x[start:start + batch], y[start:start + batch])

    run(20)
    rates = []
    for r in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        run(steps, r * steps)
        dist.barrier()
        rates.append(steps / (time.perf_counter() - t0))
    return statistics.median(rates)


def gloo_digits(world: int, steps: int = 100, batch: int = 16) -> float:
    """Steps/s of the plain torch.distributed script on ``world`` gloo processes."""
    return run_ranks(_gloo_worker, world, (steps, batch), timeout=600, backend="gloo")


# ------------------------------------------------------------------------------------------------- report
def rows(chain_figures: dict | None, digits_figures: dict | None, local: float | None, gloo: float | None) -> list:
    """Table rows ``(label, through the mesh, baseline, ratio)`` for ``bench/dispatch.py``'s report."""
    out = []
    if chain_figures is not None:
        c = chain_figures
        how = " by Inductor" if c.get("backend") else ""
        out += [
            (f"(f) {c['ops']}-op chain compiled{how}, 1 worker", f"{c['replay'] * 1e3:>11.2f} ms   ",
             f"{c['local'] * 1e3:>13.2f} ms   ", f"{c['ratio']:.3f}"),
            ("    target >= 0.9 of local eager", f"{'MET' if c['ratio'] >= 0.9 else 'NOT MET':>17}   "
             f"(rounds, replay / local: {', '.join(f'{r * 1e3:.1f}/{l * 1e3:.1f}' for r, l in zip(c['replays'], c['locals']))}"
             " ms per call)", "", ""),
            ("    the same chain eager through the mesh", f"{c['eager']:>12.3f} s    ", "",
             f"{c['eager'] / c['replay']:.1f}x slower"),
            ("    the same chain in coalescing()", f"{c['coalesced']:>12.3f} s    ", "",
             f"{c['coalesced'] / c['replay']:.1f}x slower"),
            ("    controller time per compiled call", f"{c['controller_us']:>11.0f} us     (16-op chain: "
             f"{c['controller_short_us']:.0f} us; target <= 100 us: "
             f"{'MET' if max(c['controller_us'], c['controller_short_us']) <= 100 else 'NOT MET'})", "", ""),
        ]
    if digits_figures is not None:
        d = digits_figures
        out += [
            (f"(g) digits step compiled, {d['world']} workers", f"{d['rate']:>11,.0f} step/s",
             f"{local:>11,.0f} step/s" if local else "", f"{d['rate'] / local:.4f}" if local else ""),
            (f"    against plain torch.distributed, {d['world']} gloo", "",
             f"{gloo:>11,.0f} step/s" if gloo else "", f"{d['rate'] / gloo:.4f}" if gloo else ""),
            ("    controller time per step", f"{d['loop_us']:>11.0f} us     (two slicing ops + one CallRecording; "
             f"recordings made: {d['recordings']})", "", ""),
        ]
    return out


def cuda_main(quick: bool, backend: str | None = None) -> None:
    from distributed import Client

    from dask_monarch.cluster import start_local_cluster

    cluster = start_local_cluster(1, silence_logs=40)
    client = Client(cluster, set_as_default=False)
    try:
        with dm.attach(client, dims={"gpu": 1}) as mesh:
            f = bench_chain_cuda(mesh, repeats=1 if quick else 3, backend=backend)
    finally:
        client.close()
        cluster.close()
    print(f"\ndask_monarch compiled chain on one GPU ({f['ops']} ops on 16x16 tensors; "
          f"{torch.cuda.get_device_name(0)}; torch {torch.__version__})")
    print(f"{'':44}{'ms per call':>12}{'local eager / this':>20}{'local graph / this':>20}")
    for label, key in (("(h) compiled, cuda_graph=True, 1 worker", "graph"),
                       ("    compiled, plain replays, 1 worker", "plain"),
                       ("    compiled by Inductor, 1 worker", "inductor"),
                       ("    by Inductor, cuda_graph=True, 1 worker", "inductor_graph"),
                       ("    local eager on this GPU", "local"),
                       ("    local torch.cuda.CUDAGraph replay", "local_graph")):
        value = f.get(key)
        if value is None:
            continue
        print(f"{label:<44}{value * 1e3:>12.3f}{f['local'] / value:>20.3f}{f['local_graph'] / value:>20.3f}")


def chain_main(n: int, backend: str | None) -> None:
    """Case (f) alone: the compiled chain against local eager, medians of 5 rounds (and by Inductor)."""
    from distributed import Client

    from dask_monarch.cluster import start_local_cluster

    cluster = start_local_cluster(1, silence_logs=40)
    client = Client(cluster, set_as_default=False)
    try:
        with dm.attach(client, dims={"w": 1}) as one:
            figures = [bench_chain(one, n)]
            if backend:
                figures.append(bench_chain(one, n, backend=backend))
    finally:
        client.close()
        cluster.close()
    print(f"\ndask_monarch compiled chain (torch {torch.__version__}; {os.cpu_count()} cores; load average "
          f"{os.getloadavg()[0]:.1f}; median of 5 rounds)")
    print(f"{'case':<44}{'through the mesh':>18}{'baseline':>20}{'ratio':>9}")
    for f in figures:
        for label, mesh_value, base, ratio in rows(f, None, None, None)[:2]:
            print(f"{label:<44}{mesh_value:>18}{base:>20}{ratio:>9}" if base or ratio else f"{label:<44}{mesh_value}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: case (h) on one GPU")
    parser.add_argument("--backend", default=None, choices=("inductor",),
                        help="also the chain compiled by Inductor (on CPU: the --chain-only case, a shorter chain)")
    parser.add_argument("--chain-only", action="store_true", help="only case (f), the chain")
    parser.add_argument("--ops", type=int, default=4096, help="the chain's length (even)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        cuda_main(args.quick, args.backend)
        return
    if args.chain_only:
        chain_main(args.ops // 2, args.backend)
        return
    steps, repeats = (30, 1) if args.quick else (100, 3)
    from distributed import Client

    from dask_monarch.cluster import start_local_cluster

    cluster = start_local_cluster(2, silence_logs=40)
    client = Client(cluster, set_as_default=False)
    try:
        with dm.attach(client, dims={"w": 1}) as one:
            chain_figures = bench_chain(one, repeats=repeats)
        with dm.attach(client, dims={"dp": 2}) as two:
            digits_figures = bench_digits(two, steps, repeats)
    finally:
        client.close()
        cluster.close()
    local = local_digits(2, steps)
    gloo = gloo_digits(2, steps)
    print(f"\ndask_monarch compiled functions ({'quick' if args.quick else 'full'}; torch {torch.__version__}; "
          f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}; median of {repeats})")
    print(f"{'case':<44}{'through the mesh':>18}{'baseline':>20}{'ratio':>9}")
    for label, mesh_value, base, ratio in rows(chain_figures, digits_figures, local, gloo):
        if base or ratio:
            print(f"{label:<44}{mesh_value:>18}{base:>20}{ratio:>9}")
        else:
            print(f"{label:<44}{mesh_value}")


if __name__ == "__main__":
    main()
