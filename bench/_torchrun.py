"""The plain ``torch.distributed`` baseline of the GPU benchmarks (``allreduce.py``, ``train_lm.py``): one
spawned process per GPU with an NCCL process group, as a script started by ``torchrun`` would have."""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _main(target, rank: int, world: int, port: int, args: tuple, queue) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=torch.device("cuda", rank))
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


def run_ranks(target, world: int, args: tuple = (), timeout: float = 1200.0):
    """Run ``target(rank, world, *args)`` in ``world`` spawned processes, one per GPU, each in the NCCL default
    process group; return rank 0's result (waited for at most ``timeout`` seconds). ``target`` must be a
    module-level function."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_main, args=(target, r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(60)
