"""The embedded default cluster that ``dask_monarch.attach()`` starts when given no cluster
(DESIGN.md "The picture"): a Dask scheduler in this process, with its dashboard, and one single-threaded Dask
worker (under its nanny) per rank, one per GPU if there are GPUs, else CPU workers; started and stopped with
the mesh.

Each worker runs in a fresh ``python -m dask spec`` process (``distributed.deploy.subprocess.SubprocessWorker``),
not a ``multiprocessing`` child of this one. ``multiprocessing``'s spawn and forkserver children import the
parent's ``__main__`` again, so a script without ``if __name__ == "__main__":`` would start its cluster again in
every worker and fail ("Nanny failed to start"); these workers never import it. They get this process's Dask
configuration (``DASK_INTERNAL_INHERIT_CONFIG``, as dask-jobqueue passes it) and its environment, and exit
within seconds if this process dies (they lose their scheduler).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import warnings

import dask
import torch
from distributed import Scheduler, SpecCluster
from distributed.deploy.subprocess import SubprocessWorker
from distributed.worker_memory import parse_memory_limit

__all__ = ["WorkerProcess", "default_worker_count", "gpu_sharing_error", "start_local_cluster", "visible_gpus",
           "wait_for_workers"]

logger = logging.getLogger("dask_monarch.cluster")

#: Dask's default dashboard port, taken when it is free
DASHBOARD_PORT = 8787
_CLOSE_GRACE = 5.0  # seconds a worker process gets to close after SIGTERM before it is killed


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` entries (indices or UUIDs); ``[]`` without CUDA."""
    if not torch.cuda.is_available():
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        entries = [e.strip() for e in listed.split(",") if e.strip()]
        return entries[: torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


def default_worker_count() -> int:
    """The number of workers the embedded cluster starts without ``dims``: the visible GPUs, else the CPU
    cores (at least 1)."""
    gpus = visible_gpus()
    return len(gpus) if gpus else max(1, os.cpu_count() or 1)


def gpu_sharing_error(n_workers: int, gpus: list[str]) -> str | None:
    """Why ``n_workers`` ranks cannot run on ``gpus`` (``visible_gpus()``) under NCCL, or None: worker ``i`` takes
    GPU ``i mod len(gpus)``, and NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
    detected")."""
    if not gpus or n_workers <= len(gpus):
        return None
    shared = []
    for g, gpu in enumerate(gpus):
        ranks = list(range(g, n_workers, len(gpus)))
        if len(ranks) > 1:
            shared.append(f"ranks {', '.join(map(str, ranks))} on GPU {gpu}")
    return (
        f"{n_workers} ranks but this machine shows {len(gpus)} GPU{'s' if len(gpus) != 1 else ''} "
        f"(CUDA_VISIBLE_DEVICES={','.join(gpus)}): {'; '.join(shared)} would share a GPU, which NCCL refuses "
        "(\"Duplicate GPU detected\"). Use at most one rank per GPU (dims whose product is at most "
        f"{len(gpus)}), or hide the GPUs (CUDA_VISIBLE_DEVICES=\"\") to run CPU workers with gloo"
    )


class WorkerProcess(SubprocessWorker):
    """A Dask worker (under its nanny) in a fresh ``python -m dask spec`` process, as Dask's ``SubprocessWorker``
    starts it, plus this process's Dask configuration and the environment changes ``env`` (e.g.
    ``CUDA_VISIBLE_DEVICES``), in a session of its own (a Ctrl-C at the terminal reaches the controller, which
    then ends the mesh and stops its workers). ``close`` lets it close for ``_CLOSE_GRACE`` seconds (SIGTERM: the
    nanny closes its worker) before killing what is left."""

    def __init__(self, scheduler: str, *, env: dict | None = None, **kwargs):
        self.env = dict(env or {})
        super().__init__(scheduler, **kwargs)

    async def _start(self) -> None:
        spec = json.dumps({"cls": self.worker_class, "opts": self.worker_kwargs})
        config = dask.config.config
        level = self.worker_kwargs.get("silence_logs")
        if level:  # the nanny's own logs, as LocalCluster's silence_logs does for nannies in its process
            config = dask.config.merge(config, {"logging": {"distributed": logging.getLevelName(level).lower()}})
        # at the end a nanny gives its worker 4 s to close, then kills it with a WARNING ("Worker process still
        # alive after 4.0 seconds, killing"), seen on a loaded machine after every mesh had ended: harmless here
        # (``close`` kills what is left anyway), and it reads like a failure of a normal exit
        config = dask.config.merge(config, {"logging": {"distributed.nanny": "error"}})
        env = {**os.environ, "DASK_INTERNAL_INHERIT_CONFIG": dask.config.serialize(config), **self.env}
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dask", "spec", self.scheduler, "--spec", spec, env=env, start_new_session=True,
        )

    async def close(self) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.process.wait(), _CLOSE_GRACE)
        await super().close()


class _WorkersFirstCluster(SpecCluster):
    """``SpecCluster`` closing its worker processes before its scheduler. ``SpecCluster`` closes the scheduler first,
    and a worker whose heartbeat is in flight then logs "Failed to communicate with scheduler during heartbeat" as
    an ERROR traceback on a normal exit."""

    async def _close(self):
        await asyncio.gather(*(w.close() for w in list(self.workers.values())), return_exceptions=True)
        await super()._close()


def start_local_cluster(n_workers: int, *, silence_logs: int = logging.WARNING,
                        dashboard: str | None = None) -> SpecCluster:
    """A cluster of ``n_workers`` single-threaded worker processes on this machine (``WorkerProcess``), with its
    scheduler in this process listening on 127.0.0.1 and its dashboard on ``dashboard`` (default: 127.0.0.1, on
    Dask's default port 8787, or a free port if that is taken: ``mesh.dashboard_link`` says which). With GPUs, worker ``i`` gets ``CUDA_VISIBLE_DEVICES`` rotated to
    start at GPU ``i`` (as dask-cuda does), so its own GPU is its device 0 and every GPU stays visible. Each
    worker's memory limit is this machine's memory over ``n_workers`` (as ``LocalCluster``'s); ``silence_logs``
    is the level below which Dask's logs are dropped.

    Raises ``ValueError`` (before starting anything) if there are GPUs and fewer of them than ``n_workers``
    (``gpu_sharing_error``). The workers join the scheduler after this returns: ``wait_for_workers``."""
    if type(n_workers) is not int or n_workers < 1:
        raise ValueError(f"n_workers must be a positive int, got {n_workers!r}")
    gpus = visible_gpus()
    problem = gpu_sharing_error(n_workers, gpus)
    if problem:
        raise ValueError(problem)
    host = "127.0.0.1"
    scheduler = {"cls": Scheduler, "options": {
        "host": host, "port": 0, "dashboard": True, "dashboard_address": dashboard or f"{host}:{DASHBOARD_PORT}",
    }}
    options = {
        "nthreads": 1, "host": host, "dashboard": True, "dashboard_address": f"{host}:0",
        "memory_limit": parse_memory_limit("auto", 1, n_workers, logger=logger), "silence_logs": silence_logs,
    }
    workers = {}
    for i in range(n_workers):
        env = {}
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[(i + k) % len(gpus)] for k in range(len(gpus)))
        workers[i] = {"cls": WorkerProcess, "options": {
            "worker_class": "distributed.Nanny", "worker_kwargs": {**options, "name": i}, "env": env,
        }}
    with warnings.catch_warnings():
        # with 8787 taken Dask binds a free port and says so in a UserWarning ("Perhaps you already have a cluster
        # running?"), which reads like a failure; the link printed at attach gives the port
        warnings.filterwarnings("ignore", message=r"Port \d+ is already in use", category=UserWarning)
        return _WorkersFirstCluster(workers=workers, scheduler=scheduler, silence_logs=silence_logs,
                                    name="dask_monarch")


def cluster_workers(client, timeout: float = 30.0) -> dict:
    """The scheduler's workers now, ``{address: info}``, asked of the scheduler (bounded by ``timeout`` seconds).
    Not ``client.scheduler_info()["workers"]``: that returns the Client's cached identity, which the Client's own
    periodic update (every ``scheduler-info-interval``, totals only) may overwrite between the fetch and the return,
    leaving it without workers."""
    return client.sync(client.scheduler.identity, n_workers=-1, callback_timeout=timeout)["workers"]


def wait_for_workers(cluster: SpecCluster, client, n: int, timeout: float) -> None:
    """Wait until ``n`` workers of ``cluster`` (``start_local_cluster``) have joined, at most ``timeout``
    seconds. Raises ``RuntimeError`` at once if a worker process exits first (its output, above, says why), and
    ``TimeoutError`` naming how many joined."""
    deadline = time.monotonic() + timeout
    while True:
        joined = len(cluster_workers(client, timeout))
        if joined >= n:
            return
        exited = {name: w.process.returncode for name, w in list(cluster.workers.items())
                  if getattr(w, "process", None) is not None and w.process.returncode is not None}
        if exited:
            codes = ", ".join(f"worker {name}: exit code {code}" for name, code in sorted(exited.items()))
            raise RuntimeError(
                f"the embedded Dask cluster's worker processes exited before joining ({codes}); their output "
                f"above says why (command: {sys.executable} -m dask spec ...)"
            )
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"the embedded Dask cluster: {joined} of {n} worker processes joined within {timeout:g} s "
                "(timeout=); the machine may be overloaded"
            )
        time.sleep(0.1)
