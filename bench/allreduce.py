"""All-reduce bus bandwidth through dask_monarch's ``Reduce`` against raw ``torch.distributed`` NCCL, measured in
one run on the same GPUs (issue 4; DESIGN.md "Performance design").

Raw: one process per GPU, ``init_process_group("nccl")``, ``all_reduce`` in a loop. dask_monarch: an embedded
cluster of one worker per GPU, a tensor on each worker's GPU, and in-place ``Reduce`` messages sent back to back
(the message is built once, so the collective path, not the controller, is what is timed). Two figures: end to
end (from the first send until the status request after the last ``Reduce`` is answered, after a fetch that waited
for the GPU: it includes the Dask hops to and from the workers) and the GPU span (CUDA events recorded on rank 0's
stream by ``CallFunction`` messages before the first and after the last ``Reduce``: gaps between collectives, when
the worker cannot issue them as fast as the GPUs run them, are inside it). Bus bandwidth is
``2 (n - 1) / n * bytes / time``, as nccl-tests report it.

    python bench/allreduce.py            # 1 MiB to 1 GiB on every visible GPU
    python bench/allreduce.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from _torchrun import gpu_world, run_ranks

SIZES_MIB = [1, 4, 16, 64, 256, 1024]
ROUNDS = 3  # timed rounds per size and side; the median is reported


def _iters(seconds_each: float, quick: bool) -> int:
    """Enough iterations for about 0.25 s (quick) or 1 s of collectives, so that the one fetch that ends a
    dask_monarch run (a few milliseconds through Dask) is a small part of it."""
    return max(20, int((0.25 if quick else 1.0) / seconds_each))


def _raw_worker(rank: int, world: int, sizes, quick: bool) -> dict:
    results = {}
    for mib in sizes:
        x = torch.ones(mib << 18, device="cuda")  # float32: 4 bytes each
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        each = float("inf")
        for _ in range(3):  # the fastest of 3 calibrations: a hiccup in one would make the timed rounds too short
            t0 = time.perf_counter()
            for _ in range(10):
                dist.all_reduce(x)
            torch.cuda.synchronize()
            each = min(each, (time.perf_counter() - t0) / 10)
        n = torch.tensor([_iters(each, quick)], device="cuda")
        dist.all_reduce(n, op=dist.ReduceOp.MAX)  # every rank must run the same number of collectives
        n = int(n.item())
        rounds = []
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(x)
            torch.cuda.synchronize()
            rounds.append((time.perf_counter() - t0) / n)
        results[mib] = (statistics.median(rounds), n)
        if rank == 0:
            each = ", ".join(f"{t * 1e6:.1f}" for t in rounds)
            print(f"  raw {mib} MiB: {ROUNDS} x {n} all-reduces, us each: {each}", flush=True)
    return results


def raw(world: int, sizes, quick: bool) -> dict:
    return run_ranks(_raw_worker, world, (sizes, quick), timeout=900)


def _cuda_mark():
    """A timing event recorded on the worker's current stream (run by ``CallFunction``)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _span_s(start, end) -> float:
    """Seconds of GPU time between two ``_cuda_mark`` events (run by ``SendValue``)."""
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def through_reduce(world: int, sizes, iterations: dict) -> dict:
    import dask_monarch as dm
    from dask_monarch.controller.remote import function_of
    from dask_monarch.controller.session import DEFAULT_STREAM
    from dask_monarch.protocol import ArgsKwargs, CallFunction, DeleteRefs, Factory, Reduce, Reduction, SendValue

    results = {}
    with dm.attach(dims={"gpu": world}, comm_timeout=300) as mesh:
        session, ranks = mesh._session, mesh._rank_list
        mark, span = function_of(_cuda_mark), function_of(_span_s)
        for mib in sizes:
            with mesh.activate():
                x = torch.ones(mib << 18, device="cuda")
                x.reduce_("gpu", "sum")  # BackendNetworkInit, SplitComm, and a first collective
            dm.inspect(x[:1])
            msg = Reduce(x.ref, x.ref, Factory((mib << 18,), torch.float32, torch.strided, x.device),
                         mesh.define_remotely(), DEFAULT_STREAM, ["gpu"], Reduction.Sum, False, True, None)
            for _ in range(5):
                session.send(msg, ranks)
            n = iterations[mib]
            rounds, spans = [], []
            for _ in range(ROUNDS):
                start, end = session.new_ref(), session.new_ref()
                t0 = time.perf_counter()
                session.send(CallFunction(session.new_seq(), [start], [], mark, ArgsKwargs(), DEFAULT_STREAM, []), ranks)
                for _ in range(n):
                    session.send(msg, ranks)
                session.send(CallFunction(session.new_seq(), [end], [], mark, ArgsKwargs(), DEFAULT_STREAM, []), ranks)
                seq = session.new_seq()
                session.send(SendValue(seq, None, [], span, ArgsKwargs((start, end), {}), DEFAULT_STREAM), [0])
                session.send(DeleteRefs([start, end]), ranks)
                session.sync("all-reduce round").result()  # after the span's fetch: the GPU is done
                rounds.append(time.perf_counter() - t0)
                spans.append(session.take_fetch_result(seq).value)
            results[mib] = (statistics.median(rounds) / n, statistics.median(spans) / n)
            each = ", ".join(f"{t:.3f} ({g:.3f})" for t, g in zip(rounds, spans))
            print(f"  dask_monarch {mib} MiB: {ROUNDS} x {n} reduces, s each end to end (GPU span): {each}", flush=True)
            del x
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations, sizes up to 256 MiB")
    args = parser.parse_args(argv)
    world = gpu_world()
    sizes = SIZES_MIB[:-1] if args.quick else SIZES_MIB
    base = raw(world, sizes, args.quick)
    ours = through_reduce(world, sizes, {mib: n for mib, (_, n) in base.items()})
    factor = 2 * (world - 1) / world
    print(f"\nall-reduce bus bandwidth, {world} x {torch.cuda.get_device_name(0)}, float32, in place "
          f"(torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))})")
    print(f"dask_monarch: back-to-back Reduce messages; 'end to end' from the first send to the answer of the status "
          f"request after them, 'GPU span' between CUDA events recorded on rank 0's stream before the first and after "
          f"the last Reduce; median of {ROUNDS} rounds on each side")
    print(f"{'size':>9}{'iters':>7}{'raw torch.distributed':>23}{'Reduce end to end':>19}{'ratio':>7}"
          f"{'GPU span':>13}{'ratio':>7}")
    for mib in sizes:
        nbytes = mib << 20
        t_raw, n = base[mib]
        t_ours, t_steady = ours[mib]
        b_raw, b_ours, b_steady = (factor * nbytes / t / 1e9 for t in (t_raw, t_ours, t_steady))
        print(f"{mib:>6} MiB{n:>7}{b_raw:>17.1f} GB/s{b_ours:>13.1f} GB/s{b_ours / b_raw:>7.3f}"
              f"{b_steady:>8.1f} GB/s{b_steady / b_raw:>7.3f}")


if __name__ == "__main__":
    main()
