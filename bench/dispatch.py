"""Dispatch benchmark: how fast dask_monarch moves work to its workers, as ratios against local eager PyTorch
measured in the same run (DESIGN.md "Performance design").

(a) raw: tiny ``CallFunction`` messages (``aten.add.Tensor`` on two 4-element CPU tensors, each into a new ref,
    with a ``DeleteRefs`` every 1000) sent through ONE worker with the low-level session API
    (``session.send(msg, [0])``, then ``session.sync(...).result()``). The messages are built before the clock
    starts and frozen out of the controller's garbage collector (``gc.freeze``): they stand for work a program
    would create as it goes, and hundreds of thousands of them alive at once made each full collection of the
    controller take a quarter of a second. Rate from the first send to the ``Status``
    answer; target: at least 50,000 messages/s. Also the worker-side apply rate (two ``time.perf_counter``
    calls run as messages, first and last, on the worker's stream) and the worker's time in Python's garbage
    collector (``gc.callbacks`` installed with ``client.run``; nothing on the hot path).
(b) the same op through the public ``remote()`` path (fake-tensor propagation on the controller).
(c) a training step of examples/train_digits.py (gradient, ``reduce_`` avg over "dp", in-place SGD update) on a
    2-worker mesh vs the same step (same global batch) in this process.
(h) the round trip of a fetch (``inspect``, ``fetch_shard``) and of a sync, 1 and 2 ranks, p50/p90
    (``bench/latency.py``), against Dask's own direct request to a worker.
(f), (g) compiled functions (``bench/compiled.py``): Monarch's 4096-op chain replayed from one recording vs local
    eager, and the digits step compiled vs local eager and vs a plain torch.distributed script on 2 gloo processes.

Usage::

    python bench/dispatch.py            # full run (about a minute)
    python bench/dispatch.py --quick    # a few seconds of measuring
    python bench/dispatch.py --profile  # also: per-message cost breakdown of a TensorWorker driven in-process
    python bench/dispatch.py --scheduler tcp://host:8786   # an existing cluster with at least 2 workers
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import runpy
import statistics
import time
from pathlib import Path

import torch
from compiled import bench_chain, bench_digits, gloo_digits
from compiled import rows as compiled_rows
from latency import bench_all as bench_latency
from latency import rows as latency_rows

import dask_monarch as dm
from dask_monarch.controller.session import DEFAULT_STREAM
from dask_monarch.protocol import ArgsKwargs, CallFunction, DeleteRefs, FunctionPath, Ref, SendValue

ADD = FunctionPath("torch.ops.aten.add.Tensor")
CLOCK = FunctionPath("time.perf_counter")  # system-wide monotonic clock on Linux: comparable across processes
TARGET = 50_000
CALL_TARGET_US = 40  # issue 13: controller time per eager op / remote() call with cached shapes
PROGRAM_TARGET_S = 0.25  # issue 13: the 2048-iteration chain eager, end to end
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"


DEVICE = "cpu"  # --device: where the tiny ops run (the workers' own GPU with "cuda")


def small_tensor(mesh) -> torch.Tensor:
    return torch.ones(4, device=DEVICE)


def local_add_rate(n: int = 100_000) -> float:
    """Eager baseline: the same op on the same tensors in a loop in this process (ops/s, best of 5; on GPU
    until the device has run them)."""
    a, b, op = torch.ones(4, device=DEVICE), torch.ones(4, device=DEVICE), torch.ops.aten.add.Tensor
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            op(a, b)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        best = max(best, n / (time.perf_counter() - t0))
    return best


# ---------------------------------------------------------------------------------- worker-side GC accounting
def _gc_timer_install() -> None:
    import gc
    import time

    stats = {"collections": [0, 0, 0], "seconds": 0.0, "start": 0.0}

    def callback(phase, info):
        if phase == "start":
            stats["start"] = time.perf_counter()
        else:
            stats["seconds"] += time.perf_counter() - stats["start"]
            stats["collections"][info["generation"]] += 1

    gc.callbacks.append(callback)
    gc._dispatch_bench = (callback, stats)


def _gc_set(enabled: bool) -> bool:
    """Enable or disable the garbage collector of this process; returns whether it was enabled."""
    import gc

    was = gc.isenabled()
    gc.enable() if enabled else gc.disable()
    return was


def _gc_timer_read() -> dict:
    import gc

    callback, stats = gc._dispatch_bench
    gc.callbacks.remove(callback)
    del gc._dispatch_bench
    return {"collections": stats["collections"], "seconds": stats["seconds"], "tracked": len(gc.get_objects())}


# ---------------------------------------------------------------------------------------------------- (a) raw
def raw_round(mesh, a: Ref, b: Ref, n: int, delete_every: int = 1000, worker_gc: bool = True) -> dict:
    """Send ``n`` CallFunction(aten.add) to rank 0, bracketed by two worker-side clock readings. With
    ``worker_gc=False`` the worker's garbage collector is off for the round (a what-if; restored after)."""
    session = mesh._session
    first, last = session.new_ref(), session.new_ref()
    messages = [CallFunction(session.new_seq(), [first], [], CLOCK, ArgsKwargs(), DEFAULT_STREAM, [])]
    pending = []
    for _ in range(n):
        ref = session.new_ref()
        pending.append(ref)
        messages.append(CallFunction(session.new_seq(), [ref], (), ADD, ArgsKwargs((a, b), {}), DEFAULT_STREAM, ()))
        if len(pending) == delete_every:
            messages.append(DeleteRefs(pending))
            pending = []
    messages.append(CallFunction(session.new_seq(), [last], [], CLOCK, ArgsKwargs(), DEFAULT_STREAM, []))
    messages.append(DeleteRefs(pending))
    worker = mesh.workers[0]
    session.client.run(_gc_timer_install, workers=[worker])
    if not worker_gc:
        was_enabled = session.client.run(_gc_set, False, workers=[worker])[worker]

    # the prebuilt messages are the benchmark's, not the controller's: keep them out of the controller's
    # collections (a full collection walks every live object, and these are hundreds of thousands)
    gc.collect()
    gc.freeze()
    try:
        t0 = time.perf_counter()
        for message in messages:
            session.send(message, [0])
        t_sent = time.perf_counter()
        session.sync("raw dispatch").result()
        t1 = time.perf_counter()
    finally:
        gc.unfreeze()

    gc_stats = session.client.run(_gc_timer_read, workers=[worker])[worker]
    if not worker_gc:
        session.client.run(_gc_set, was_enabled, workers=[worker])
    seqs = [session.new_seq(), session.new_seq()]
    for seq, ref in zip(seqs, (first, last)):
        session.send(SendValue(seq, None, [], None, ArgsKwargs((ref,), {}), DEFAULT_STREAM), [0])
    session.send(DeleteRefs([first, last]), [0])
    session.sync("worker clocks").result()
    w0, w1 = (session.take_fetch_result(seq).value for seq in seqs)
    return {
        "e2e": n / (t1 - t0),
        "apply": n / (w1 - w0),
        "send_loop_s": t_sent - t0,
        "first_apply_s": w0 - t0,
        "after_last_s": t1 - w1,
        "gc_share": gc_stats["seconds"] / (t1 - t0),
        "gc": gc_stats,
    }


def bench_raw(mesh, n: int, repeats: int) -> dict:
    a = dm.remote(small_tensor)(mesh)
    b = dm.remote(small_tensor)(mesh)
    raw_round(mesh, a.ref, b.ref, min(n, 10_000))  # warm-up: first batch, function cache, allocator
    rounds = sorted((raw_round(mesh, a.ref, b.ref, n) for _ in range(repeats)), key=lambda r: r["e2e"])
    no_gc = sorted((raw_round(mesh, a.ref, b.ref, n, worker_gc=False) for _ in range(repeats)),
                   key=lambda r: r["e2e"])
    return {"median": rounds[len(rounds) // 2], "rounds": rounds, "no_gc": no_gc[len(no_gc) // 2]}


# ------------------------------------------------------------------------------------------------ (b) remote()
def bench_remote(mesh, n: int, repeats: int) -> dict:
    add = dm.remote(torch.ops.aten.add.Tensor)
    a = dm.remote(small_tensor)(mesh)
    b = dm.remote(small_tensor)(mesh)
    for _ in range(200):
        add(a, b)
    dm.inspect(add(a, b))
    rates, loops = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            add(a, b)  # the result handle dies at once: its ref is freed with the next flush
        t_loop = time.perf_counter()
        mesh._session.sync("remote dispatch").result()
        t1 = time.perf_counter()
        rates.append(n / (t1 - t0))
        loops.append((t_loop - t0) / n)
    return {"rate": statistics.median(rates), "rates": rates, "call_us": statistics.median(loops) * 1e6}


# ----------------------------------------------------------------------------- (d) torch ops under activate()
def bench_dispatch(mesh, n: int, repeats: int) -> dict:
    """``x + x`` under ``mesh.activate()``: the torch-dispatch path (aten op -> CallFunction), per op."""
    with mesh.activate():
        x = torch.ones(4, 4)
        for _ in range(200):
            x + x
        dm.inspect(x + x)
        rates, loops = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(n):
                x + x
            t_loop = time.perf_counter()
            mesh._session.sync("dispatch").result()
            t1 = time.perf_counter()
            rates.append(n / (t1 - t0))
            loops.append((t_loop - t0) / n)
    a = torch.ones(4, 4)
    t0 = time.perf_counter()
    for _ in range(n):
        a + a
    local = n / (time.perf_counter() - t0)
    return {"rate": statistics.median(rates), "call_us": statistics.median(loops) * 1e6, "local": local}


def chain(x: torch.Tensor, n: int) -> torch.Tensor:
    """Monarch's test_many: ``n`` dependent small ops."""
    for i in range(n):
        x = x * 1.0001 + 0.5 if i % 2 else torch.relu(x - 0.25)
    return x


def bench_program(mesh, n: int, repeats: int) -> dict:
    """A program of ``n`` dependent torch ops under ``mesh.activate()``, end to end (through its fetch)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with mesh.activate():
            result = chain(torch.ones(16, 16), n)
        value = dm.inspect(result)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    expected = chain(torch.ones(16, 16), n)
    local = time.perf_counter() - t0
    assert torch.allclose(value, expected), "the mesh computed a different value"
    return {"seconds": statistics.median(times), "local": local, "ops": n}


# ------------------------------------------------------------------------------------- (c) digits train step
LOCAL_STEPS = 100  # case (c)'s local baseline, in the full run and with --quick


def bench_train_step(mesh, steps: int, repeats: int) -> dict:
    """One data-parallel step of the example's MLP (forward, backward, ``reduce_`` of the gradients, SGD) under
    ``mesh.activate()``, against the same step in one local process on the global batch."""
    # run_path, not import: the functions get a module name the workers cannot import, so they travel by value
    # exactly as when the example runs as __main__
    ex = runpy.run_path(str(EXAMPLE), run_name="train_digits_bench")
    batch, lr, seed = 16, 0.1, 0  # the example's defaults
    F = torch.nn.functional

    def step(model, optimizer, x, y, rows, reduce: bool) -> None:
        loss = F.cross_entropy(model(x[rows]), y[rows])
        optimizer.zero_grad()
        loss.backward()
        if reduce:
            dm.reduce_([p.grad for p in model.parameters()], "dp", "avg")
        optimizer.step()

    with mesh.activate():
        with torch.device(DEVICE):
            model = ex["MLP"]()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=ex["MOMENTUM"])
        x, y, _, _ = (t.to(DEVICE) for t in dm.remote(ex["load_shard"], propagate=ex["load_shard_shapes"])(mesh, seed))
        n_rows = x.shape[0]

        def run(count: int, offset: int = 0) -> None:
            for i in range(offset, offset + count):
                start = (i * batch) % (n_rows - batch)
                step(model, optimizer, x, y, slice(start, start + batch), True)

        run(20)
        mesh._session.sync("warm-up").result()
        rates, loops = [], []
        for r in range(repeats):
            t0 = time.perf_counter()
            run(steps, offset=r * steps)
            t_loop = time.perf_counter()
            mesh._session.sync("train steps").result()
            t1 = time.perf_counter()
            rates.append(steps / (t1 - t0))
            loops.append((t_loop - t0) / steps)

    # local: one process, the same model and step on the same global batch (world x batch rows)
    from sklearn.datasets import load_digits

    world = mesh.size("dp")
    digits = load_digits()
    lx = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    ly = torch.tensor(digits.target, dtype=torch.int64)
    lx, ly = lx.to(DEVICE), ly.to(DEVICE)
    with torch.device(DEVICE):
        model = ex["MLP"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=ex["MOMENTUM"])
    global_batch = world * batch
    local_rates = []
    # the baseline does not depend on --quick: LOCAL_STEPS steps, best of 3 rounds, after the mesh's 20 warm-up
    # steps (with --quick's 30 steps and no warm-up, its first rounds timed PyTorch's lazy set-up)
    for r in range(4):
        t0 = time.perf_counter()
        for i in range(20 if r == 0 else LOCAL_STEPS):
            start = (i * global_batch) % (len(ly) - global_batch)
            step(model, optimizer, lx, ly, slice(start, start + global_batch), False)
        if r:
            local_rates.append(LOCAL_STEPS / (time.perf_counter() - t0))
    return {"rate": statistics.median(rates), "rates": rates, "loop_ms": statistics.median(loops) * 1e3,
            "local": max(local_rates), "world": world, "batch": batch}


# ------------------------------------------------------------------------ per-message breakdown (--profile)
def profile_breakdown(n: int) -> list[tuple[str, float | None]]:
    """Per-message costs (microseconds) of a ``TensorWorker`` driven in this process, stage by stage (a row
    whose cost is None is a heading)."""
    from dask_monarch.protocol import CreateStream, RequestStatus, StreamCreationMode, StreamRef
    from dask_monarch.protocol import batch
    from dask_monarch.worker.inbox import load_segment  # how the worker unpickles a segment
    from dask_monarch.worker.tensor_worker import TensorWorker

    stream = StreamRef(0)

    def messages(start_ref: int, seq0: int) -> list:
        out, pending = [], []
        for i in range(n):
            ref = Ref(start_ref + i)
            pending.append(ref)
            out.append(CallFunction(seq0 + i, [ref], [], ADD, ArgsKwargs((Ref(0), Ref(1)), {}), stream, []))
            if len(pending) == 1000:
                out.append(DeleteRefs(pending))
                pending = []
        out.append(DeleteRefs(pending))
        return out

    def segments(msgs: list) -> list:
        return [pickle.dumps(msgs[i:i + 4096], protocol=5) for i in range(0, len(msgs), 4096)]

    def sync() -> None:  # GPU ops are asynchronous: a stage ends when the device has run what it issued
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    def per_msg(fn, reset=None, repeats: int = 3) -> float:
        """Best of ``repeats`` (the machine is shared: the minimum is the cost, the rest is interference)."""
        best = float("inf")
        for _ in range(repeats):
            if reset is not None:
                reset()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
        return best

    def threaded(tag: str, through_dispatcher: bool = False) -> float:
        """The real thing: dispatcher thread + stream thread, batches of 4096 messages through the inbox, framed as
        the controller frames them (``protocol/batch.py``), or, with ``through_dispatcher``, every message
        unpickled and handed over by the dispatcher thread. Best of 3."""
        return min(threaded_once(f"{tag}-{i}", through_dispatcher) for i in range(3))

    def threaded_once(tag: str, through_dispatcher: bool) -> float:
        tw = TensorWorker(None, f"bench-{tag}", 0, 1)
        tw.apply([CreateStream(stream, StreamCreationMode.UseDefaultStream)])
        tw.flush_streams()
        st = tw.streams[0]
        st.env.update({0: small_tensor(None), 1: small_tensor(None)})  # the stream is idle: nothing queued yet
        msgs = messages(10, 0)
        chunks = [msgs[i:i + 4096] for i in range(0, len(msgs), 4096)]
        if through_dispatcher:
            batches = [[pickle.dumps(chunk, protocol=5)] for chunk in chunks]
        else:
            batches = [[seg for _, seg in batch.segments([((0,), m) for m in chunk], pickle.dumps)] for chunk in chunks]
        del msgs, chunks
        t0 = time.perf_counter()
        for i, segs_i in enumerate(batches):
            tw.inbox.put(i, segs_i)
        tw.inbox.put(len(batches), [pickle.dumps([RequestStatus(n, False)])])
        tw.wait_status(n)
        sync()
        us = (time.perf_counter() - t0) / n * 1e6
        tw.close()
        return us

    # inline pieces, one thread
    tw = TensorWorker(None, "bench-inline", 0, 1)
    tw.apply([CreateStream(stream, StreamCreationMode.UseDefaultStream)])
    tw.flush_streams()
    st = tw.streams[0]
    st.stop()
    st.thread.join()
    a, b = small_tensor(None), small_tensor(None)
    segs = segments(messages(10, 0))
    op = torch.ops.aten.add.Tensor

    def fresh_env():
        st.env.clear()
        st.env.update({0: a, 1: b})

    stream_handlers = {CallFunction: st.call_function, DeleteRefs: st.delete_refs}

    def inline_all():
        for seg in segs:
            tw.apply(load_segment(seg))
            items, st.pending = st.pending, []
            for msg in items:
                stream_handlers[type(msg)](msg)

    def stage_costs() -> list:
        """Each stage with the garbage collector off. The message objects live only in this call: a worker holds
        only the batch in flight, and extra live objects would slow every full collection measured later."""
        msgs = [m for seg in segs for m in pickle.loads(seg)]
        calls = [m for m in msgs if type(m) is CallFunction]
        deletes = [m for m in msgs if type(m) is DeleteRefs]

        def apply_no_validate():
            handlers = tw._handlers
            for m in msgs:
                handlers[type(m)](m)
            st.pending.clear()

        def env_with_results():
            fresh_env()
            st.env.update(dict.fromkeys(range(10, 10 + n), a))

        def run_calls():
            for m in calls:
                st.call_function(m)

        def run_deletes():
            for m in deletes:
                st.delete_refs(m)

        return [
            ("  pickle.loads of 4096-message segments (validates)", per_msg(lambda: [pickle.loads(s) for s in segs])),
            ("  dispatcher handler + enqueue on the stream", per_msg(apply_no_validate)),
            ("  StreamWorker.call_function (all of it)", per_msg(run_calls, fresh_env)),
            ("    of which the aten.add.Tensor call itself", per_msg(lambda: [op(a, b) for _ in range(n)])),
            ("  DeleteRefs, amortized", per_msg(run_deletes, env_with_results)),
        ]

    rows = [("GC off: the CPU cost of each stage", None)]
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        rows.extend(stage_costs())
        no_gc = per_msg(inline_all, fresh_env)
        rows.append(("  = all stages inline, one thread", no_gc))
    finally:
        if was_enabled:
            gc.enable()
    gc.collect()
    rows.append(("GC on, as in a worker", None))
    rows.append(("  load_segment (GC paused inside)", per_msg(lambda: [load_segment(s) for s in segs])))
    rows.append(("  plain pickle.loads, for comparison", per_msg(lambda: [pickle.loads(s) for s in segs])))
    with_gc = per_msg(inline_all, fresh_env)
    rows.append(("  all stages inline, one thread", with_gc))
    rows.append(("  -> Python GC share (GC on - GC off)", with_gc - no_gc))
    from dask_monarch import interpreter

    interpreter.hold(gc_threshold=True)  # the settings a worker holds while sessions run
    try:
        rows.append(("  real TensorWorker (interpreter settings as in a worker)", threaded("threaded")))
        rows.append(("  ... what-if: every message through the dispatcher", threaded("dispatcher", True)))
    finally:
        interpreter.release(gc_threshold=True)
    gc.disable()
    try:
        rows.append(("  what-if: real TensorWorker with GC off", threaded("threaded-nogc")))
    finally:
        if was_enabled:
            gc.enable()
    return rows


# ----------------------------------------------------------------------------------------------------- report
class _RawOnly(Exception):
    """--raw-only: leave the session after case (a)."""


def fmt_rate(value: float, unit: str) -> str:
    return f"{value:>11,.0f} {unit}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts, one repeat")
    parser.add_argument("--profile", action="store_true", help="add a per-message breakdown (in-process worker)")
    parser.add_argument("--raw-only", action="store_true", help="only case (a), the raw CallFunction rate")
    parser.add_argument("--profile-only", action="store_true", help="only the per-message breakdown")
    parser.add_argument("--scheduler", default=None, help="address of an existing cluster (default: embedded)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="run the tiny ops of (a) and (b) on the workers' GPUs (and locally on this GPU)")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if args.profile_only:
        print_profile(20_000 if args.quick else 100_000)
        return
    n_raw, n_remote, n_steps, repeats = (20_000, 2_000, 30, 1) if args.quick else (200_000, 10_000, 100, 3)

    from distributed import Client

    from dask_monarch.cluster import start_local_cluster

    cluster = None
    if args.scheduler:
        client = Client(args.scheduler, set_as_default=False)
    else:
        cluster = start_local_cluster(2, silence_logs=40)
        client = Client(cluster, set_as_default=False)
    try:
        with dm.attach(client, dims={"w": 1}) as one:
            raw = bench_raw(one, n_raw, repeats)
            if args.raw_only:
                raise _RawOnly
            rem = bench_remote(one, n_remote, repeats)
            disp = bench_dispatch(one, n_remote, repeats)
            prog = bench_program(one, 2048, repeats)
            chain_figures = bench_chain(one, repeats=repeats)
        with dm.attach(client, dims={"dp": 2}) as two:
            step = bench_train_step(two, n_steps, repeats)
        with dm.attach(client, dims={"dp": 2}) as two:
            digits_figures = bench_digits(two, n_steps, repeats)
        latency_figures = bench_latency(client, 50 if args.quick else 300)
    except _RawOnly:
        pass
    finally:
        client.close()
        if cluster is not None:
            cluster.close()

    local = local_add_rate()
    m, nogc = raw["median"], raw["no_gc"]
    gcs = m["gc"]
    rounds = ", ".join(f"{r['e2e']:,.0f}" for r in raw["rounds"])
    rows = [
        ("(a) raw CallFunction aten.add, 1 worker", fmt_rate(m["e2e"], "msg/s"), fmt_rate(local, "op/s"),
         f"{m['e2e'] / local:.4f}"),
        ("    worker-side apply rate", fmt_rate(m["apply"], "msg/s"), "", f"{m['apply'] / local:.4f}"),
        ("    worker time in Python GC", f"{100 * m['gc_share']:>11.0f} %    of the run "
         f"({'/'.join(map(str, gcs['collections']))} gen0/1/2 collections, {gcs['tracked']:,} objects)", "", ""),
        ("    what-if: worker GC off for the round", fmt_rate(nogc["e2e"], "msg/s"), "",
         f"{nogc['e2e'] / local:.4f}"),
        ("    target >= 50,000 msg/s end to end", f"{'MET' if m['e2e'] >= TARGET else 'NOT MET':>17}   "
         f"(rounds: {rounds} msg/s of "
         f"{n_raw:,} messages; controller send loop {m['send_loop_s']:.2f} s)", "", ""),
        ("    where the time went", f"{m['first_apply_s']:>11.3f} s      to the first message's apply, "
         f"{n_raw / m['apply']:.3f} s applying, {m['after_last_s']:.3f} s from the last apply to the status answer",
         "", ""),
    ]
    if not args.raw_only:
        rows += [
            ("(b) remote(aten.add), 1 worker", fmt_rate(rem["rate"], "op/s"), fmt_rate(local, "op/s"),
             f"{rem['rate'] / local:.4f}"),
            ("    controller time per remote() call", f"{rem['call_us']:>11.0f} us     "
             f"(target <= {CALL_TARGET_US} us: {'MET' if rem['call_us'] <= CALL_TARGET_US else 'NOT MET'})", "", ""),
            ("(c) digits train step, 2 workers", fmt_rate(step["rate"], "step/s"), fmt_rate(step["local"], "step/s"),
             f"{step['rate'] / step['local']:.4f}"),
            ("    controller time per step", f"{step['loop_ms']:>11.2f} ms     (nn.Module + SGD under activate(); "
             f"global batch {step['world']}x{step['batch']} rows; local: the same step in one process, "
             f"{LOCAL_STEPS} steps, best of 3, the same with --quick; mesh: {n_steps} steps, median of {repeats})",
             "", ""),
            ("(d) torch op (x + x) under activate(), 1 worker", fmt_rate(disp["rate"], "op/s"),
             fmt_rate(disp["local"], "op/s"), f"{disp['rate'] / disp['local']:.4f}"),
            ("    controller time per op", f"{disp['call_us']:>11.0f} us     "
             f"(target <= {CALL_TARGET_US} us: {'MET' if disp['call_us'] <= CALL_TARGET_US else 'NOT MET'})", "", ""),
            (f"(e) {prog['ops']}-op program end to end, 1 worker", f"{prog['seconds']:>13.3f} s   ",
             f"{prog['local']:>15.4f} s   ", f"{prog['local'] / prog['seconds']:.4f}"),
            (f"    target <= {PROGRAM_TARGET_S} s", f"{'MET' if prog['seconds'] <= PROGRAM_TARGET_S else 'NOT MET':>17}",
             "", ""),
        ]
        rows += latency_rows(latency_figures)
        rows += compiled_rows(chain_figures, digits_figures, step["local"], gloo_digits(2, n_steps))
    mode = ("quick" if args.quick else "full") + f", tiny ops on {DEVICE}"
    print(f"\ndask_monarch dispatch benchmark ({mode}; torch {torch.__version__}; {os.cpu_count()} cores; "
          f"load average {os.getloadavg()[0]:.1f}; median of {repeats})")
    print(f"{'case':<44}{'through the mesh':>18}{'local eager':>20}{'ratio':>9}")
    for label, mesh_value, local_value, ratio in rows:
        if local_value or ratio:
            print(f"{label:<44}{mesh_value:>18}{local_value:>20}{ratio:>9}")
        else:
            print(f"{label:<44}{mesh_value}")

    if args.profile:
        print_profile(20_000 if args.quick else 100_000)


def print_profile(n: int) -> None:
    print(f"\nper-message cost of a TensorWorker driven in this process (us/msg; CallFunction aten.add on {DEVICE})")
    for label, us in profile_breakdown(n):
        if us is None:
            print(f"  {label}")
        elif us > 0:
            print(f"  {label:<52}{us:>7.2f} us  ({1e6 / us:>9,.0f}/s)")
        else:
            print(f"  {label:<52}{us:>7.2f} us")


if __name__ == "__main__":
    main()
