"""``score()`` of examples/batch_inference.py (issue 15 items 4 and 6): Parquet in, every row scored on the mesh
once, predictions written to Parquet from the workers, for several group sizes and read-ahead depths.

A real two-worker ``LocalCluster`` (``client2``), real gloo; the model is the example's MLP with fixed random
parameters (no training: the predictions are compared with the same model run locally).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import dask_monarch as dm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from batch_inference import score  # noqa: E402
from train_digits_pipe import FEATURES, MLP, write_parquet  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """1,003 rows of random pixels and targets in 7 Parquet files of uneven sizes (so groups pad)."""
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(rng.random((1003, 64), dtype=np.float32), columns=FEATURES)
    frame["target"] = rng.integers(0, 10, len(frame)).astype(np.int64)
    return write_parquet(frame, str(tmp_path_factory.mktemp("score")), files=7), frame


@pytest.mark.parametrize("group,ahead,batch", [(2, 1, 64), (1, 0, 100), (3, 2, 1000)])
def test_every_row_is_scored_once_and_written(client2, data, tmp_path, group, ahead, batch):
    path, frame = data
    with dm.attach(client2, dims={"dp": 2}, comm_timeout=60) as mesh:
        with mesh.activate():
            dm.remote(torch.manual_seed, propagate="inspect")(1)
            model = MLP()
        state = dm.fetch_shard(dict(model.state_dict())).result(timeout=60)
        out = str(tmp_path / "predictions")
        result = score(mesh, model, path, out, batch=batch, progress=False, group=group, ahead=ahead)
    local = MLP()
    local.load_state_dict(state)
    with torch.no_grad():
        expected = local(torch.from_numpy(frame[FEATURES].to_numpy(copy=True))).argmax(dim=1).numpy()
    files = sorted(os.listdir(out), key=lambda name: [int(p) for p in name.split(".")[1:3]])  # part.<group>.<i>
    written = pd.concat([pd.read_parquet(os.path.join(out, name)) for name in files], ignore_index=True)
    assert result["rows"] == len(frame) == len(written)
    assert written["target"].tolist() == frame["target"].tolist()  # in row order, no padding row left
    assert np.array_equal(written["prediction"].to_numpy(), expected)
    assert result["accuracy"] == pytest.approx(float((expected == frame["target"].to_numpy()).mean()))


def test_training_with_a_test_set_that_does_not_split_evenly_counts_only_its_rows(client2, data, tmp_path):
    """``train()`` of examples/train_digits_pipe.py (issue 23 item 9: every example at any number of ranks): a test
    set of 7 rows on 2 ranks is padded with rows of label -1 (``from_dask(pad=-1)``), which the test accuracy leaves
    out: it is a whole number of sevenths (without the padding, ``from_dask`` refused the uneven rows)."""
    from train_digits_pipe import train

    path, frame = data
    test = write_parquet(frame.iloc[:7], str(tmp_path / "test"), files=1)
    with dm.attach(client2, dims={"dp": 2}, comm_timeout=60) as mesh:
        _, accuracy = train(mesh, path, test, epochs=1, batch_size=64, log=lambda line: None)
    assert round(accuracy * 7) == pytest.approx(accuracy * 7)
