"""Which sockets a gloo group's abort shuts down (``worker/gloo.py``, ``comm._abort_gloo``): only those its
constructor opened, recorded with their identity. A peer's gloo port is reused once its listener closed, so an older
connection of another session's group to that port matches the new group's peers by address; the abort of either
must leave the other's connections alone (a suite run beside a CPU hog, 2026-12-05: a failed session's abort shut
down a healthy session's all-reduce). Real loopback sockets stand in for the two groups' connections."""

from __future__ import annotations

import socket

from dask_monarch.worker import gloo
from dask_monarch.worker.comm import _abort_gloo


def test_a_group_records_and_aborts_only_the_sockets_it_opened():
    with socket.create_server(("127.0.0.1", 0)) as listener:  # the peer's gloo port
        peers = [("127.0.0.1", listener.getsockname()[1])]
        older = socket.create_connection(peers[0], timeout=10)  # another group's connection to the same port
        older_peer, _ = listener.accept()
        before = gloo.socket_fds()
        own = socket.create_connection(peers[0], timeout=10)  # the group's own, opened while it is built
        own_peer, _ = listener.accept()
        try:
            by_address = {fd for fd, _ in gloo.group_sockets(None, peers)}
            assert by_address == {older.fileno(), own.fileno()}  # the address alone cannot tell them apart
            recorded = gloo.group_sockets(None, peers, since=before)
            assert [fd for fd, _ in recorded] == [own.fileno()]
            _abort_gloo((None, peers, recorded))
            own_peer.settimeout(10)
            assert own_peer.recv(1) == b""  # shut down: its peer reads the end
            older.sendall(b"x")
            older_peer.settimeout(10)
            assert older_peer.recv(1) == b"x"  # the other group's connection still works
        finally:
            for s in (older, older_peer, own, own_peer):
                s.close()
