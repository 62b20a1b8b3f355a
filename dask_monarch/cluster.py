"""The embedded default cluster that ``dask_monarch.attach()`` starts when given no cluster
(DESIGN.md "The picture"): a Dask scheduler, with its dashboard, and one single-threaded Dask worker (under its
nanny) per rank, one per GPU if there are GPUs, else CPU workers; started and stopped with the mesh.

The scheduler runs in a process of its own (``SchedulerProcess``), not in this one: a scheduler in the controller's
process shares its GIL with the script's eager loop, and each took time from the other (issue 23: an eager op cost
37 to 49 us at 1 rank on an in-process scheduler against 27 to 33 us on an external one). It closes itself if this
process dies without closing it (``dask_monarch.scheduler.parent_watch``).

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
import shutil
import sys
import tempfile
import time
import warnings

import dask
import torch
from distributed import Scheduler, SpecCluster
from distributed.deploy.subprocess import Subprocess, SubprocessWorker
from distributed.worker_memory import parse_memory_limit

__all__ = ["SchedulerProcess", "WorkerProcess", "default_worker_count", "gpu_sharing_error", "start_local_cluster", "visible_gpus",
           "wait_for_workers"]

logger = logging.getLogger("dask_monarch.cluster")

#: Dask's default dashboard port, taken when it is free
DASHBOARD_PORT = 8787
_CLOSE_GRACE = 5.0  # seconds a worker or scheduler process gets to close after SIGTERM before it is killed
_SCHEDULER_START = 60.0  # seconds the scheduler process gets to write its scheduler file (imports under load)


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
        # at the end a nanny gives its worker 4 s to close, then kills it with a WARNING ("Worker process still
        # alive after 4.0 seconds, killing"), seen on a loaded machine after every mesh had ended: harmless here
        # (``close`` kills what is left anyway), and it reads like a failure of a normal exit
        env = _child_env(self.worker_kwargs.get("silence_logs"), {"distributed.nanny": "error"}, self.env)
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dask", "spec", self.scheduler, "--spec", spec, env=env, start_new_session=True,
        )

    async def close(self) -> None:
        await _terminate(self.process)
        await super().close()


def _child_env(level: int | None, loggers: dict, env: dict) -> dict:
    """The environment of a ``python -m dask spec`` child: this process's, with its Dask configuration
    (``DASK_INTERNAL_INHERIT_CONFIG``), Dask's logs below ``level`` dropped (as ``LocalCluster``'s
    ``silence_logs`` does in its process), the log levels ``loggers`` and the changes ``env``."""
    config = dask.config.config
    if level:
        config = dask.config.merge(config, {"logging": {"distributed": logging.getLevelName(level).lower()}})
    config = dask.config.merge(config, {"logging": loggers})
    return {**os.environ, "DASK_INTERNAL_INHERIT_CONFIG": dask.config.serialize(config), **env}


async def _terminate(process) -> None:
    """SIGTERM ``process`` (a ``python -m dask spec`` child, which then closes what it runs) and wait up to
    ``_CLOSE_GRACE`` seconds; ``Subprocess.close`` kills what is left after."""
    if process is not None and process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(process.wait(), _CLOSE_GRACE)


class SchedulerProcess(Subprocess):
    """A Dask scheduler in a fresh ``python -m dask spec`` process (as Dask's ``SubprocessScheduler`` starts one),
    with this process's Dask configuration and environment, in a session of its own, and the preload
    ``dask_monarch.scheduler.parent_watch`` (it closes itself if this process dies without closing it).
    ``scheduler_kwargs`` are ``distributed.Scheduler``'s (JSON values). Its address is read from the scheduler
    file it writes (a temporary directory, removed at ``close``); ``start`` raises ``RuntimeError`` if the
    process exits first or writes none within ``timeout`` seconds. Unlike ``SubprocessScheduler`` its output is
    not piped (an unread pipe would stop a scheduler that logs a lot once the pipe is full)."""

    def __init__(self, scheduler_kwargs: dict | None = None, *, silence_logs: int | None = None,
                 timeout: float = _SCHEDULER_START):
        self.scheduler_kwargs = dict(scheduler_kwargs or {})
        self.silence_logs = silence_logs
        self.timeout = timeout
        self.address = None
        self._dir = None
        super().__init__()

    async def _start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="dask-monarch-scheduler-")
        path = os.path.join(self._dir, "scheduler.json")
        # given ``preload``, the Scheduler ignores ``distributed.scheduler.preload``: keep the configured ones
        preload = self.scheduler_kwargs.get("preload") or dask.config.get("distributed.scheduler.preload") or []
        preload = [preload] if isinstance(preload, str) else list(preload)
        preload.append("dask_monarch.scheduler.parent_watch")
        opts = {**self.scheduler_kwargs, "scheduler_file": path, "preload": preload}
        spec = json.dumps({"cls": "distributed.Scheduler", "opts": opts})
        env = _child_env(self.silence_logs, {}, {})
        port = str(self.scheduler_kwargs.get("dashboard_address", "")).rpartition(":")[2]
        if port.isdigit():
            # with the port taken Dask binds a free one and says so in a UserWarning ("Perhaps you already have a
            # cluster running?"), which reads like a failure; the link printed at attach gives the port
            env["PYTHONWARNINGS"] = ",".join(
                filter(None, [env.get("PYTHONWARNINGS"), f"ignore:Port {port} is already in use:UserWarning"]))
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dask", "spec", "--spec", spec, env=env, start_new_session=True,
        )
        deadline = time.monotonic() + self.timeout
        while True:
            with contextlib.suppress(OSError, json.JSONDecodeError, KeyError):  # not there yet, or half written
                with open(path) as f:
                    self.address = json.load(f)["address"]
                return
            if self.process.returncode is not None:
                raise RuntimeError(
                    f"the embedded Dask cluster's scheduler process exited with code {self.process.returncode} "
                    f"before it started; its output above says why (command: {sys.executable} -m dask spec ...)"
                )
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"the embedded Dask cluster's scheduler process wrote no address within {self.timeout:g} s; the "
                    "machine may be overloaded"
                )
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await _terminate(self.process)
        await super().close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


class _WorkersFirstCluster(SpecCluster):
    """``SpecCluster`` closing its worker processes before its scheduler. ``SpecCluster`` closes the scheduler first,
    and a worker whose heartbeat is in flight then logs "Failed to communicate with scheduler during heartbeat" as
    an ERROR traceback on a normal exit."""

    async def _close(self):
        await asyncio.gather(*(w.close() for w in list(self.workers.values())), return_exceptions=True)
        await super()._close()


def start_local_cluster(n_workers: int, *, silence_logs: int = logging.WARNING,
                        dashboard: str | None = None, scheduler_process: bool = True) -> SpecCluster:
    """A cluster of ``n_workers`` single-threaded worker processes on this machine (``WorkerProcess``), with its
    scheduler in a process of its own (``SchedulerProcess``; ``scheduler_process=False``: in this process, as
    before issue 23, for comparisons) listening on 127.0.0.1 and its dashboard on ``dashboard`` (default: 127.0.0.1, on
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
    scheduler_kwargs = {
        "host": host, "port": 0, "dashboard": True, "dashboard_address": dashboard or f"{host}:{DASHBOARD_PORT}",
    }
    if scheduler_process:
        scheduler = {"cls": SchedulerProcess, "options": {"scheduler_kwargs": scheduler_kwargs,
                                                          "silence_logs": silence_logs}}
    else:
        scheduler = {"cls": Scheduler, "options": scheduler_kwargs}
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
