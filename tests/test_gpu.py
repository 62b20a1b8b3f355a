"""GPU workers (issue 4; spec §4, §5): each worker pins its own GPU, streams are CUDA streams, collectives run
on NCCL bootstrapped through the scheduler. Skipped without two CUDA devices (CI has none); run them on a GPU
machine with ``pytest -m gpu tests/test_gpu.py``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dask_monarch as dm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
    ),
]

TIMEOUT = 120
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gpu_client():
    from distributed import Client

    from dask_monarch.cluster import start_local_cluster

    cluster = start_local_cluster(2, silence_logs=40)
    with Client(cluster) as client:
        client.wait_for_workers(2, timeout=120)
        yield client
    cluster.close()


@pytest.fixture
def mesh(gpu_client):
    m = dm.attach(gpu_client, dims={"gpu": 2}, comm_timeout=120)
    yield m
    try:
        m.exit()
    except Exception:
        pass


def gpu_identity():
    """This worker's device index and the PCI bus id of the GPU it computes on."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return torch.tensor([torch.cuda.current_device(), props.pci_bus_id, props.pci_device_id])


def fetch(t, **coords):
    return dm.fetch_shard(t, **coords).result(timeout=TIMEOUT)


def test_each_worker_pins_its_own_gpu(mesh):
    ids = dm.remote(gpu_identity, propagate=lambda: torch.empty(3, dtype=torch.int64))
    with mesh.activate():
        ident = ids()
    a, b = fetch(ident, gpu=0), fetch(ident, gpu=1)
    assert a[0] == b[0] == 0  # rotated CUDA_VISIBLE_DEVICES: a worker's own GPU is its device 0
    assert (a[1], a[2]) != (b[1], b[2])  # ... and the two workers' GPUs differ


def stream_facts(x):
    """On the worker: x's device type and whether the current stream is the device's default stream."""
    return torch.tensor([int(x.is_cuda), int(torch.cuda.current_stream() == torch.cuda.default_stream())])


def test_tensors_live_on_the_gpu_and_ops_use_the_stream(mesh):
    with mesh.activate():
        x = torch.ones(8, device="cuda") * (mesh.rank("gpu") + 1)
        facts = dm.remote(stream_facts, propagate=lambda x: torch.empty(2, dtype=torch.int64))(x)
    assert x.device.type == "cuda"
    assert fetch(facts, gpu=1).tolist() == [1, 1]  # the session's main stream is the device's default stream
    assert torch.equal(fetch(x, gpu=1), torch.full((8,), 2.0))  # fetched values arrive on CPU


def test_all_reduce_on_nccl(mesh):
    with mesh.activate():
        x = torch.ones(1024, device="cuda") * (mesh.rank("gpu") + 1)
        s = x.reduce("gpu", "sum")
        a = x.reduce("gpu", "avg")
    assert torch.equal(fetch(s, gpu=0), torch.full((1024,), 3.0))
    assert torch.equal(fetch(a, gpu=1), torch.full((1024,), 1.5))


def test_reduce_variants_on_two_ranks(mesh):
    with mesh.activate():
        r = mesh.rank("gpu").to(torch.float32)
        x = torch.arange(6.0, device="cuda").reshape(2, 3) + 10 * r
        stack = x.reduce("gpu", "stack")
        rs = x.reduce("gpu", "sum", scatter=True)
        a2a = x.reduce("gpu", "stack", scatter=True)
        out = torch.zeros(2, 3, device="cuda")
        into = x.reduce("gpu", "max", out=out)
        y = x.clone()
        y.reduce_("gpu", "min")
    local = [torch.arange(6.0).reshape(2, 3) + 10 * g for g in range(2)]
    assert torch.equal(fetch(stack, gpu=1), torch.stack(local))
    total = local[0] + local[1]
    assert torch.equal(fetch(rs, gpu=0), total[0]) and torch.equal(fetch(rs, gpu=1), total[1])
    assert torch.equal(fetch(a2a, gpu=1), torch.stack([local[0][1], local[1][1]]))
    assert torch.equal(fetch(out, gpu=0), local[1]) and torch.equal(fetch(into, gpu=0), local[1])
    assert torch.equal(fetch(y, gpu=1), local[0])


def test_digits_example_on_two_gpus():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_digits.py"), "--device", "cuda", "--workers", "2"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"test_accuracy=(\d\.\d{4})", last)
    assert match and float(match.group(1)) >= 0.95, out.stdout[-2000:]


# ------------------------------------------------------------------------------------------ streams, borrows
def side_stream_overlaps_main(x):
    """On the side stream's thread: wait until the main (default) CUDA stream is busy with its long kernel, run
    this stream's own work to completion, and report whether the main stream was still busy then: True only if
    the two CUDA streams run concurrently (spec §4, test streams_run_parallel)."""
    import time

    main = torch.cuda.default_stream()
    deadline = time.monotonic() + 30
    while main.query() and time.monotonic() < deadline:  # the main stream thread has not launched its kernel yet
        time.sleep(0.001)
    y = (x * 2).sum()
    torch.cuda.current_stream().synchronize()
    return torch.tensor([int(not main.query()), int(y.item() == 2 * x.numel())])


def long_kernel(x, cycles: int = 2_000_000_000):
    """A kernel that keeps the GPU's current stream busy for ``cycles`` GPU clock cycles (2e9: about a second on
    an H200), then returns x + 1."""
    torch.cuda._sleep(cycles)
    return x + 1


def test_streams_run_parallel_on_cuda_streams(mesh):
    side = dm.Stream("side")
    overlaps = dm.remote(side_stream_overlaps_main, propagate=lambda x: torch.empty(2, dtype=torch.int64))
    busy = dm.remote(long_kernel, propagate=lambda x, cycles=0: torch.empty_like(x))
    with mesh.activate():
        x = torch.ones(16, device="cuda")
        xs, borrow = side.borrow(x)
        # load both streams' kernels first: with CUDA's lazy module loading (the default), loading a kernel while
        # another runs waits for it (measured on the H200s: the side's work took the main kernel's full second)
        warm = busy(x, 1)
        with side.activate():
            warm_side = torch.mul(xs, 2).sum()
        dm.inspect(warm)
        dm.inspect(warm_side)
        slow = busy(x)
        with side.activate():
            facts = overlaps(xs)
        borrow.drop()
    assert fetch(facts, gpu=0).tolist() == [1, 1] and fetch(facts, gpu=1).tolist() == [1, 1]
    assert torch.equal(fetch(slow, gpu=1), torch.full((16,), 2.0))


def test_borrow_cuda_mutation_is_visible_at_the_origin(mesh):
    """borrow.rs borrow_cuda through the controller: a mutable borrow onto a new CUDA stream, written there; after
    the drop the origin's stream sees the write (CUDA events order the two streams)."""
    side = dm.Stream("side")
    with mesh.activate():
        x = torch.ones(2, 3, device="cuda") * (mesh.rank("gpu") + 1)
        slow = dm.remote(long_kernel, propagate=lambda x: torch.empty_like(x))(x)  # keeps the origin's stream busy
        xm, borrow = side.borrow(x, mutable=True)
        with side.activate():
            xm.sub_(1)
        borrow.drop()
        after = x * 10
        with side.activate():
            on_side = torch.full((2,), 5.0, device="cuda").reduce("gpu")  # the side stream's own NCCL comm
    assert torch.equal(fetch(after, gpu=0), torch.zeros(2, 3))
    assert torch.equal(fetch(after, gpu=1), torch.full((2, 3), 10.0))
    assert torch.equal(fetch(slow, gpu=1), torch.full((2, 3), 3.0))
    assert torch.equal(fetch(on_side, gpu=1), torch.full((2,), 10.0))


def test_borrow_errored_value_on_cuda(mesh):
    def fail(x):
        raise ValueError("no tensor for you")

    side = dm.Stream("side")
    with mesh.activate():
        x = torch.ones(4, device="cuda")
        bad = dm.remote(fail, propagate=lambda x: torch.empty_like(x))(x)
        bs, borrow = side.borrow(bad)
        with side.activate():
            dependent = bs - 1
            fine = torch.ones(2, device="cuda") + 1
        borrow.drop()
    with pytest.raises(dm.RemoteException, match="no tensor for you"):
        fetch(dependent, gpu=1)
    assert torch.equal(fetch(fine, gpu=0), torch.full((2,), 2.0))


# ------------------------------------------------------------------------------------------ failures, clusters
def _slow_add(x):
    import time

    time.sleep(3)
    return x + 1


def test_killed_peer_during_an_nccl_reduce_fails_the_session_naming_it():
    """A rank killed while its peer waits in an NCCL all-reduce: the controller gets a ``SessionError`` naming the
    rank within seconds (not at comm_timeout), and a new session on the restarted worker works (spec §5)."""
    import signal
    import time

    from distributed import Client

    from dask_monarch.cluster import start_local_cluster

    cluster = start_local_cluster(2, silence_logs=50)
    try:
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=120)
            mesh = dm.attach(client, dims={"gpu": 2}, comm_timeout=120)
            with mesh.activate():
                x = torch.ones(1 << 20, device="cuda") * (mesh.rank("gpu") + 1)
                first = x.reduce("gpu")
            assert fetch(first, gpu=0)[:3].tolist() == [3.0] * 3  # the communicator exists before the kill
            with mesh.activate():
                total = dm.remote(_slow_add, propagate=lambda x: torch.empty_like(x))(x).reduce("gpu")
            future = dm.fetch_shard(total)
            victim = mesh.workers[1]
            time.sleep(1)
            os.kill(client.run(os.getpid)[victim], signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(dm.SessionError, match=r"rank 1 \(" + victim):
                future.result(timeout=TIMEOUT)
            assert time.monotonic() - start < 60
            mesh.exit()
            client.wait_for_workers(2, timeout=120)
            with dm.attach(client, dims={"gpu": 2}, comm_timeout=120) as again:
                with again.activate():
                    y = torch.ones(4, device="cuda").reduce("gpu")
                assert fetch(y, gpu=1).tolist() == [2.0] * 4
    finally:
        cluster.close()


@pytest.mark.parametrize("visible", [["0,1", "1,0"], [None, None]], ids=["rotated", "every-gpu-visible"])
def test_command_line_workers_take_distinct_gpus(tmp_path, visible):
    """Workers started with ``dask worker`` as ``dask cuda worker`` starts them (rotated CUDA_VISIBLE_DEVICES), or
    all seeing every GPU: each rank computes on its own GPU and NCCL works across them (issue 4, item 1)."""
    from distributed import Client

    from conftest import _cli_cluster

    gen = _cli_cluster(tmp_path, [()] * len(visible), [{"CUDA_VISIBLE_DEVICES": v} for v in visible])
    address, _ = next(gen)
    try:
        with Client(address) as client:
            client.wait_for_workers(2, timeout=120)
            with dm.attach(client, dims={"gpu": 2}, comm_timeout=120) as mesh:
                ids = dm.remote(gpu_identity, propagate=lambda: torch.empty(3, dtype=torch.int64))
                with mesh.activate():
                    ident = ids()
                    total = torch.ones(8, device="cuda").reduce("gpu")
                a, b = fetch(ident, gpu=0), fetch(ident, gpu=1)
                assert (a[1], a[2]) != (b[1], b[2])
                assert torch.equal(fetch(total, gpu=1), torch.full((8,), 2.0))
    finally:
        gen.close()


def test_fetches_from_gpu_workers_come_back_on_the_answer_sockets(mesh):
    """Issue 13 item 1 on GPU workers: a fetched CUDA tensor (copied to the CPU on the worker) and a sync are
    answered on the answer sockets (``controller/sockets.py``), with the right values."""
    channels = mesh._session.channels
    assert all(link is not None for link in channels.links), channels.socket_reasons
    with mesh.activate():
        t = torch.arange(4.0) + mesh.rank("gpu")
        big = torch.ones(1 << 20) * mesh.rank("gpu")  # 4 MiB: larger than one socket buffer
    before = list(channels.socket_chunks)
    assert fetch(t, gpu=1).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert fetch(big, gpu=1).sum().item() == float(1 << 20)
    mesh._session.sync("after the GPU fetches").result(timeout=TIMEOUT)
    assert channels.socket_chunks[1] >= before[1] + 3 and channels.comm_chunks == [0, 0]
