"""Shared fixtures: real ``distributed.LocalCluster`` worker processes (no simulated cluster, gloo for comms).

The clusters of one, two and four workers are shared by the whole run (session-scoped: starting and stopping a
cluster of torch-importing worker processes was a third of the suite's time); every test gets its own controller
session (a new ``attach``), which is what isolates sessions from each other on a shared cluster, as on a user's
long-lived cluster. Tests that kill, stop for long or restart workers make clusters of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import dask
import pytest
from distributed import Client, LocalCluster

import dask_monarch as dm

# Worker liveness for sessions that do not set heartbeat_timeout: the 30 s default failed a 4-rank session once on
# a 2-core machine still loaded by a pip install (a worker's event loop starved); tests of liveness pass their own
dask.config.set({"monarch.heartbeat-timeout": 120})


def _cluster(n: int) -> LocalCluster:
    return LocalCluster(
        n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0", silence_logs=40
    )


@pytest.fixture(scope="session")
def shared_client1():
    """The whole run's client of a cluster with one worker process (for module-scoped meshes)."""
    with _cluster(1) as cluster, Client(cluster) as client:
        yield client


@pytest.fixture(scope="session")
def shared_client2():
    """The whole run's client of a cluster with two worker processes (for module-scoped meshes)."""
    with _cluster(2) as cluster, Client(cluster) as client:
        yield client


@pytest.fixture(scope="session")
def shared_client4():
    """The whole run's client of a cluster with four worker processes (for module-scoped meshes)."""
    with _cluster(4) as cluster, Client(cluster) as client:
        yield client


# Each test sees its cluster's client as Dask's current client (Client.as_current), as a program with one client
# does: with the three shared clients alive at once, Dask's default would otherwise be the last one created, and a
# collection computed outside a mesh's `with` would run on another cluster ("lost dependencies").
@pytest.fixture
def client1(shared_client1):
    """A client of a cluster with one worker process."""
    with shared_client1.as_current():
        yield shared_client1


@pytest.fixture
def client2(shared_client2):
    """A client of a cluster with two worker processes."""
    with shared_client2.as_current():
        yield shared_client2


@pytest.fixture
def client4(shared_client4):
    """A client of a cluster with four worker processes."""
    with shared_client4.as_current():
        yield shared_client4


@pytest.fixture
def mesh1(client1):
    """A one-rank mesh (world 1, rank 0) that records every controller message in ``mesh._session.answers``."""
    mesh = dm.attach(client1, dims={"workers": 1}, comm_timeout=60, record_answers=True)
    yield mesh
    mesh._session.closed or _quiet_exit(mesh)


@pytest.fixture
def mesh2x2(client4):
    """test_controller's 2x2 mesh (host x gpu) of four CPU workers."""
    mesh = dm.attach(client4, dims={"host": 2, "gpu": 2}, comm_timeout=60, record_answers=True)
    yield mesh
    mesh._session.closed or _quiet_exit(mesh)


def _cli_cluster(tmp_path, worker_args=((), ()), worker_envs=None):
    """Start a scheduler and one worker per entry of ``worker_args`` (extra ``dask worker`` arguments) with the
    command lines, on 127.0.0.1 only (without ``--host`` they would listen on every interface); yield the scheduler address and the processes (scheduler first); stop them. ``worker_envs``
    gives each worker environment changes (a value of None removes the variable)."""
    scheduler_file = tmp_path / "scheduler.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    script = os.path.join(os.path.dirname(sys.executable), "dask")
    dask_cli = [script] if os.path.exists(script) else [sys.executable, "-m", "dask"]  # no script: --target installs
    procs = [subprocess.Popen(
        [*dask_cli, "scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address", "127.0.0.1:0",
         "--scheduler-file", str(scheduler_file)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )]
    try:
        deadline = time.time() + 60
        while not scheduler_file.exists() and time.time() < deadline:
            time.sleep(0.2)
        address = json.loads(scheduler_file.read_text())["address"]
        for extra, changes in zip(worker_args, worker_envs or [{}] * len(worker_args)):
            worker_env = {k: v for k, v in {**env, **changes}.items() if v is not None}
            procs.append(subprocess.Popen(
                [*dask_cli, "worker", address, "--host", "127.0.0.1", "--nthreads", "1", "--no-dashboard", *extra],
                env=worker_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
        yield address, procs
    finally:
        stop_processes(procs)


def stop_processes(procs) -> None:
    """End ``procs`` (``subprocess.Popen``: the scheduler and workers a test started) and every process they
    started (a ``dask worker``'s worker processes under its nanny) with SIGKILL, and reap ``procs``. Not SIGTERM:
    what a test checks is checked before its teardown, and the graceful end of a process that imported torch spends
    seconds of CPU in the interpreter's finalization (beside a loaded suite, 2026-12-05: a ``dask worker``'s worker
    process ran 1.5-3.5 s after its atexit hooks, with or without a session, and a CLI cluster of two workers took
    4.5-10 s to end on SIGTERM)."""
    import psutil

    doomed = []
    for p in procs:
        try:
            parent = psutil.Process(p.pid)
            doomed += [parent, *parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for q in doomed:
        try:
            q.kill()
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:  # uninterruptible I/O: nothing more to do about it here
            pass


@pytest.fixture
def cli_cluster_procs(tmp_path):
    """A scheduler and two workers started with the ``dask scheduler`` / ``dask worker`` command lines: yields
    the scheduler address and the processes (scheduler first), so a test can signal them."""
    yield from _cli_cluster(tmp_path)


def wait_until(predicate, timeout: float, interval: float = 0.25) -> bool:
    """Whether ``predicate()`` became true within ``timeout`` seconds, asked every ``interval`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fixed_port_cli_cluster(tmp_path):
    """Like ``cli_cluster_procs``, but each worker has a fixed port (as in many deployments): a worker its nanny
    restarts comes back at the same address."""
    yield from _cli_cluster(tmp_path, [("--worker-port", str(_free_port())) for _ in range(2)])


@pytest.fixture
def cli_cluster(cli_cluster_procs):
    """The scheduler address of ``cli_cluster_procs``."""
    return cli_cluster_procs[0]


def _quiet_exit(mesh) -> None:
    try:
        mesh.exit()
    except Exception:
        pass


# A test that fails half-way (an assertion, a regex that did not match) never reaches its own mesh.exit(): its
# session would hold the controller's interpreter settings (dask_monarch/interpreter.py) and its threads until the
# run ends, and the later tests that check those settings would see it. Its meshes are ended at its teardown.
_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        item.stash[_FAILED] = True
    return report


@pytest.fixture(autouse=True)
def _end_the_sessions_a_failed_test_left_open(request):
    """After a test that failed: ``mesh.exit(timeout=30)`` of each mesh ``attach`` returned during it that is not
    exited yet (only ``Session.stop``, as at interpreter exit, where its client is closed already, or the exit
    failed); passing tests are left alone."""
    from dask_monarch.controller.at_exit import forget, live_meshes

    before = {id(m) for m in live_meshes()}
    yield
    if not request.node.stash.get(_FAILED, False):
        return
    for mesh in live_meshes():
        if id(mesh) in before:
            continue
        try:
            if getattr(mesh.client, "status", None) in ("closing", "closed"):
                raise RuntimeError("its client is closed")
            mesh.exit(timeout=30)
        except BaseException:
            mesh._session.stop()
            forget(mesh)
            closer = mesh.__dict__.pop("_closer", None)
            if closer is not None:
                closer()
