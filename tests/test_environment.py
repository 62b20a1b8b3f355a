"""Each rank's worker process sees ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` during a
session, as torchrun's and Monarch's processes do, and gets its previous values back when the session ends
(``worker/environment.py``)."""

from __future__ import annotations

import os

import dask_monarch as dm
from dask_monarch.worker import environment

TIMEOUT = 60
NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@dm.remote
def read_environment():
    return {name: os.environ.get(name) for name in NAMES}


def _set_rank_unset_rest():
    os.environ["RANK"] = "before"
    for name in NAMES[1:]:
        os.environ.pop(name, None)


def _read():
    return {name: os.environ.get(name) for name in NAMES}


def test_ranks_see_torchrun_variables_and_get_the_old_ones_back(client2):
    client2.run(_set_rank_unset_rest)
    mesh = dm.attach(client2, dims={"gpu": 2}, comm_timeout=60)
    try:
        with mesh.activate():
            values = read_environment.call().get(timeout=TIMEOUT)
    finally:
        mesh.exit()
    seen = [env for _, env in values]
    # the LocalCluster's two workers share one host: local rank = rank, local world size = 2
    assert seen == [
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
        {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
    ]
    after = client2.run(_read)
    assert list(after.values()) == [{"RANK": "before", "LOCAL_RANK": None, "WORLD_SIZE": None,
                                     "LOCAL_WORLD_SIZE": None}] * 2


def test_sessions_sharing_a_process_last_wins_and_the_first_values_come_back(monkeypatch):
    monkeypatch.setenv("RANK", "mine")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    environment.enter_session("a", 0, 2, 0, 2)
    environment.enter_session("b", 3, 4, 1, 2)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("3", "4")
    environment.leave_session("b")
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "2")
    environment.leave_session("a")
    environment.leave_session("a")  # idempotent
    assert os.environ["RANK"] == "mine" and "WORLD_SIZE" not in os.environ
