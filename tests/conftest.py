"""Shared fixtures: real ``distributed.LocalCluster`` worker processes (no simulated cluster, gloo for comms).

Clusters are module-scoped to keep the suite fast; every test gets its own controller session (a new
``attach``), which is what isolates sessions from each other on a shared cluster.
"""

from __future__ import annotations

import pytest
from distributed import Client, LocalCluster

import dask_monarch as dm


def _cluster(n: int) -> LocalCluster:
    return LocalCluster(
        n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0", silence_logs=40
    )


@pytest.fixture(scope="module")
def client1():
    """A client of a cluster with one worker process."""
    with _cluster(1) as cluster, Client(cluster) as client:
        yield client


@pytest.fixture(scope="module")
def client2():
    """A client of a cluster with two worker processes."""
    with _cluster(2) as cluster, Client(cluster) as client:
        yield client


@pytest.fixture(scope="module")
def client4():
    """A client of a cluster with four worker processes."""
    with _cluster(4) as cluster, Client(cluster) as client:
        yield client


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


def _quiet_exit(mesh) -> None:
    try:
        mesh.exit()
    except Exception:
        pass
