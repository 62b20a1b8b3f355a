"""The answer sockets, the fast path of the answer channel (issue 13 item 1; ``controller/sockets.py``,
``worker/sockets.py``): used by default, Dask config ``monarch.answer-channel`` to choose the path, and the comm
channel taking over, nothing lost, when the sockets cannot be opened, break mid-session, or a worker stops (SIGSTOP)
with a batch half written. TLS: ``tests/test_security.py``; what a session leaves behind: ``tests/test_release.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import dask
import pytest
import torch
from distributed import Client, LocalCluster

import dask_monarch as dm
from conftest import wait_until
from dask_monarch.controller import sockets as controller_sockets
from dask_monarch.worker.plugin import PLUGIN_NAME

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
            os.kill(victim_pid, signal.SIGSTOP)
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
    end = SocketEnd("0123456789abcdef", 0, box, box, "127.0.0.1", None, lost.append)
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
