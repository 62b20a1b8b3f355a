"""The plain ``torch.distributed`` baselines of the benchmarks (``allreduce.py``, ``train_lm.py``, ``compiled.py``):
one spawned process per rank in a default process group, as a script started by ``torchrun`` would have: NCCL with
one GPU per process, or gloo on CPU."""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _main(target, rank: int, world: int, port: int, args: tuple, queue, backend: str = "nccl") -> None:
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=300))
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        result = target(rank, world, *args)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        queue.put(result)


def gpu_world() -> int:
    """The number of visible GPUs; exits with a message below the 2 a collective benchmark needs."""
    world = torch.cuda.device_count()
    if world < 2:
        raise SystemExit(f"needs at least 2 CUDA devices, found {world}")
    return world


def run_ranks(target, world: int, args: tuple = (), timeout: float = 1200.0, backend: str = "nccl"):
    """Run ``target(rank, world, *args)`` in ``world`` spawned processes, each in the default process group of
    ``backend`` (NCCL: one GPU per process; gloo: CPU); return rank 0's result (waited for at most ``timeout``
    seconds). ``target`` must be a module-level function."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_main, args=(target, r, world, port, args, queue, backend)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(60)
