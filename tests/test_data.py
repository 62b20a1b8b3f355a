"""Dask collections into and out of the mesh, and pipes (issue 15; DESIGN.md "Decisions": ``from_dask`` /
``to_dask`` in place, nothing through the controller; ``PipeRecv`` as a data feed from Dask).

A real two-worker ``LocalCluster`` (the ``client2`` fixture) and real gloo; locality is read from Dask's own
record of worker-to-worker transfers (``Worker.transfer_incoming_log``).
"""

from __future__ import annotations

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
import torch
from distributed import default_client, futures_of, wait

import dask_monarch as dm

TIMEOUT = 60


def fetch(obj, **coords):
    return dm.fetch_shard(obj, **coords).result(timeout=TIMEOUT)


@pytest.fixture
def mesh(client2):
    mesh = dm.attach(client2, dims={"dp": 2}, comm_timeout=60)
    yield mesh
    if not mesh._session.closed:
        try:
            mesh.exit()
        except Exception:
            pass


# ----------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype,chunks", [
    (np.float32, (3, 2)),       # even chunks, one chunk column
    (np.int64, (5, 1)),         # uneven chunks cut across the ranks' blocks, and chunked along axis 1 too
    (np.bool_, (12, 2)),        # one chunk: both ranks cut from it
    (np.float16, (1, 2)),
    (np.uint8, (4, 2)),
])
def test_array_round_trip(mesh, dtype, chunks):
    data = (np.arange(24).reshape(12, 2) % 7).astype(dtype)
    t = dm.from_dask(da.from_array(data, chunks=chunks), mesh)
    assert tuple(t.shape) == (6, 2) and t.dtype == torch.from_numpy(data).dtype
    assert np.array_equal(fetch(t, dp=0).numpy(), data[:6])
    assert np.array_equal(fetch(t, dp=1).numpy(), data[6:])
    back = dm.to_dask(t)
    assert back.chunks == ((6, 6), (2,))
    assert np.array_equal(back.compute(), data)


def test_dataframe_round_trip_columns_and_dtypes(mesh, tmp_path):
    df = pd.DataFrame({"i": np.arange(8, dtype=np.int32), "f": np.arange(8) / 4, "s": list("abcdefgh"),
                       "b": np.arange(8) % 2 == 0})
    ddf = dd.from_pandas(df, npartitions=3)
    t = dm.from_dask(ddf, mesh)  # numeric and bool columns: i, f, b -> float64
    assert tuple(t.shape) == (4, 3) and t.dtype == torch.float64
    expected = df[["i", "f", "b"]].to_numpy(dtype=np.float64)
    assert np.array_equal(fetch(t, dp=1).numpy(), expected[4:])
    t32 = dm.from_dask(ddf, mesh, columns=["f"], dtype=torch.float32)
    assert tuple(t32.shape) == (4, 1) and t32.dtype == torch.float32
    out = dm.to_dask_dataframe(t, columns=["i", "f", "b"])
    assert list(out.columns) == ["i", "f", "b"]
    out.to_parquet(str(tmp_path / "out"))
    read = pd.read_parquet(tmp_path / "out").sort_index()
    assert np.array_equal(read.to_numpy(), expected)


def test_bad_input_names_the_field(mesh):
    ddf = dd.from_pandas(pd.DataFrame({"x": [1.0, 2.0], "s": ["a", "b"]}), npartitions=1)
    with pytest.raises(TypeError, match="column 's' has dtype"):
        dm.from_dask(ddf, mesh, columns=["x", "s"])
    with pytest.raises(KeyError, match="column 'nope'"):
        dm.from_dask(ddf, mesh, columns=["nope"])
    with pytest.raises(KeyError, match="dim 'tp'"):
        dm.from_dask(ddf, mesh, "tp")
    with pytest.raises(TypeError, match="datetime64"):
        dm.from_dask(da.from_array(np.array(["2020-01-01"] * 4, dtype="datetime64[D]")), mesh)
    with pytest.raises(TypeError, match="expected a dask.array"):
        dm.from_dask(np.zeros(4), mesh)
    with mesh.activate():
        t = torch.zeros(2, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        dm.to_dask(t)
    with mesh.activate():
        m = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"unique; \['a'\] repeated"):
        dm.to_dask_dataframe(m, columns=["a", "a", "b"])
    with pytest.raises(TypeError, match="got torch.Tensor .a local tensor"):
        dm.to_dask(torch.ones(3))


def test_uneven_rows_error_or_drop_remainder(mesh):
    x = da.arange(7, chunks=3)
    with pytest.raises(ValueError, match="7 rows do not split evenly over the 2 ranks of dimension 'dp'"):
        dm.from_dask(x, mesh)
    t = dm.from_dask(x, mesh, drop_remainder=True)
    assert fetch(t, dp=1).tolist() == [3, 4, 5]


def test_replicated_over_other_dims(client2):
    with dm.attach(client2, dims={"dp": 1, "tp": 2}, comm_timeout=60) as mesh:
        t = dm.from_dask(da.arange(6, chunks=2), mesh, "dp")
        assert fetch(t, dp=0, tp=0).tolist() == fetch(t, dp=0, tp=1).tolist() == list(range(6))


# --------------------------------------------------------------------------------------------------- locality
def test_a_chunk_on_its_ranks_worker_does_not_move(mesh, client2):
    """Four chunks of 3 rows: 0, 1 and 3 made on rank 0's worker, 2 on rank 1's. Rank 0's rows (chunks 0, 1)
    and chunk 2 of rank 1's stay where they are; only chunk 3 moves to rank 1's worker (Dask's own transfer)."""
    w0, w1 = mesh.workers[0], mesh.workers[1]
    home = [w0, w0, w1, w0]
    futures = [client2.submit(np.full, (3, 2), float(i), workers=[w], pure=False) for i, w in enumerate(home)]
    x = da.concatenate([da.from_delayed(f, shape=(3, 2), dtype=float) for f in futures])
    x = client2.persist(x)
    wait(x)
    chunks = sorted(futures_of(x), key=lambda f: f.key[1:])
    chunk_keys = [f.key for f in chunks]
    held = client2.who_has(chunks)
    assert [list(held[k]) for k in chunk_keys] == [[w] for w in home]
    before = client2.run(lambda dask_worker: len(dask_worker.transfer_incoming_log))
    t = dm.from_dask(x, mesh)
    assert fetch(t, dp=1)[:, 0].tolist() == [2.0] * 3 + [3.0] * 3

    def moved(dask_worker, skip):
        return [k for entry in list(dask_worker.transfer_incoming_log)[skip:] for k in entry["keys"]]

    incoming = {w: client2.run(moved, skip=before[w], workers=[w])[w] for w in (w0, w1)}
    assert not set(incoming[w0]) & set(chunk_keys)
    assert set(incoming[w1]) & set(chunk_keys) == {chunk_keys[3]}


def _incoming(client, workers: dict, before: dict) -> dict:
    """Worker -> the keys that moved into it since ``before`` (Dask's own transfer log)."""
    def moved(dask_worker, skip):
        return [k for entry in list(dask_worker.transfer_incoming_log)[skip:] for k in entry["keys"]]

    return {w: client.run(moved, skip=before[w], workers=[w])[w] for w in workers}


def _transfers(client) -> dict:
    return client.run(lambda dask_worker: len(dask_worker.transfer_incoming_log))


def test_partitions_not_yet_computed_are_computed_where_their_rows_are_read(mesh, client2, tmp_path):
    """A read_parquet of 4 files, not persisted: each file is read on the worker of the rank whose rows it holds
    (2 per rank), so no partition moves between the workers, for from_dask and for a pipe alike."""
    df = pd.DataFrame({"x": np.arange(40, dtype=np.float32), "y": np.arange(40)})
    for i in range(4):
        df.iloc[10 * i:10 * (i + 1)].to_parquet(tmp_path / f"part.{i}.parquet", index=False)
    workers = [mesh.workers[0], mesh.workers[1]]
    before = _transfers(client2)
    t = dm.from_dask(dd.read_parquet(str(tmp_path)), mesh, columns=["x"])
    assert fetch(t, dp=1)[:, 0].tolist() == list(range(20, 40))
    incoming = _incoming(client2, workers, before)
    assert not [k for w in workers for k in incoming[w] if isinstance(k, tuple)], incoming  # no partition moved
    before = _transfers(client2)
    pipe = dm.create_pipe(dd.read_parquet(str(tmp_path)), mesh, batch_size=10, columns=["x"], label="y")
    assert [fetch(y, dp=1).tolist() for _, y in pipe] == [list(range(20, 30)), list(range(30, 40))]
    incoming = _incoming(client2, workers, before)
    assert not [k for w in workers for k in incoming[w] if isinstance(k, tuple)], incoming
    pipe.close()


def test_pad_keeps_every_row(mesh):
    """7 rows over 2 ranks with pad=-1: 4 rows each, rank 1's last one -1 (every column); pad and drop_remainder
    together, or a pad the dtype does not hold, raise naming it."""
    t = dm.from_dask(da.arange(7, chunks=3), mesh, pad=-1)
    assert tuple(t.shape) == (4,)
    assert fetch(t, dp=0).tolist() == [0, 1, 2, 3] and fetch(t, dp=1).tolist() == [4, 5, 6, -1]
    frame = dd.from_pandas(pd.DataFrame({"x": np.arange(5) / 2, "y": np.arange(5)}), npartitions=2)
    f = dm.from_dask(frame, mesh, pad=-1)
    assert fetch(f, dp=1).tolist() == [[1.5, 3.0], [2.0, 4.0], [-1.0, -1.0]]
    with pytest.raises(TypeError, match="drop_remainder=True or pad=, not both"):
        dm.from_dask(da.arange(7, chunks=3), mesh, pad=0, drop_remainder=True)
    with pytest.raises(ValueError, match=r"pad=0.5 is not a value of the tensor's dtype int64"):
        dm.from_dask(da.arange(7, chunks=3), mesh, pad=0.5)
    with pytest.raises(ValueError, match=r"pad=-1 is not a value of the tensor's dtype uint8"):
        dm.from_dask(da.arange(7, chunks=3, dtype=np.uint8), mesh, pad=-1)
    with pytest.raises(TypeError, match="pad must be a number, got 'x'"):
        dm.from_dask(da.arange(7, chunks=3), mesh, pad="x")


def test_blocks_are_taken_off_dask_and_a_bad_conversion_names_its_column(mesh, client2):
    """Dask holds only each assemble task's row count; the block itself is taken by the rank's stream, so none is
    left on the workers afterwards. A column that does not convert on the worker raises TypeError naming it."""
    t = dm.from_dask(da.arange(8, chunks=2), mesh)
    assert fetch(t, dp=1).tolist() == [4, 5, 6, 7]

    def left(dask_worker):
        from dask_monarch.worker import imports
        return len(imports._blocks)

    assert client2.run(left) == {w: 0 for w in (mesh.workers[0], mesh.workers[1])}
    frame = dd.from_pandas(pd.DataFrame({"a": pd.array([1, None, 3, 4], dtype="Int64"), "b": [1, 2, 3, 4]}),
                           npartitions=2)
    with pytest.raises(TypeError, match="column 'a' .dtype Int64. does not convert to int64"):
        dm.from_dask(frame, mesh, dtype=torch.int64)


def test_blocks_nobody_took_go_with_their_session():
    from dask_monarch.worker import imports

    imports.put("s-1", "tok", 0, np.zeros(3))
    imports.put("s-2", "tok", 0, np.ones(3))
    imports.release_session("s-1")
    assert imports.take("s-1", "tok", 0) is None
    assert imports.take("s-2", "tok", 0).tolist() == [1.0, 1.0, 1.0]
    assert imports.take("s-2", "tok", 0) is None  # taken once


def test_with_mesh_makes_its_client_the_current_client(client2):
    with dm.attach(client2, dims={"dp": 2}, comm_timeout=60) as mesh:
        assert default_client() is mesh.client
        assert da.arange(4, chunks=2).sum().compute() == 6  # dask's scheduler is the mesh's cluster
        assert futures_of(da.arange(4, chunks=2).persist())


# ------------------------------------------------------------------------------------------------- to_dask rule
def test_to_dask_is_a_snapshot_of_that_point(mesh):
    with mesh.activate():
        t = torch.arange(4.0) + 10 * mesh.rank("dp")
    snapshot = dm.to_dask(t)
    with mesh.activate():
        t.add_(100)  # later mesh work: the snapshot does not see it
        t.mul_(2)
    assert snapshot.compute().tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert fetch(t, dp=1).tolist() == [220, 222, 224, 226]


def test_to_dask_of_a_failed_tensor_raises_its_error(mesh):
    def boom(x):
        raise ValueError("no shard here")

    with mesh.activate():
        x = torch.ones(2)
        y = dm.remote(boom, propagate=lambda x: torch.empty(2))(x)
    with pytest.raises(RuntimeError, match="holds an error"):
        dm.to_dask(y).compute()
    with pytest.raises(dm.RemoteException, match="no shard here"):
        fetch(y)


# ------------------------------------------------------------------------------------------------------ pipes
def test_collection_pipe_batches_and_end(mesh):
    df = pd.DataFrame({"x": np.arange(20, dtype=np.float32), "y": np.arange(20) % 3})
    pipe = dm.create_pipe(dd.from_pandas(df, npartitions=4), mesh, batch_size=4, label="y", prefetch=1)
    assert len(pipe) == 2  # 10 rows per rank, full batches of 4
    batches = []
    with mesh.activate():
        for xb, yb in pipe:
            assert tuple(xb.shape) == (4, 1) and xb.dtype == torch.float32 and yb.dtype == torch.int64
            batches.append((xb, yb))
        with pytest.raises(StopIteration):
            pipe.recv()
    seen = [(fetch(xb, dp=0)[:, 0].tolist(), fetch(yb, dp=1).tolist()) for xb, yb in batches]
    assert seen[0][0] == [0, 1, 2, 3] and seen[1][0] == [4, 5, 6, 7]
    assert seen[0][1] == [x % 3 for x in range(10, 14)]
    pipe.close()


def test_collection_pipe_one_batch_per_partition(mesh):
    x = da.arange(16, chunks=4)
    pipe = dm.create_pipe(x, mesh)
    assert len(pipe) == 2
    batches = [fetch(b, dp=1).tolist() for b in pipe]
    assert batches == [[8, 9, 10, 11], [12, 13, 14, 15]]
    with pytest.raises(ValueError, match="pass batch_size="):
        dm.create_pipe(da.arange(10, chunks=4), mesh)


def _counting(mesh, n):
    rank = mesh.dims["dp"].rank
    for i in range(n):
        yield {"x": torch.full((2,), float(10 * rank + i))}


def test_generator_pipe_and_its_end(mesh):
    pipe = dm.create_pipe(_counting, mesh, mesh, 2)
    with mesh.activate():
        first = pipe.recv()
        assert fetch(first["x"], dp=1).tolist() == [10.0, 10.0]
        pipe.recv()
        assert not pipe.exhausted(dp=1)
        after = pipe.recv()  # the source has ended
        assert pipe.exhausted(dp=1)
    with pytest.raises(dm.RemoteException, match="StopIteration: the source of pipe"):
        fetch(after["x"])
    mesh.exit()  # the end is not a failure: nothing unfetched to raise


def _raising(mesh):
    yield torch.zeros(3)
    raise ValueError("bad record 7 in the source")


def test_a_source_that_raises_fails_that_recv(mesh):
    pipe = dm.create_pipe(_raising, mesh, mesh, propagate=lambda mesh: torch.empty(3))
    with mesh.activate():
        ok = pipe.recv()
        bad = pipe.recv()
    assert fetch(ok).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(dm.RemoteException, match="bad record 7 in the source"):
        fetch(bad)


def _wrong_shape(mesh):
    yield torch.zeros(3)
    yield torch.zeros(4)


def test_a_batch_of_other_shapes_fails_that_recv(mesh):
    pipe = dm.create_pipe(_wrong_shape, mesh, mesh)
    pipe.recv()
    bad = pipe.recv()
    with pytest.raises(dm.RemoteException, match=r"shape \[4\].*expects shape \[3\]"):
        fetch(bad)


def test_pipe_bad_arguments(mesh):
    with pytest.raises(ValueError, match="prefetch"):
        dm.create_pipe(_counting, mesh, mesh, 2, prefetch=0)
    with pytest.raises(TypeError, match="batch_size= is for collection sources"):
        dm.create_pipe(_counting, mesh, mesh, 2, batch_size=3)
    with pytest.raises(KeyError, match="label column 'z'"):
        dm.create_pipe(dd.from_pandas(pd.DataFrame({"x": [1.0, 2.0]}), npartitions=1), mesh, label="z")
    small = dd.from_pandas(pd.DataFrame({"x": np.arange(6.0)}), npartitions=2)  # 3 rows per position
    with pytest.raises(ValueError, match=r"gets 3 rows .* fewer than batch_size=4: the pipe would have no batch"):
        dm.create_pipe(small, mesh, batch_size=4)


def test_a_mesh_on_a_client_not_set_as_default_works_outside_with_mesh(monkeypatch):
    """The mesh's own Client does every wait, not Dask's default one: none is set here (the module's other
    clients hidden too), so a default-client wait would raise "No clients found"."""
    import weakref

    import distributed.client
    from distributed import Client

    from conftest import _cluster

    monkeypatch.setattr(distributed.client, "_global_clients", weakref.WeakValueDictionary())
    with _cluster(2) as cluster, Client(cluster, set_as_default=False) as own:
        mesh = dm.attach(own, dims={"dp": 2}, comm_timeout=60)
        try:
            data = np.arange(24.0).reshape(12, 2)
            t = dm.from_dask(da.from_array(data, chunks=(3, 2)), mesh)
            assert np.array_equal(fetch(t, dp=1).numpy(), data[6:])
            frame = dd.from_pandas(pd.DataFrame({"a": np.arange(8.0), "b": np.arange(8.0) * 2}), npartitions=4)
            f = dm.from_dask(frame, mesh)
            assert np.array_equal(fetch(f, dp=0).numpy(), frame.compute().to_numpy()[:4])
            groups = [fetch(g, dp=0).numpy() for g in dm.iter_from_dask(da.from_array(data, chunks=(3, 2)), mesh,
                                                                          partitions=1)]
            assert np.array_equal(np.concatenate(groups), data[np.r_[0:3, 6:9]])
            back = dm.to_dask(t)
            assert np.array_equal(own.compute(back).result(timeout=TIMEOUT), data)
        finally:
            mesh.exit()


def test_pipe_over_fewer_partitions_than_ranks(client4):
    """A collection of fewer partitions than ranks is cut so that every position gets rows (4 ranks here)."""
    mesh = dm.attach(client4, dims={"dp": 4}, comm_timeout=60)
    try:
        df = pd.DataFrame({"x": np.arange(32, dtype=np.float32), "y": np.arange(32) % 5})
        pipe = dm.create_pipe(dd.from_pandas(df, npartitions=2), mesh, batch_size=4, label="y", prefetch=1)
        assert len(pipe) >= 1  # every position gets rows (Dask's repartition cuts them about evenly)
        with mesh.activate():
            batches = list(pipe)
        firsts = [fetch(batches[0][0], dp=r)[:, 0].tolist() for r in range(4)]
        assert sorted(x for f in firsts for x in f) == sorted(set(x for f in firsts for x in f))  # no row twice
        assert all(len(f) == 4 for f in firsts)
        one = dm.create_pipe(da.arange(8, chunks=8), mesh, batch_size=2)  # one chunk over 4 ranks
        assert len(one) == 1
        b = one.recv()
        assert [fetch(b, dp=r).tolist() for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        with pytest.raises(ValueError, match=r"position \d of dimension 'dp' gets 0 rows"):
            dm.create_pipe(dd.from_pandas(pd.DataFrame({"x": np.arange(3.0)}), npartitions=1), mesh, batch_size=1)
    finally:
        mesh.exit()
