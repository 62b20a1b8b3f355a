"""Point-to-point bandwidth of ``to_mesh`` (``SendTensor``) against raw ``torch.distributed`` ``send``/``recv``
between two processes, measured in one run (issue 16; DESIGN.md "Performance design").

Raw: two spawned processes in a default process group (gloo on CPU, NCCL with one GPU each), rank 0 ``send``s a
float32 tensor to rank 1 in a loop, which ``recv``s it into one preallocated buffer (``raw (1)``) or into a new
tensor each time (``raw (new)``, what ``to_mesh`` does: its result is a new tensor; on CPU a large new tensor is
fresh memory whose pages fault in on first write); timed from the barrier before the loop to its end, the slower
rank counting; the two kinds alternate round by round. dask_monarch: an embedded cluster of two workers, the
mesh ``{"x": 2}`` cut into its two one-rank sub-meshes, and ``t.to_mesh(dst)`` of a tensor of ``src`` issued back
to back through the public API (each copy dropped as soon as the next is made), timed from the first ``to_mesh``
until a fetch of the last copy's first element returns (the Dask hops to the workers and back are inside it).
Both sides make the same number of transfers per size (about 1 s of them, calibrated on the raw side); 3 rounds
each, median. Bandwidth is bytes per transfer / time per transfer.

    python bench/send.py                    # gloo, CPU workers: 1, 4, 16, 64 MiB
    python bench/send.py --device cuda      # NCCL, 2 GPUs: 1 MiB to 1 GiB
    python bench/send.py --quick            # about 0.25 s of transfers per size and side
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from _torchrun import gpu_world, run_ranks

SIZES_MIB = {"cpu": [1, 4, 16, 64], "cuda": [1, 4, 16, 64, 256, 1024]}
ROUNDS = 3  # timed rounds per size and side; the median is reported


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _exchange(rank: int, x, n: int, fresh: bool = False) -> None:
    """``n`` transfers of ``x`` from rank 0 to rank 1: into ``x`` itself, or (``fresh``) into a new tensor each."""
    peer = 1 - rank
    for _ in range(n):
        if rank == 0:
            dist.send(x, peer)
        else:
            dist.recv(torch.empty_like(x) if fresh else x, peer)


def _raw_worker(rank: int, world: int, sizes, device: str, seconds: float) -> dict:
    results = {}
    for mib in sizes:
        x = torch.ones(mib << 18, device=device)  # float32: 4 bytes each
        _exchange(rank, x, 3)
        _sync(device)
        each = float("inf")
        for _ in range(3):  # the fastest of 3 calibrations
            dist.barrier()
            t0 = time.perf_counter()
            _exchange(rank, x, 5)
            _sync(device)
            each = min(each, (time.perf_counter() - t0) / 5)
        n = torch.tensor([max(10, int(seconds / each))], device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)  # both ranks make the same number of transfers
        n = int(n.item())
        rounds = {False: [], True: []}
        for _ in range(ROUNDS):  # the two kinds alternate, so that a change in the machine's load hits both
            for fresh in (False, True):
                dist.barrier()
                t0 = time.perf_counter()
                _exchange(rank, x, n, fresh)
                _sync(device)
                rounds[fresh].append((time.perf_counter() - t0) / n)
        t = torch.tensor([statistics.median(rounds[False]), statistics.median(rounds[True])], dtype=torch.float64,
                         device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slower side: the receiver's loop ends last
        results[mib] = (float(t[0]), float(t[1]), n)
        if rank == 1:
            for fresh, what in ((False, "into one buffer"), (True, "into a new tensor each")):
                print(f"  raw {mib} MiB: {ROUNDS} x {n} send/recv {what}, us each: "
                      + ", ".join(f"{r * 1e6:.0f}" for r in rounds[fresh]), flush=True)
    return results


def raw(sizes, device: str, seconds: float) -> dict:
    backend = "nccl" if device == "cuda" else "gloo"
    return run_ranks(_raw_worker, 2, (sizes, device, seconds), timeout=900, backend=backend)


def through_to_mesh(sizes, device: str, iterations: dict) -> dict:
    import dask_monarch as dm

    results = {}
    with dm.attach(dims={"x": 2}, comm_timeout=300) as mesh:
        src, dst = mesh.slice(x=slice(0, 1)), mesh.slice(x=slice(1, 2))
        for mib in sizes:
            with src.activate():
                t = torch.ones(mib << 18, device=device)
            for _ in range(3):  # BackendNetworkPointToPointInit and the first transfers
                copy = t.to_mesh(dst)
            dm.inspect(copy[:1])
            del copy
            n = iterations[mib]
            rounds = []
            for _ in range(ROUNDS):
                t0 = time.perf_counter()
                for _ in range(n):
                    copy = t.to_mesh(dst)  # the previous copy is dropped here (DeleteRefs)
                dm.inspect(copy[:1])  # waits until both ranks have passed the last transfer
                rounds.append(time.perf_counter() - t0)
                del copy
            results[mib] = statistics.median(rounds) / n
            print(f"  to_mesh {mib} MiB: {ROUNDS} x {n} transfers, us each: "
                  + ", ".join(f"{r / n * 1e6:.0f}" for r in rounds), flush=True)
            del t
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu: gloo between CPU workers; cuda: NCCL between 2 GPUs")
    parser.add_argument("--quick", action="store_true", help="about 0.25 s of transfers per size and side")
    parser.add_argument("--sizes", type=int, nargs="*", default=None, help="sizes in MiB (default: by device)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        gpu_world()
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU workers (and a CPU raw side) also on a GPU machine
    sizes = args.sizes or SIZES_MIB[args.device]
    seconds = 0.25 if args.quick else 1.0
    base = raw(sizes, args.device, seconds)
    ours = through_to_mesh(sizes, args.device, {mib: n for mib, (_, _, n) in base.items()})
    backend = "NCCL" if args.device == "cuda" else "gloo"
    what = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"\npoint-to-point bandwidth between 2 processes, {backend} on {what}, float32 "
          f"(torch {torch.__version__}); median of {ROUNDS} rounds on each side; raw (1): recv into one buffer, "
          f"raw (new): recv into a new tensor each time, as to_mesh does")
    print(f"{'size':>9}{'transfers':>11}{'raw (1)':>12}{'raw (new)':>14}{'to_mesh':>12}{'/ raw (1)':>11}"
          f"{'/ raw (new)':>13}")
    for mib in sizes:
        t_raw, t_fresh, n = base[mib]
        b_raw, b_fresh, b_ours = ((mib << 20) / t / 1e9 for t in (t_raw, t_fresh, ours[mib]))
        print(f"{mib:>6} MiB{n:>11}{b_raw:>7.2f} GB/s{b_fresh:>9.2f} GB/s{b_ours:>7.2f} GB/s{b_ours / b_raw:>11.3f}"
              f"{b_ours / b_fresh:>13.3f}")


if __name__ == "__main__":
    main()
