"""The answer sockets, the fast path of the answer channel (issue 13 item 1; ``controller/sockets.py``,
``worker/sockets.py``): used by default, Dask config ``monarch.answer-channel`` to choose the path, and the comm
channel taking over, nothing lost, when the sockets cannot be opened, break mid-session, or a worker stops (SIGSTOP)
with a batch half written. TLS: ``tests/test_security.py``; what a session leaves behind: ``tests/test_release.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import dask
import pytest
import torch
from distributed import Client, LocalCluster

import dask_monarch as dm
from conftest import wait_until
from dask_monarch.controller import sockets as controller_sockets
from dask_monarch.protocol import frames
from dask_monarch.worker.plugin import PLUGIN_NAME
from processes import sigstop

TIMEOUT = 60


@pytest.fixture(autouse=True)
def _a_link_per_rank():
    """These tests are about each rank's own answer sockets: no host relay (``monarch.answer-tree``; the relays have
    tests/test_tree.py)."""
    with dask.config.set({"monarch.answer-tree": False}):
        yield


def _socket_threads(session_id: str) -> list:
    """The session's answer-socket threads on a worker (``Client.run``)."""
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith(f"monarch-{session_id[:8]}-socket")]


def _break_worker_end(session_id: str, dask_worker=None) -> bool:
    """Shut the worker's down socket of the session (``Client.run``): its end closes, the comm takes over."""
    import socket as socket_module

    tw = dask_worker.plugins[PLUGIN_NAME].sessions[session_id]
    end = tw.outbox._channel
    if type(end).__name__ != "SocketEnd":
        return False
    socket_module.socket.shutdown(end._down, socket_module.SHUT_RDWR)
    return True


@pytest.fixture(scope="module")
def client2():
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0", silence_logs=40) as cluster:
        with Client(cluster, set_as_default=False) as client:
            yield client


def test_a_fetch_is_answered_on_the_sockets_by_default(client2):
    with dm.attach(client2, dims={"dp": 2}, comm_timeout=60) as mesh:
        channels = mesh._session.channels
        assert channels.mode == "socket" and all(link is not None for link in channels.links), channels.socket_reasons
        with mesh.activate():
            t = torch.arange(4.0) + mesh.rank("dp")
        before = list(channels.socket_chunks)
        for _ in range(3):
            assert torch.equal(dm.inspect(t, dp=1), torch.arange(4.0) + 1)
            assert torch.equal(dm.fetch_shard(t, dp=0).result(timeout=TIMEOUT), torch.arange(4.0))
        assert all(after >= b + 6 for after, b in zip(channels.socket_chunks, before)), channels.socket_chunks
        assert channels.comm_chunks == [0, 0]


@pytest.mark.parametrize("value", ["comm", False])
def test_the_config_key_chooses_the_comm_channel_or_none(client2, value):
    with dask.config.set({"monarch.answer-channel": value}):
        with dm.attach(client2, dims={"dp": 2}, comm_timeout=60) as mesh:
            channels = mesh._session.channels
            with mesh.activate():
                t = torch.ones(2) * 5
            assert dm.inspect(t).tolist() == [5.0, 5.0]
            if value is False:
                assert channels is None
            else:
                assert channels.mode == "comm" and channels.links == [None, None]
                assert channels.comm_chunks[0] > 0 and channels.socket_chunks == [0, 0]


def test_a_bad_config_value_is_refused_naming_the_key(client2):
    with dask.config.set({"monarch.answer-channel": "udp"}):
        with pytest.raises(ValueError, match=r"monarch\.answer-channel.*'udp'"):
            dm.attach(client2, dims={"dp": 2}, comm_timeout=60)


def test_sockets_that_cannot_be_opened_leave_the_comm_channel_and_the_worker_stops_waiting(client2, monkeypatch):
    def refuse(offer, ssl_context, timeout):
        raise ConnectionRefusedError("refused by the test")

    monkeypatch.setattr(controller_sockets, "connect_pair", refuse)
    with dm.attach(client2, dims={"dp": 2}, comm_timeout=60) as mesh:
        session = mesh._session
        channels = session.channels
        assert channels.links == [None, None]
        assert "refused by the test" in channels.socket_reasons[0] and "refused by the test" in channels.socket_reasons[1]
        with mesh.activate():
            t = torch.arange(3.0) * 2
        assert dm.inspect(t).tolist() == [0.0, 2.0, 4.0]
        assert channels.comm_chunks[0] > 0 and channels.socket_chunks == [0, 0]
        # told on the comm that nobody connects, the workers close their listeners at once (not after 10 s)
        assert wait_until(lambda: not any(client2.run(_socket_threads, session.id).values()), 5)


@pytest.mark.parametrize("side", ["worker", "controller"])
def test_sockets_that_break_mid_session_lose_nothing(client2, side):
    """A break while a fetch is in flight (the worker's answer then comes on the comm channel, the chunks it had
    pushed and not had acknowledged included), then more fetches: every value is right."""
    with dm.attach(client2, dims={"dp": 2}, comm_timeout=60) as mesh:
        session = mesh._session
        channels = session.channels
        with mesh.activate():
            t = torch.arange(4.0) + mesh.rank("dp")
            slow = dm.remote(lambda x: (time.sleep(1.0), x * 10)[1], propagate=lambda x: torch.empty_like(x))(t)
        assert dm.inspect(t, dp=1).tolist() == [1.0, 2.0, 3.0, 4.0]
        in_flight = dm.fetch_shard(slow, dp=1)
        if side == "worker":
            assert client2.run(_break_worker_end, session.id, workers=[mesh.workers[1]]) == {mesh.workers[1]: True}
        else:
            socket.socket.shutdown(channels.links[1].up, socket.SHUT_RDWR)
        assert torch.equal(in_flight.result(timeout=TIMEOUT), (torch.arange(4.0) + 1) * 10)
        assert wait_until(lambda: channels.links[1] is None, TIMEOUT, 0.05)
        assert "lost" in channels.socket_reasons[1]
        comm_before = channels.comm_chunks[1]
        for i in range(3):
            with mesh.activate():
                u = t + i
            assert dm.inspect(u, dp=1).tolist() == [1.0 + i, 2.0 + i, 3.0 + i, 4.0 + i]
            assert dm.inspect(u, dp=0).tolist() == [0.0 + i, 1.0 + i, 2.0 + i, 3.0 + i]
        assert channels.comm_chunks[1] > comm_before
        assert channels.links[0] is not None  # the other rank keeps its sockets
        session.sync("after the break").result(timeout=TIMEOUT)
        assert wait_until(lambda: not client2.run(_socket_threads, session.id, workers=[mesh.workers[1]])[
            mesh.workers[1]], TIMEOUT)


@pytest.mark.filterwarnings("ignore:Sending large graph")
def test_a_stopped_worker_never_blocks_a_flush_for_longer_than_the_send_bound(monkeypatch):
    """Rank 1 stopped (SIGSTOP) while a batch larger than the socket buffers is written to it: the write gives up
    after ``SEND_TIMEOUT`` (plus the batch's size at ``MIN_RATE``), the rank falls back to the comm channel, the
    fetch from it times out naming it, and once it resumes the session goes on, every value right."""
    monkeypatch.setattr(controller_sockets.SocketLink, "SEND_TIMEOUT", 1.0)
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0", silence_logs=50) as cluster:
        with Client(cluster, set_as_default=False) as client:
            mesh = dm.attach(client, dims={"dp": 2}, comm_timeout=60)
            session = mesh._session
            channels = session.channels
            with mesh.activate():
                x = mesh.rank("dp") + torch.zeros(2)
            assert dm.inspect(x, dp=1).tolist() == [1.0, 1.0]
            victim = mesh.workers[1]
            victim_pid = client.run(os.getpid, workers=[victim])[victim]
            blob = bytes(64 * 2**20)  # an argument of 64 MiB: more than the socket buffers hold
            sigstop(victim_pid)
            try:
                start = time.monotonic()
                with mesh.activate():
                    y = dm.remote(lambda a, b: a + (len(b) > 0), propagate=lambda a, b: torch.empty_like(a))(x, blob)
                    session.flush()
                    sent = time.monotonic() - start
                    assert channels.links[1] is None and "lost" in channels.socket_reasons[1], channels.socket_reasons
                    assert channels.links[0] is not None
                    with pytest.raises(TimeoutError, match=rf"rank 1 \({victim}\)"):
                        dm.fetch_shard(y, dp=1).result(timeout=2)
                # the write's bound: SEND_TIMEOUT (1 s) + 64 MiB at MIN_RATE (32 MiB/s) = 3 s, and the rest
                assert sent < 20, sent
            finally:
                os.kill(victim_pid, signal.SIGCONT)
            assert dm.inspect(y, dp=1).tolist() == [2.0, 2.0]
            assert dm.inspect(y, dp=0).tolist() == [1.0, 1.0]
            mesh.exit()


class _Box:
    """Stand-ins for the inbox and outbox of ``SocketEnd`` (this test drives its accept alone)."""

    def __init__(self):
        self.attached = []

    def put(self, batch, segments):
        pass

    def acked(self, chunk):
        pass

    def attach(self, end):
        self.attached.append(end)

    def detach(self, end):
        pass


def test_the_worker_end_accepts_only_the_token_it_offered():
    from dask_monarch.protocol.frames import ACCEPTED, DOWN, UP, recv_exact
    from dask_monarch.worker.sockets import SocketEnd

    box = _Box()
    lost = []
    end = SocketEnd("0123456789abcdef", 0, box, box, "127.0.0.1", None, lost.append, 2**30)
    try:
        offer = end.offer
        wrong = socket.create_connection((offer["host"], offer["port"]), timeout=10)
        wrong.sendall(bytes(32) + DOWN)
        assert wrong.recv(1) == b""  # closed, no ACCEPTED
        wrong.close()
        good = []
        for direction in (DOWN, UP):
            s = socket.create_connection((offer["host"], offer["port"]), timeout=10)
            s.sendall(offer["token"] + direction)
            assert bytes(recv_exact(s, 1)) == ACCEPTED
            good.append(s)
        end.attach()
        assert wait_until(lambda: box.attached == [end], 10)
    finally:
        end.close()
        end.thread.join(10)
    assert not end.thread.is_alive() and lost == []
    for s in good:
        s.close()


def _connect_end(end, direction):
    from dask_monarch.protocol.frames import ACCEPTED, recv_exact

    s = socket.create_connection((end.offer["host"], end.offer["port"]), timeout=10)
    s.sendall(end.offer["token"] + direction)
    assert bytes(recv_exact(s, 1)) == ACCEPTED
    return s


def test_an_idle_and_a_wrong_connection_delay_nothing_and_are_closed_after_the_token_bound():
    """Issue 26 item 6: connections opened before the controller's (one idle, one with a wrong token, one that
    sends half a token) do not hold up the controller's, which are accepted at once; the idle ones are closed
    after ``TOKEN_TIMEOUT``."""
    from dask_monarch.protocol.frames import DOWN, UP
    from dask_monarch.worker import sockets as worker_sockets
    from dask_monarch.worker.sockets import SocketEnd

    box = _Box()
    lost = []
    end = SocketEnd("0123456789abcdef", 0, box, box, "127.0.0.1", None, lost.append, 2**30)
    strays, good = [], []
    try:
        address = (end.offer["host"], end.offer["port"])
        strays = [socket.create_connection(address, timeout=10) for _ in range(3)]
        strays[1].sendall(bytes(32) + UP)  # a wrong token
        strays[2].sendall(end.offer["token"][:10])  # half the token, then nothing
        time.sleep(0.2)  # the worker has accepted them all
        start = time.monotonic()
        good = [_connect_end(end, DOWN), _connect_end(end, UP)]
        took = time.monotonic() - start
        assert took < worker_sockets.TOKEN_TIMEOUT / 2, took  # not after an idle connection's bound
        end.attach()
        assert wait_until(lambda: box.attached == [end], 10)
        for s in strays:  # each closed: the wrong one at once, the idle ones at their bound
            s.settimeout(worker_sockets.TOKEN_TIMEOUT + 10)
            assert s.recv(1) == b""
    finally:
        end.close()
        end.thread.join(10)
        for s in strays + good:
            s.close()
    assert not end.thread.is_alive() and lost == []


def test_a_frame_larger_than_the_session_can_receive_is_refused_before_allocating():
    """Issue 26 item 6: with the token, a header that declares more than the worker's limit ends the sockets with
    an error that says so; one within the limit allocates only as its bytes arrive (RSS grows by far less than
    the 1 GiB declared while none came)."""
    import psutil

    from dask_monarch.protocol.frames import DOWN, HEADER, UP
    from dask_monarch.worker.sockets import SocketEnd

    me = psutil.Process()
    for declared, limit in ((2**40, 2**32), (2**30, 2**32)):
        box = _Box()
        lost = []
        end = SocketEnd("0123456789abcdef", 0, box, box, "127.0.0.1", None, lost.append, limit)
        down = up = None
        try:
            down, up = _connect_end(end, DOWN), _connect_end(end, UP)
            end.attach()
            assert wait_until(lambda: box.attached == [end], 10)
            before = me.memory_info().rss
            down.sendall(HEADER.pack(declared, 0) + bytes(1000))
            if declared > limit:
                assert wait_until(lambda: lost, 10)
                assert type(lost[0]).__name__ == "FrameTooLarge"
                assert f"declares {declared} bytes, more than this session can receive ({limit} bytes)" in str(lost[0])
            else:
                time.sleep(0.5)
                assert not lost and end.thread.is_alive()
            assert me.memory_info().rss - before < 100 * 2**20, (me.memory_info().rss - before) / 2**20
        finally:
            end.close()
            end.thread.join(10)
            for s in (down, up):
                if s is not None:
                    s.close()
        assert not end.thread.is_alive()


def _set_token_timeout(seconds: float) -> float:
    """Set the worker's ``TOKEN_TIMEOUT`` (``Client.run``); the value before."""
    from dask_monarch.worker import sockets as worker_sockets

    before, worker_sockets.TOKEN_TIMEOUT = getattr(worker_sockets, "TOKEN_TIMEOUT", seconds), seconds
    return before


def test_an_idle_connection_before_the_controllers_leaves_the_session_on_its_sockets(client2, monkeypatch):
    """Issue 26 item 6: an idle connection and a wrong-token one to each offered port, opened before the controller
    connects (a port scanner), neither delay the controller's connections (the workers' ``TOKEN_TIMEOUT`` is raised
    to 60 s here: waiting for the idle one would take that long) nor cost the session its sockets."""
    real = frames.connect  # each socket of the pair (``frames.connect_pair``)
    strays, times = [], []

    def stray_first(offer, direction, ssl_context, timeout):
        if direction == b"d":
            strays.append(socket.create_connection((offer["host"], offer["port"]), timeout=10))
            wrong = socket.create_connection((offer["host"], offer["port"]), timeout=10)
            wrong.sendall(bytes(33))
            strays.append(wrong)
            time.sleep(0.2)  # the worker has accepted them
        start = time.monotonic()
        try:
            return real(offer, direction, ssl_context, timeout)
        finally:
            times.append(time.monotonic() - start)

    monkeypatch.setattr(frames, "connect", stray_first)
    before = client2.run(_set_token_timeout, 60.0)
    try:
        with dm.attach(client2, dims={"dp": 2}, comm_timeout=60) as mesh:
            channels = mesh._session.channels
            assert all(link is not None for link in channels.links) and not channels.socket_reasons, \
                channels.socket_reasons
            assert len(strays) == 4 and len(times) == 4
            assert max(times) < 10, times
            with mesh.activate():
                t = torch.arange(3.0) + mesh.rank("dp")
            assert dm.inspect(t, dp=1).tolist() == [1.0, 2.0, 3.0]
            assert channels.socket_chunks[1] > 0 and channels.comm_chunks == [0, 0]
    finally:
        client2.run(_set_token_timeout, next(iter(before.values())))
        for s in strays:
            s.close()


def test_a_frame_is_checked_against_the_limit_before_its_buffers_are_read():
    """``frames.recv_frame``: a header that declares too many buffers, or buffers too large in all, raises
    ``FrameTooLarge`` naming the size and the limit before reading on; within the limit, a frame of out-of-band
    tensor buffers comes back whole (the tensors over the received buffers, writable)."""
    import struct

    from dask_monarch.protocol import tensor_bytes
    from dask_monarch.protocol.frames import HEADER, FrameTooLarge, recv_frame, send_frame

    a, b = socket.socketpair()
    try:
        a.sendall(HEADER.pack(10, 2**32 - 1))
        with pytest.raises(FrameTooLarge, match=r"declares \d+ bytes, more than this session can receive \(4096 b"):
            recv_frame(b, 4096)
        a.sendall(HEADER.pack(10, 2) + struct.pack("<QQ", 2**20, 2**30))
        with pytest.raises(FrameTooLarge, match=r"declares 1074790410 bytes.*\(2097152 bytes\)"):
            recv_frame(b, 2**21)
    finally:
        a.close()
        b.close()
    a, b = socket.socketpair()
    try:
        x = torch.arange(2**19, dtype=torch.int64)
        chunk = tensor_bytes.dumps((3, [x, x[:2].clone()]))
        assert type(chunk) is tensor_bytes.OutOfBand and len(chunk.buffers) == 1
        sender = threading.Thread(target=send_frame, args=(a, {"c": 3, "d": chunk}, 10.0))
        sender.start()
        msg = recv_frame(b, 2**23)
        sender.join()
        n, (got, small) = msg["d"]
        assert msg["c"] == n == 3 and torch.equal(got, x) and small.tolist() == [0, 1]
        got[0] = -1  # its own memory: writable, and not the sender's
        assert x[0].item() == 0
    finally:
        a.close()
        b.close()


def test_a_small_frame_goes_in_one_send_and_a_full_socket_falls_back_to_the_bounded_write():
    """``frames.send_frame``: a small frame on a blocking socket with room goes out in one ``send`` (no ``poll``, no
    ``settimeout``) and leaves the socket blocking; when the peer's buffers are full, the rest of the frame is
    written within the bound (whole, in order), and a peer that stopped reading raises ``TimeoutError``."""
    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        frames.send_frame(a, {"x": 1}, 5.0)
        assert frames.recv_frame(b, 1 << 20) == {"x": 1}
        assert a.gettimeout() is None
        got = []
        reader = threading.Thread(target=lambda: got.extend(frames.recv_frame(b, 1 << 20)["i"] for _ in range(20)))
        reader.start()
        for i in range(20):  # 60 kB each, far more than the socket buffers hold: most need the bounded write
            frames.send_frame(a, {"i": i, "d": bytes(60_000)}, 5.0)
            assert a.gettimeout() is None
        reader.join(30)
        assert got == list(range(20))
        with pytest.raises(TimeoutError):
            for _ in range(200):  # nobody reads b any more
                frames.send_frame(a, {"d": bytes(60_000)}, 0.2)
    finally:
        a.close()
        b.close()
