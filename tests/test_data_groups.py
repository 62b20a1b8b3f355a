"""``iter_from_dask`` (a ``from_dask`` per group of partitions, the next groups read ahead) and the rule that a
``to_dask`` task waiting for its snapshot holds none of the worker's Dask threads (issue 15 item 6).

A real two-worker ``LocalCluster`` of one thread per worker (the ``client2`` fixture) and real gloo.
"""

from __future__ import annotations

import os
import time

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
import torch
from distributed import futures_of

import dask_monarch as dm
from test_data import fetch, mesh  # noqa: F401 (mesh: the same fixture, a 2-rank "dp" mesh)

TIMEOUT = 60


def _frame(sizes: list) -> tuple:
    """A Dask DataFrame of partitions of ``sizes`` rows (columns x: the row number, y: twice it), and its pandas."""
    whole = pd.DataFrame({"x": np.arange(sum(sizes), dtype=np.int64)})
    whole["y"] = 2 * whole["x"]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    parts = [whole.iloc[a:b] for a, b in zip(starts[:-1], starts[1:])]
    return dd.from_delayed([dask.delayed(p) for p in parts], meta=whole.iloc[:0]), whole


def _made(path: str, i: int, rows: int):
    """Partition ``i`` (``rows`` rows of i), leaving a file ``made-<i>`` in ``path`` when it is computed."""
    open(os.path.join(path, f"made-{i}"), "w").close()
    return pd.DataFrame({"x": np.full(rows, i, dtype=np.int64)})


def _wait_for(predicate, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        time.sleep(0.05)


def test_groups_come_in_row_order_each_a_from_dask_of_its_partitions(mesh):
    """10 partitions, 2 per rank per group on 2 ranks: groups of partitions 0-3, 4-7, 8-9; each group's rows split
    over the ranks on their own (the padding -1 after each rank's rows where they do not split evenly)."""
    sizes = [3, 4, 2, 5, 1, 1, 2, 3, 4, 3]
    ddf, whole = _frame(sizes)
    groups = list(dm.iter_from_dask(ddf, mesh, partitions=2, pad=-1, dtype=torch.int64))
    assert len(groups) == 3
    seen = []
    for g, (t, first) in enumerate(zip(groups, (0, 4, 8))):
        rows = sum(sizes[first:first + 4])
        assert tuple(t.shape) == (-(-rows // 2), 2), g
        expected = dm.from_dask(ddf.partitions[first:first + 4], mesh, pad=-1, dtype=torch.int64)
        for dp in (0, 1):
            got = fetch(t, dp=dp).numpy()
            assert np.array_equal(got, fetch(expected, dp=dp).numpy()), (g, dp)
            seen.extend(got[got[:, 0] >= 0].tolist())
    assert seen == whole[["x", "y"]].to_numpy().tolist()  # every row once, in order


def test_an_array_in_groups_of_its_chunks(mesh):
    data = np.arange(20, dtype=np.float32).reshape(10, 2)
    groups = list(dm.iter_from_dask(da.from_array(data, chunks=(2, 2)), mesh, partitions=1, ahead=2,
                                    drop_remainder=True))
    assert [tuple(t.shape) for t in groups] == [(2, 2), (2, 2), (1, 2)]  # chunks 0-1, 2-3, 4 (one row dropped)
    assert fetch(groups[1], dp=1).tolist() == data[6:8].tolist()


def test_the_groups_after_the_one_handed_out_are_read_ahead(mesh, tmp_path):
    """With ``ahead=1`` the second group's partitions are computed on the workers before the program asks for
    it; with ``ahead=0`` nothing of it is asked of Dask until then."""
    for ahead in (1, 0):
        path = tmp_path / f"ahead{ahead}"
        path.mkdir()
        parts = [dask.delayed(_made)(str(path), i, 2, dask_key_name=f"made-{ahead}-{i}") for i in range(6)]
        ddf = dd.from_delayed(parts, meta=pd.DataFrame({"x": np.empty(0, dtype=np.int64)}))
        groups = dm.iter_from_dask(ddf, mesh, partitions=2, ahead=ahead)
        first = next(groups)
        assert fetch(first, dp=1).view(-1).tolist() == [2, 2, 3, 3]
        if ahead:
            _wait_for(lambda: (path / "made-4").exists() and (path / "made-5").exists(),
                      "the second group's partitions were not computed ahead")
        else:
            assert not (path / "made-4").exists() and not (path / "made-5").exists()
        second = next(groups)
        assert fetch(second, dp=0).view(-1).tolist() == [4, 4]
        assert next(groups, None) is None


def test_stopping_early_lets_the_groups_read_ahead_go(mesh, client2):
    ddf, _ = _frame([2] * 8)
    groups = dm.iter_from_dask(ddf, mesh, partitions=1, ahead=2)
    assert fetch(next(groups), dp=0).tolist() == [[0, 0], [1, 2]]
    groups.close()  # what a break out of the for loop does
    _wait_for(lambda: not client2.run_on_scheduler(lambda dask_scheduler: [
        k for k, ts in dask_scheduler.tasks.items() if ts.who_wants and "from_delayed" in str(k)]),
        "the partitions read ahead are still held")


def test_bad_arguments_are_named_at_the_call(mesh):
    ddf, _ = _frame([2, 2])
    with pytest.raises(ValueError, match="partitions must be an integer >= 1, got 0"):
        dm.iter_from_dask(ddf, mesh, partitions=0)
    with pytest.raises(ValueError, match="ahead must be an integer >= 0, got -1"):
        dm.iter_from_dask(ddf, mesh, ahead=-1)
    with pytest.raises(ValueError, match="partitions must be an integer >= 1, got True"):
        dm.iter_from_dask(ddf, mesh, partitions=True)
    with pytest.raises(TypeError, match="iter_from_dask: expected a dask.array.Array or a dask.dataframe"):
        dm.iter_from_dask(pd.DataFrame({"x": [1]}), mesh)
    with pytest.raises(KeyError, match="dim 'tp' is not a dimension"):
        dm.iter_from_dask(ddf, mesh, "tp")
    groups = dm.iter_from_dask(dd.from_pandas(pd.DataFrame({"x": [1, 2, 3]}), npartitions=1), mesh)
    with pytest.raises(ValueError, match="iter_from_dask: 3 rows do not split evenly over the 2 ranks"):
        next(groups)


def _wait_for_file(path: str, x):
    """On a stream: wait (at most TIMEOUT s) until ``path`` exists, then return ``x``."""
    deadline = time.monotonic() + TIMEOUT
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return x


def test_a_to_dask_task_waiting_for_its_snapshot_holds_no_dask_thread(mesh, client2, tmp_path):
    """The stream is held up before the snapshot; the chunk's task waits for it, and meanwhile another task pinned
    to the same one-thread worker still runs: the waiting task seceded from the worker's thread pool."""
    gate = str(tmp_path / "gate")
    with mesh.activate():
        x = torch.arange(4.0)
        y = dm.remote(_wait_for_file, propagate=lambda path, x: torch.empty(4))(gate, x)
    chunks = dm.to_dask(y).persist()
    worker = mesh.workers[0]

    def waiting(dask_worker):
        return {str(k): ts.state for k, ts in dask_worker.state.tasks.items() if "monarch-to_dask" in str(k)}

    _wait_for(lambda: "long-running" in client2.run(waiting, workers=[worker])[worker].values(),
              "the to_dask task did not secede while waiting for its snapshot")
    other = client2.submit(sum, [1, 2, 3], workers=[worker], allow_other_workers=False, pure=False)
    assert other.result(timeout=TIMEOUT) == 6  # ran on the worker's one thread meanwhile
    assert not futures_of(chunks)[0].done()
    open(gate, "w").close()
    assert chunks.compute().tolist() == [0.0, 1.0, 2.0, 3.0] * 2
