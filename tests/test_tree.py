"""The fan-out and fan-in tree (issue 23 items 1 and 2; ``controller/tree.py``, ``worker/relay.py``): on a host of
several ranks, the controller keeps one link to the host leader's relay; a fetch costs the controller one answer
per host, not one per rank; a failure on a rank that is not the leader reaches the controller once, naming that
rank, its worker and the remote traceback; a killed leader fails the session naming its worker, within the
heartbeat bound. All ranks of a LocalCluster share one host (127.0.0.1)."""

from __future__ import annotations

import os
import signal
import time

import dask
import pytest
import torch
from distributed import Client, LocalCluster, wait

import dask_monarch as dm
from conftest import _cli_cluster, wait_until
from dask_monarch.controller.task_keys import parse_task_key
from dask_monarch.controller.tree import HostLink
from dask_monarch.protocol import RemoteFunctionFailed
from processes import sigstop
from test_remote_functions import bogus

TIMEOUT = 60


def test_a_fetch_costs_the_controller_one_answer_per_host(client4):
    with dm.attach(client4, dims={"host": 2, "gpu": 2}, comm_timeout=60) as mesh:
        channels = mesh._session.channels
        link = channels.relays[0]
        assert link is not None and channels.relays == [link] * 4 and link.ranks == [0, 1, 2, 3]
        assert channels.links == [None] * 4  # no rank has sockets of its own
        with mesh.activate():
            x = mesh.rank(mesh.names) * 10 + torch.arange(4.0)  # a value per rank: each rank got its own batches
        assert dm.inspect(x, host=1, gpu=1).tolist() == [30.0, 31.0, 32.0, 33.0]
        before = list(channels.host_chunks)
        n = 20
        for i in range(n):
            assert dm.inspect(x, host=i % 2, gpu=0).tolist() == [20.0 * (i % 2) + k for k in range(4)]
        assert channels.host_chunks[0] - before[0] == n  # one answer per fetch for the host's four ranks
        assert channels.host_chunks[1:] == before[1:] == [0, 0, 0]
        assert channels.socket_chunks == [0] * 4 and channels.comm_chunks == [0] * 4
        with mesh.activate():  # 4 MiB: its memory travels out of band, through the relay too
            big = torch.arange(2.0**20) + mesh.rank(mesh.names)
        assert torch.equal(dm.inspect(big, host=1, gpu=1), torch.arange(2.0**20) + 3)


def test_a_failure_on_a_rank_that_is_not_the_leader_names_that_rank(client4):
    with dm.attach(client4, dims={"host": 2, "gpu": 2}, comm_timeout=60, record_answers=True) as mesh:
        assert mesh._session.channels.relays[0].rank == 0  # rank 0 leads the host
        with mesh.activate():
            x = torch.rand(3, 4)
            z = bogus(x, torch.rand(3, 4), mesh.rank(mesh.names), fail_rank=2)
            a = z + x
        with pytest.raises(dm.RemoteException, match="do_bogus_tensor_work") as info:
            dm.fetch_shard(a, host=0, gpu=0).result(timeout=TIMEOUT)  # rank 0, where z did not fail
        assert info.value.rank == 2 and info.value.worker == mesh.workers[2]
        assert "mat1 and mat2 shapes cannot be multiplied" in info.value.backtrace
        failed = [rank for rank, m in mesh._session.answers if isinstance(m, RemoteFunctionFailed)]
        assert failed == [2]  # reported once, by rank 2


def test_the_per_rank_path_stays_with_the_config_key_off(client4):
    with dask.config.set({"monarch.answer-tree": False}):
        with dm.attach(client4, dims={"dp": 4}, comm_timeout=60) as mesh:
            channels = mesh._session.channels
            assert channels.relays == [None] * 4 and all(link is not None for link in channels.links)
            with mesh.activate():
                x = mesh.rank("dp") + torch.zeros(2)
            assert dm.inspect(x, dp=3).tolist() == [3.0, 3.0]
            assert all(n > 0 for n in channels.socket_chunks) and channels.host_chunks == [0] * 4


def _segments_of(fn, args) -> list:
    """The segments (or None, a receipt) of each batch a message task was submitted with (``transport._submit``)."""
    if fn.__name__ in ("deliver_batch", "sync_batch"):
        return [args[1]]
    return [segments for _, segments in args[0]]


@pytest.mark.parametrize("tree", [True, False])
def test_the_task_copies_of_relayed_batches_carry_their_numbers_alone(client4, tree):
    """Behind a host's relay a batch's only way is the relay (a lost relay fails the session), so its pinned Dask
    task (the dashboard's copy) carries the batch's number, not its bytes; without the relay it carries the bytes,
    the rank's way if its sockets break."""
    with dask.config.set({"monarch.answer-tree": tree}):
        with dm.attach(client4, dims={"dp": 4}, comm_timeout=60) as mesh:
            session = mesh._session
            submitted = []
            submit = session.client.submit

            def recording(fn, params, *args, **kwargs):  # the real submit, its arguments kept
                submitted.append((fn, args, kwargs))
                return submit(fn, params, *args, **kwargs)

            session.client.submit = recording
            try:
                for i in range(3):
                    with mesh.activate():
                        x = mesh.rank("dp") * 10 + torch.arange(3.0) + i
                    assert dm.inspect(x, dp=3).tolist() == [30.0 + i, 31.0 + i, 32.0 + i]
                session.flush()  # every batch's task now
            finally:
                del session.client.submit
            assert submitted
            for fn, args, kwargs in submitted:
                rank = parse_task_key(kwargs["key"])[2]
                assert kwargs["key"].startswith(f"monarch-{session.tag}-")
                assert kwargs["workers"] == [mesh.workers[rank]] and kwargs["allow_other_workers"] is False
                segments = _segments_of(fn, args)
                assert all(s is None for s in segments) if tree else all(s for s in segments), (fn, segments)
            futures = [f for fs in session._inflight for f in fs]
            wait(futures, timeout=TIMEOUT)
            assert all(f.status == "finished" for f in futures)  # the receipts ran on their ranks' workers


def slow(x):
    time.sleep(60)
    return x


@pytest.mark.parametrize("ranks, fanout, victim, kind", [(3, 8, 0, "leader"), (4, 2, 2, "sub-relay")])
def test_a_killed_relay_fails_the_session_naming_its_worker(ranks, fanout, victim, kind):
    """SIGKILL the worker of the host's relay (rank 0), or of a sub-relay (rank 2, with ``monarch.relay-fanout`` 2
    on 4 ranks): a fetch that waits on every rank fails within the heartbeat bound, naming that rank's worker."""
    with LocalCluster(n_workers=ranks, threads_per_worker=1, dashboard_address=":0", silence_logs=50) as cluster:
        with Client(cluster) as client:
            heartbeat = 20.0
            with dask.config.set({"monarch.relay-fanout": fanout}):
                mesh = dm.attach(client, dims={"dp": ranks}, comm_timeout=60, heartbeat_timeout=heartbeat)
            link = mesh._session.channels.relays[ranks - 1]
            assert link.rank == 0 and link.sub_relay.get(ranks - 1, 0) == victim
            with mesh.activate():
                x = mesh.rank("dp") + torch.zeros(2)
            assert dm.inspect(x, dp=ranks - 1).tolist() == [ranks - 1.0] * 2
            future = dm.fetch_shard(dm.remote(slow, propagate=lambda x: x)(x), dp=ranks - 1)  # waits on every rank
            worker = mesh.workers[victim]
            os.kill(client.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(dm.SessionError, match=rf"rank {victim} \(" + worker) as info:
                future.result(timeout=120)
            assert time.monotonic() - start < heartbeat
            if kind == "leader":
                assert "relay" in str(info.value)
            mesh.exit()  # already reported: exit cleans up without raising


def test_the_frame_reader_completes_frames_from_any_split_and_checks_the_limit():
    """``frames.FrameReader`` (the relay's one selector thread reads every rank with it): frames written by
    ``send_frame`` and delivered in pieces of any size (here 7 bytes, and 64 KiB) come back whole and in order,
    out-of-band tensor buffers included (an empty one too); the frames before an EOF are kept and then ``EOFError``
    is raised; a header that declares more than the limit raises ``FrameTooLarge`` before anything is allocated."""
    import selectors
    import socket

    from dask_monarch.protocol import tensor_bytes
    from dask_monarch.protocol.frames import HEADER, FrameReader, FrameTooLarge, send_frame

    x = torch.arange(2**17, dtype=torch.int64)  # 1 MiB: its memory out of band (``tensor_bytes.OUT_OF_BAND``)
    sent = [{"c": 0, "d": b"status"}, {"c": 1, "d": tensor_bytes.dumps((1, [x, torch.empty(0)]))}, {"x": True}]
    for piece in (7, 2**16):
        a, b = socket.socketpair()
        wire = []

        class _Sink:  # what send_frame writes, kept to be delivered in pieces
            def settimeout(self, t):
                pass

            def sendall(self, data):
                wire.append(bytes(data))

        for msg in sent:
            send_frame(_Sink(), msg, 10.0)
        data = b"".join(wire)
        b.setblocking(False)
        reader, got = FrameReader(b, 2**24), []
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(b, selectors.EVENT_READ)
                for start in range(0, len(data), piece):
                    a.sendall(data[start:start + piece])
                    if selector.select(1.0):
                        reader.read(got)
                a.close()
                with pytest.raises(EOFError):
                    while selector.select(1.0):
                        reader.read(got)
        finally:
            b.close()
        assert [m.get("c") for m in got] == [0, 1, None] and got[0]["d"] == b"status" and got[2] == {"x": True}
        assert type(sent[1]["d"]) is tensor_bytes.OutOfBand
        n, (tensor, empty) = got[1]["d"]
        assert n == 1 and torch.equal(tensor, x) and empty.numel() == 0
    a, b = socket.socketpair()
    try:
        a.sendall(HEADER.pack(2**40, 0))
        b.setblocking(False)
        time.sleep(0.1)
        with pytest.raises(FrameTooLarge, match=r"declares 1099511627776 bytes, more than this session can receive"):
            FrameReader(b, 2**20).read([])
    finally:
        a.close()
        b.close()


def test_the_frame_reader_takes_many_small_frames_of_one_read_and_a_large_one_after_them():
    """``frames.FrameReader``'s way between frames: every whole small frame of what one read took is unpickled from
    it, in order, and the frame cut at its end (here one with out-of-band buffers) is completed from the next reads;
    a small frame that declares more than the limit still raises ``FrameTooLarge``."""
    import selectors
    import socket

    from dask_monarch.protocol import tensor_bytes
    from dask_monarch.protocol.frames import HEADER, FrameReader, FrameTooLarge, send_frame

    x = torch.arange(2**17, dtype=torch.int64)  # 1 MiB: its memory out of band
    import threading

    a, b = socket.socketpair()
    for i in range(100):  # all there before the first read (they fit the socket's buffers)
        send_frame(a, {"c": i, "d": i}, 10.0)

    def write():  # the tensor's 1 MiB does not fit: written as it is read
        send_frame(a, {"c": 100, "d": tensor_bytes.dumps((1, [x]))}, 10.0)
        send_frame(a, {"x": True}, 10.0)
        a.close()

    writer = threading.Thread(target=write)
    try:
        b.setblocking(False)
        writer.start()
        reader, got = FrameReader(b, 2**24), []
        with selectors.DefaultSelector() as selector:
            selector.register(b, selectors.EVENT_READ)
            with pytest.raises(EOFError):
                while selector.select(1.0):
                    reader.read(got)
        assert [m.get("c") for m in got] == [*range(101), None] and [m["d"] for m in got[:100]] == list(range(100))
        assert torch.equal(got[100]["d"][1][0], x)
        assert type(tensor_bytes.dumps((1, [x]))) is tensor_bytes.OutOfBand
    finally:
        writer.join(30)
        b.close()
    a, b = socket.socketpair()
    try:
        a.sendall(HEADER.pack(10, 0) + bytes(10))
        b.setblocking(False)
        time.sleep(0.1)
        with pytest.raises(FrameTooLarge, match=r"declares 10 bytes, more than this session can receive \(4 bytes\)"):
            FrameReader(b, 4).read([])
    finally:
        a.close()
        b.close()


def test_a_big_host_gets_sub_relays_and_a_failure_under_one_names_its_rank(client4):
    """Dask config ``monarch.relay-fanout`` 2 on a host of 4 ranks: the host relay on rank 0 serves ranks 0 and 1
    itself and ranks 2 and 3 through a sub-relay on rank 2 (``tree.split_host``). Each rank still gets its own
    batches (a value per rank), a fetch still costs the controller one answer for the host, a 4 MiB value crosses
    both relays, and a failure on rank 3 reaches the controller once, naming rank 3 and its worker."""
    with dask.config.set({"monarch.relay-fanout": 2}):
        mesh = dm.attach(client4, dims={"dp": 4}, comm_timeout=60, record_answers=True)
    with mesh:
        channels = mesh._session.channels
        link = channels.relays[0]
        assert channels.relays == [link] * 4 and link.sub_relay == {2: 2, 3: 2}
        assert channels.links == [None] * 4
        with mesh.activate():
            x = mesh.rank("dp") * 10 + torch.arange(3.0)
        assert [dm.inspect(x, dp=r).tolist() for r in range(4)] == [[10.0 * r + k for k in range(3)] for r in range(4)]
        before = channels.host_chunks[0]
        for i in range(20):
            assert dm.inspect(x, dp=i % 4)[0].item() == 10.0 * (i % 4)
        assert channels.host_chunks[0] - before == 20 and channels.socket_chunks == [0] * 4
        with mesh.activate():
            big = torch.arange(2.0**20) + mesh.rank("dp")
            y = torch.rand(3, 4)
            z = bogus(y, torch.rand(3, 4), mesh.rank("dp"), fail_rank=3)
            a = z + y
        assert torch.equal(dm.inspect(big, dp=3), torch.arange(2.0**20) + 3)
        with pytest.raises(dm.RemoteException, match="do_bogus_tensor_work") as info:
            dm.fetch_shard(a, dp=0).result(timeout=TIMEOUT)
        assert info.value.rank == 3 and info.value.worker == mesh.workers[3]
        failed = [rank for rank, m in mesh._session.answers if isinstance(m, RemoteFunctionFailed)]
        assert failed == [3]


def test_a_bad_relay_fanout_is_refused_naming_the_key(client2):
    with dask.config.set({"monarch.relay-fanout": 1}):
        with pytest.raises(ValueError, match=r"monarch\.relay-fanout must be an integer of 2 or more, got 1"):
            dm.attach(client2, dims={"dp": 2}, comm_timeout=60)



def test_a_rank_lost_before_its_relay_closed_is_the_rank_named(tmp_path, monkeypatch):
    """Rank 1's worker is SIGKILLed (the relay on rank 0 reports its sockets broken, ``("l", 1)``), then rank 0's
    worker too, with the scheduler stopped so that its report of rank 1 leaving cannot come first, and before the
    grace of the relay's report ends: the relay closing is the second news, and the session's error leads with rank
    1's worker, not the relay on rank 0 (test_faults' iter_from_dask test once failed on an error that named only
    the relay on rank 0, whose worker had died after the victim's)."""
    monkeypatch.setattr(HostLink, "LOST_GRACE", 120.0)  # only the relay's end can fail the session
    for address, procs in _cli_cluster(tmp_path, [(), ()]):
        client = Client(address, set_as_default=False)
        try:
            client.wait_for_workers(2, timeout=60)
            # liveness checks far away: they would ask the stopped scheduler
            mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=60, liveness_interval=600)
            link = mesh._session.channels.relays[1]
            with mesh.activate():
                x = mesh.rank("dp") + torch.zeros(2)
            assert dm.inspect(x, dp=1).tolist() == [1.0] * 2
            # waits on both ranks (a lambda: the CLI workers cannot import this module)
            future = dm.fetch_shard(dm.remote(lambda x: (time.sleep(60), x)[1], propagate=lambda x: x)(x), dp=1)
            pids = client.run(os.getpid)
            leader, victim = mesh.workers[0], mesh.workers[1]
            sigstop(procs[0].pid)  # the scheduler
            try:
                os.kill(pids[victim], signal.SIGKILL)
                assert wait_until(lambda: 1 in link.lost_ranks, 60)
                os.kill(pids[leader], signal.SIGKILL)
                with pytest.raises(dm.SessionError) as info:
                    future.result(timeout=120)
            finally:
                os.kill(procs[0].pid, signal.SIGCONT)
            head = str(info.value).split("\n(meanwhile")[0]
            assert f"rank 1 ({victim})" in head, info.value
            mesh.exit()  # already reported: exit cleans up without raising
        finally:
            client.close()


def test_a_relay_closing_after_the_program_closed_its_client_names_the_client(client2):
    """The program closes the session's Client: the scheduler ends the session on the workers, relays included, and
    a rank's sockets to the relay, then the relay, close. That is not the news: the error names the closed Client,
    whichever notices first (a rank lost by the relay, the relay's end, or the session's own check of its Client)."""
    client = Client(client2.scheduler.address, set_as_default=False)
    mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=60)
    link = mesh._session.channels.relays[1]
    assert link is not None
    with mesh.activate():
        x = torch.ones(2) * 3
    assert dm.inspect(x, dp=1).tolist() == [3.0, 3.0]
    client.close()
    link._rank_lost(1, "EOFError: the peer closed the connection")
    link._gone(EOFError("the peer closed the connection"))
    with pytest.raises(dm.SessionError, match=rf"{client.id}\)? (was closed|disconnected)"):
        dm.inspect(x, dp=1)
    mesh.exit()  # already reported: quiet
