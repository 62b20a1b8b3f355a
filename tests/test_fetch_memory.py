"""A fetch streams the tensor (issue 26 item 4): the worker's and the controller's RSS grow by at most the tensor and
two ``frames.CHUNK`` while a 256 MiB tensor is fetched on the answer sockets (before: three times the tensor on each
side), and the controller keeps nothing once the fetched tensor is dropped. Peak RSS is sampled by a thread every
2 ms (``psutil``); on a cluster of its own (one worker process). Figures for 0.25 to 2 GiB:
``bench/fetch_memory.py``. A tensor large enough to travel out of band also fetches right on the other paths: the
comm channel, and tasks alone, whose results the scheduler relays with pickle protocol 4 (no out-of-band buffers).

Only the sockets' memory is bounded here: on the comm channel the push runs on the worker's event loop, and a
``sync_batch`` task that finds it not yet acknowledged after ``SETTLE`` (a loaded machine) returns the chunk as
well (``Outbox.for_task``), so the tensor may come twice."""

from __future__ import annotations

import gc
import os
import threading
import time

import dask
import psutil
import pytest
import torch
from distributed import Client, LocalCluster

import dask_monarch as dm
from dask_monarch.protocol.frames import CHUNK

MIB = 2**20
SIZE = 256 * MIB


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=1, threads_per_worker=1, memory_limit="4GiB", dashboard_address=":0",
                      silence_logs=40) as cluster:
        with Client(cluster, set_as_default=False) as client:
            yield client


class _Peaks:
    """The highest RSS of ``processes`` seen by a thread sampling them every 2 ms while in the ``with`` block."""

    def __init__(self, *processes):
        self.processes = processes
        self.base = [p.memory_info().rss for p in processes]
        self.peak = list(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self._stop.is_set():
            for i, p in enumerate(self.processes):
                self.peak[i] = max(self.peak[i], p.memory_info().rss)
            time.sleep(0.002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def growth(self) -> list[float]:
        """Each process's peak growth, in MiB."""
        return [(peak - base) / MIB for peak, base in zip(self.peak, self.base)]


def test_a_fetch_costs_at_most_the_tensor_and_two_chunks_and_keeps_nothing(client):
    worker = psutil.Process(next(iter(client.run(os.getpid).values())))
    me = psutil.Process()
    with dask.config.set({"monarch.answer-channel": "socket"}):
        with dm.attach(client, dims={"dp": 1}, comm_timeout=120) as mesh:
            with mesh.activate():
                x = torch.arange(SIZE // 4, dtype=torch.int32)
            assert dm.inspect(x[:3]).tolist() == [0, 1, 2]  # made on the worker, and the path is warm
            gc.collect()
            time.sleep(0.3)
            with _Peaks(worker, me) as peaks:
                t = dm.inspect(x)
            assert t.dtype == torch.int32 and t.shape == (SIZE // 4,)
            assert t[-1].item() == SIZE // 4 - 1 and t[12345].item() == 12345
            channels = mesh._session.channels
            assert channels.socket_chunks[0] > 0 and channels.comm_chunks == [0], channels.socket_reasons
            worker_growth, controller_growth = peaks.growth()
            bound = (SIZE + 2 * CHUNK) / MIB
            assert worker_growth < bound, (worker_growth, bound)
            assert controller_growth < bound, (controller_growth, bound)
            del t
            gc.collect()
            time.sleep(0.3)
            assert (me.memory_info().rss - peaks.base[1]) / MIB < CHUNK / MIB, "the controller kept the fetch"


@pytest.mark.parametrize("mode", ["socket", "comm", False])
def test_tensors_that_travel_out_of_band_fetch_right_on_every_path(client, mode):
    """8 MiB tensors (out of band: ``tensor_bytes.OUT_OF_BAND`` is 1 MiB) of several dtypes, in a pytree with a small
    one, fetched on the answer sockets, on the comm channel and through tasks alone."""
    from dask_monarch.protocol.tensor_bytes import OUT_OF_BAND

    with dask.config.set({"monarch.answer-channel": mode}):
        with dm.attach(client, dims={"dp": 1}, comm_timeout=120) as mesh:
            with mesh.activate():
                a = torch.arange(2**21, dtype=torch.int32)
                b = torch.arange(2**20, dtype=torch.float64) / 3
                c = torch.ones(4, 2**19, dtype=torch.bfloat16)
            got = dm.fetch_shard({"a": a, "b": (b, c), "small": a[:3]}).result(timeout=120)
            assert torch.equal(got["a"], torch.arange(2**21, dtype=torch.int32))
            assert torch.equal(got["b"][0], torch.arange(2**20, dtype=torch.float64) / 3)
            assert got["b"][1].dtype == torch.bfloat16 and got["b"][1].shape == (4, 2**19)
            assert torch.equal(got["b"][1], torch.ones(4, 2**19, dtype=torch.bfloat16))
            assert got["small"].tolist() == [0, 1, 2] and got["b"][1].nbytes >= OUT_OF_BAND
            got["a"][0] = 7  # the fetched tensors are the program's own, writable memory
