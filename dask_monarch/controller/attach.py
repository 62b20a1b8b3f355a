"""``dask_monarch.attach``: connect a controller to a Dask cluster and get a ``DeviceMesh`` (spec §1 "Mesh").

Ranks are assigned deterministically: workers sorted by host, then port. The controller registers dask_monarch's
``SchedulerPlugin`` (rendezvous store, sessions) and ``WorkerPlugin`` (tensor workers) at once; both are idempotent,
so several controllers can share a cluster. On a cluster that never ran a session, loading them imports
dask_monarch and torch in the scheduler and in every worker, and the controller's first session imports
``torch._dynamo`` (its ``FakeTensorMode``): these overlap (``_register``, ``_warm_up``) instead of following each
other. ``Session.attach_phases`` keeps the seconds each step took (also logged at DEBUG by logger
``dask_monarch.controller``; ``bench/attach.py`` prints them).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import sys
import threading
import time
from collections.abc import Mapping

from distributed import Client
from distributed.comm import get_address_host_port
from torch._subclasses.fake_tensor import FakeTensorMode

from ..cluster import cluster_workers, default_worker_count, start_local_cluster, wait_for_workers
from ..protocol import Slice
from ..protocol.session_id import new_session_id
from ..scheduler import MonarchSchedulerPlugin
from ..worker import MonarchWorkerPlugin
from ..worker.device import gpu_of_worker
from .at_exit import forget, remember
from .mesh import DeviceMesh
from .security import check_security, warn_if_unencrypted
from .liveness import scheduler_gone
from .session import Session, _local_ranks

__all__ = ["attach"]

logger = logging.getLogger("dask_monarch.controller")


def _sort_key(address: str):
    try:
        host, port = get_address_host_port(address)
    except Exception:
        return (address, 0)
    return (host, port)


def _check_dims(dims) -> tuple[list, list]:
    """``(names, sizes)`` of ``dims``: a mapping of names to sizes, or a sequence of ``(name, size)`` pairs."""
    bad = TypeError(f"dims must be a mapping of dimension names to sizes, e.g. {{'dp': 2, 'tp': 2}}, got {dims!r}")
    if isinstance(dims, Mapping):
        items = list(dims.items())
    elif isinstance(dims, (str, bytes)) or not hasattr(dims, "__iter__"):
        raise bad
    else:
        items = list(dims)
        if any(isinstance(item, (str, bytes)) or not isinstance(item, (tuple, list)) or len(item) != 2
               for item in items):
            raise bad  # ("dp", "tp") is not ({"d": "p"}, {"t": "p"})
        if len({name for name, _ in items}) != len(items):
            raise ValueError(f"dims: a dimension name appears twice in {dims!r}")
    names, sizes = [], []
    for name, size in items:
        if not isinstance(name, str) or not name:
            raise ValueError(f"dims: dimension names must be non-empty strings, got {name!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"dims: size of {name!r} must be a positive int, got {size!r}")
        names.append(name)
        sizes.append(size)
    if not names:
        raise ValueError("dims: give at least one dimension, e.g. {'workers': 2}")
    return names, sizes


def _check_seconds(name: str, value) -> float:
    """A positive, finite number of seconds; every wait of a session is bounded by one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _check_workers(workers) -> list:
    if isinstance(workers, (str, bytes)) or not hasattr(workers, "__iter__"):
        raise TypeError(f"workers must be a list of Dask worker addresses, got {workers!r}")
    workers = list(workers)
    if not workers:
        raise ValueError("workers: give at least one Dask worker address (or leave workers out to use them all)")
    bad = [w for w in workers if not isinstance(w, str)]
    if bad:
        raise TypeError(f"workers must be Dask worker addresses (strings), got {bad!r}")
    return workers


def shared_gpus(devices: list, workers: list) -> str:
    """Which ranks would share a GPU, as text ('' if none): ``devices`` has, per rank, the GPU its tensor worker
    would take (``worker.device.gpu_identity``: ``{"uuid", "name", "index"}``) or None for a CPU worker."""
    by_gpu: dict = {}
    for rank, device in enumerate(devices):
        if device:
            by_gpu.setdefault(device["uuid"], []).append(rank)
    shared = []
    for uuid_, ranks in by_gpu.items():
        if len(ranks) > 1:
            d = devices[ranks[0]]
            where = ", ".join(f"rank {r} ({workers[r]}, cuda:{devices[r]['index']})" for r in ranks)
            shared.append(f"{where} would all use GPU {uuid_} ({d['name']})")
    return "; ".join(shared)


def _check_gpus(client, workers: list, timeout: float) -> None:
    """Refuse ranks that would share a GPU under NCCL ("Duplicate GPU detected" after the workers started), asking
    each worker which GPU its rank would take (bounded by ``timeout``)."""
    local = dict(zip(workers, _local_ranks(workers)))
    answers = client.run(gpu_of_worker, local, workers=list(workers), on_error="return", callback_timeout=timeout)
    devices = [answers.get(w) if isinstance(answers.get(w), dict) else None for w in workers]
    problem = shared_gpus(devices, workers)
    if problem:
        raise ValueError(
            f"workers: {problem}. NCCL refuses two ranks of one communicator on one GPU (\"Duplicate GPU "
            "detected\"): give each rank its own GPU (one Dask worker per GPU, e.g. CUDA_VISIBLE_DEVICES=i or "
            "dask cuda worker), or choose fewer workers (workers=[...])"
        )
def _connect(cluster, security, timeout: float) -> Client:
    """A ``Client`` of ``cluster`` (an address or a cluster object) with ``security``; a ``tls://`` address
    without TLS settings gets an error that says how to give them."""
    options = {} if security is None else {"security": security}
    try:
        return Client(cluster, set_as_default=False, timeout=timeout, **options)
    except TypeError as e:
        address = cluster if isinstance(cluster, str) else getattr(cluster, "scheduler_address", "")
        if security is None and str(address).startswith("tls://"):
            raise TypeError(
                f"cannot connect to {address} without TLS settings ({e}): pass security=distributed.Security("
                "tls_ca_file=..., tls_client_cert=..., tls_client_key=...), or set Dask's distributed.comm.tls "
                "config"
            ) from None
        raise


async def _register(client) -> None:
    """Register dask_monarch's plugins at once: the worker plugin first (the scheduler passes it on without loading
    it, and each worker imports dask_monarch and torch as it loads it), then the scheduler's (which the scheduler
    imports on its event loop): on a cold cluster the scheduler's import overlaps the workers' instead of coming
    before them. Raises the scheduler plugin's error first."""
    workers = asyncio.ensure_future(client._register_worker_plugin(
        MonarchWorkerPlugin(), name=MonarchWorkerPlugin.name, idempotent=True))
    await asyncio.sleep(0)  # its request goes out first
    scheduler = asyncio.ensure_future(client._register_scheduler_plugin(
        MonarchSchedulerPlugin(), name=MonarchSchedulerPlugin.name, idempotent=True))
    await asyncio.wait([workers, scheduler])
    scheduler.result()
    workers.result()


def _register_plugins(client, timeout: float) -> None:
    """Register the scheduler's and the workers' plugins (``_register``), both idempotent. Raises ``RuntimeError``
    if the scheduler cannot import dask_monarch, and a worker plugin's error as Dask raises it."""
    try:
        client.sync(_register, client)
    except (ImportError, ModuleNotFoundError, AttributeError) as e:
        raise RuntimeError(
            f"the Dask scheduler at {client.scheduler.address} cannot load dask_monarch ({e}); install "
            "dask_monarch in the scheduler's environment"
        ) from None


#: seconds attach waits for the controller's warm-up (``_warm_up``) before it goes on (the session's first
#: ``FakeTensorMode`` then waits for the same import, under its module lock)
WARM_UP_JOIN = 120.0


def _warm_up() -> threading.Thread | None:
    """A thread that makes this process's first ``FakeTensorMode`` (the session's output metadata, ``Session``),
    whose first instance imports ``torch._dynamo`` (seconds), while attach waits for the cluster; None if it was
    made before."""
    if "torch._dynamo" in sys.modules:
        return None
    thread = threading.Thread(target=FakeTensorMode, name="monarch-warm-up", daemon=True)
    thread.start()
    return thread


#: the keyword arguments attach passes on to ``Session``
_SESSION_OPTIONS = frozenset(inspect.signature(Session.__init__).parameters) - {"self", "client", "workers", "comm_timeout", "session_id"}


def attach(cluster=None, *, dims=None, workers=None, comm_timeout: float = 300.0, timeout: float = 60.0,
           security=None, **session_options) -> DeviceMesh:
    """Attach this program (the controller) to a Dask cluster and return its ``DeviceMesh``.

    ``cluster`` (or ``client=``): a ``distributed.Client``, a scheduler address (``"tcp://host:8786"``), a cluster object with
    ``scheduler_address``, or ``None`` for the embedded default (``dask_monarch.cluster``: a scheduler in this
    process with its dashboard on port 8787 if free, and one worker process per GPU, else one per CPU core, or
    ``prod(dims)`` workers, which never import this program's ``__main__``, so a script needs no main guard;
    the ``/monarch`` page's link is printed once, to stderr; stopped by ``mesh.exit()``).
    ``dims``: ordered mapping of dimension names to sizes whose product is the number of workers used
    (default ``{"workers": n}``). ``workers``: the worker addresses to use, in rank order (default: every
    worker, sorted by host then port; with ``dims``, the first ``prod(dims)``).
    ``security``: a ``distributed.Security`` for connecting to a scheduler address or cluster object (TLS; a
    ``Client`` brings its own: ``ValueError`` with one; ``TypeError`` for anything but a ``Security``, and for a
    ``tls://`` address without TLS settings). On a TLS cluster attach warns once per process that the
    collectives between workers (gloo, NCCL) are not encrypted (``UnencryptedCommsWarning``,
    ``controller/security.py``; Dask config ``monarch.warn-unencrypted-comms: false`` silences it).
    ``comm_timeout`` (seconds) bounds rendezvous and collectives on the workers; ``timeout`` (seconds) bounds
    waiting for enough workers. Other keyword arguments go to ``Session``, e.g. ``heartbeat_timeout`` (seconds,
    default 30): a mesh worker silent that long (stopped, hung) fails the session, naming it.

    A session still open when the interpreter exits (no ``with``, no ``exit()``: a notebook's last cell) is ended
    then as ``mesh.exit()`` ends it.

    Raises ``ValueError``/``TypeError`` for bad ``dims``/``workers``/timeouts (naming them), ``ValueError`` before
    starting anything when two ranks would share a GPU (NCCL refuses that; the text names the ranks and the GPU),
    ``TimeoutError`` if too few workers join in time, and ``RuntimeError`` if the scheduler cannot import
    dask_monarch or an embedded worker process exits while starting.
    """
    if "client" in session_options:  # attach(client=c), as Dask's own APIs name it
        if cluster is not None:
            raise TypeError("attach() got both cluster and client=; pass the Client once")
        cluster = session_options.pop("client")
    unknown = sorted(set(session_options) - _SESSION_OPTIONS)
    if unknown:
        what = f"an unexpected keyword argument {unknown[0]!r}" if len(unknown) == 1 else (
            f"unexpected keyword arguments {', '.join(map(repr, unknown))}")
        raise TypeError(f"attach() got {what}; it passes on only {sorted(_SESSION_OPTIONS)} to Session")
    names = sizes = None
    if dims is not None:
        names, sizes = _check_dims(dims)
    comm_timeout = _check_seconds("comm_timeout", comm_timeout)
    timeout = _check_seconds("timeout", timeout)
    if workers is not None:
        workers = _check_workers(workers)
    check_security(security)
    if security is not None and (cluster is None or isinstance(cluster, Client)):
        raise ValueError(
            "security= is for connecting to a scheduler address or cluster object; "
            + ("a Client brings its own security" if cluster is not None else "the embedded cluster does not use TLS")
        )
    want = math.prod(sizes) if sizes else (len(workers) if workers else None)
    if workers is not None and sizes is not None and len(workers) != want:
        raise ValueError(f"workers: {len(workers)} addresses given but dims {dict(dims)} need {want}")

    phases: dict[str, float] = {}  # the seconds each step of attach took (``Session.attach_phases``)
    mark = [time.perf_counter()]

    def done(phase: str) -> None:
        now = time.perf_counter()
        phases[phase] = now - mark[0]
        mark[0] = now

    closers = []
    owns_client = False
    local = None
    if cluster is None:
        want = want or default_worker_count()
        local = start_local_cluster(want)  # refuses more ranks than GPUs before starting anything
        closers.append(local.close)
        client = Client(local, set_as_default=False)
        owns_client = True
    elif isinstance(cluster, Client):
        client = cluster
    elif isinstance(cluster, str):
        client = _connect(cluster, security, timeout)
        owns_client = True
    elif hasattr(cluster, "scheduler_address"):
        client = _connect(cluster, security, timeout)
        owns_client = True
    else:
        raise TypeError(f"cluster must be a distributed.Client, a scheduler address or None, got {type(cluster).__name__}")
    if owns_client:
        closers.insert(0, lambda: client.close(timeout=timeout))

    def close_all():
        for close in closers:
            try:
                close()
            except Exception:
                pass

    try:
        done("cluster")
        warm_up = _warm_up()  # the controller's first session imports torch._dynamo: meanwhile, not after
        _register_plugins(client, timeout)
        done("plugins")
        if workers is None:
            if local is not None:
                wait_for_workers(local, client, want, timeout)
            elif want:
                try:
                    client.wait_for_workers(want, timeout=timeout)
                except TimeoutError:
                    have = len(cluster_workers(client, timeout))
                    raise TimeoutError(
                        f"dims {dict(zip(names, sizes))} need {want} workers, but the cluster has {have} "
                        f"after waiting {timeout:g} s (timeout=)"
                    ) from None
            available = sorted(cluster_workers(client, timeout), key=_sort_key)
            if not available:
                raise ValueError("the cluster has no workers")
            workers = available[: want or len(available)]
        else:
            known = set(cluster_workers(client, timeout))
            unknown = [w for w in workers if w not in known]
            if unknown:
                raise ValueError(f"workers: {unknown} are not workers of this cluster; it has {sorted(known)}")
            if len(set(workers)) != len(workers):
                raise ValueError(f"workers: duplicate addresses in {workers}")
        if names is None:
            names, sizes = ["workers"], [len(workers)]
        done("workers")
        if local is None:
            _check_gpus(client, workers, timeout)
            done("gpu check")
        # the scheduler knows the session before any of its messages leaves: if this controller vanishes or
        # attach fails from here on, ending it there ends it on the workers too
        session_id = new_session_id()
        client.sync(
            client.scheduler.monarch_session_open,
            session_id=session_id, client=client.id, dims=dict(zip(names, sizes)), workers=workers,
            callback_timeout=timeout,
        )
        # bounded: exit() must return even when the scheduler no longer answers
        opened: dict = {}  # the session, once made: whether its exit drained every rank (``Session.drained``)
        closers.insert(0, lambda: None if scheduler_gone(client) else client.sync(
            client.scheduler.monarch_session_close, session_id=session_id,
            clean=getattr(opened.get("session"), "drained", False), callback_timeout=Session.PROBE_TIMEOUT
        ))
        done("session open")
        if warm_up is not None:
            warm_up.join(WARM_UP_JOIN)  # imports only while attach waits for others (the module's lock serializes it)
            done("controller warm-up")
        session = opened["session"] = Session(client, workers, comm_timeout=comm_timeout, session_id=session_id,
                                              **session_options)
        phases.update(session.attach_phases)  # the session's own steps, timed there
        session.attach_phases = phases
        mark[0] = time.perf_counter()
        warn_if_unencrypted(client.scheduler.address, workers)
        closers.insert(0, session.stop)  # runs after exit's drain; alone if attach fails below
        mesh = DeviceMesh(session, names, Slice.new_row_major(sizes), owner=True)

        def close_mesh():
            forget(mesh)
            close_all()

        mesh._closer = close_mesh
        remember(mesh)
        done("mesh")
        logger.debug("dask_monarch: session %s attached %d ranks in %.3f s: %s", session.tag, len(workers),
                     sum(phases.values()), ", ".join(f"{k} {v:.3f} s" for k, v in phases.items()))
        if local is not None:
            print(f"dask_monarch: {len(workers)} workers on this machine; dashboard: {mesh.dashboard_link}",
                  file=sys.stderr, flush=True)
        return mesh
    except BaseException:
        close_all()
        raise
