"""A session's answer channels: one connection per (session, worker) that carries the batches ahead of their Dask
tasks and brings the answers back (issue 13; DESIGN.md "Decisions"; spec/dask-notes.md §1.3, §7 A).

A fetch through Dask tasks alone takes four or more hops (submit, compute-task, task-finished, gather), about
10 ms. With a channel, each batch is written on the rank's connection at once and still travels as a pinned Dask
task, a little later (``Session(task_interval=)``; the dashboard shows it, and the worker's inbox ignores the copy
that comes second). The worker pushes the answers the controller waits for (``Status``, ``SessionFailed``, with
the answers before them) on the connection (``worker/outbox.py``), where this side acknowledges each chunk; the
answers thread applies them (``answers.py``), in outbox order with those that come in task results.

The connection is opened with the ``Client``'s connection arguments, so it uses the client's ``Security`` (TLS
when the cluster uses it), like the client's own connections to workers. A rank whose channel cannot be opened
(a worker the controller cannot reach, a worker without this handler) or breaks works through tasks alone, as
before; what a broken channel did not deliver comes with the tasks.

The fast path (``mode="socket"``, the default): in the handshake the worker also offers a pair of answer sockets
(``sockets.py``, ``worker/sockets.py``), and once they are connected the batches and the answers travel on them,
written by the thread that sends and read by a thread at each end, with no event loop in between
(``bench/handoffs.py``: one small request/answer that way takes about a fifth of the time it takes through a Dask
comm). The comm stays open beside them: a rank whose sockets cannot be opened, or break, or time out, goes on
through it as before. Dask config ``monarch.answer-channel``: ``true`` or
``socket`` (the default) for the sockets, ``comm`` for the comm channel alone, ``false`` for tasks alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import pickle
import threading
import time

from distributed.comm import connect

from ..worker.channel import CHANNEL_OP
from .sockets import SocketLink
from .tree import relay_fanout, start_relays

__all__ = ["Channels", "MODES"]

#: the values of Dask config ``monarch.answer-channel`` that open channels (``False`` opens none)
MODES = ("socket", "comm")

logger = logging.getLogger("dask_monarch.controller")


class Channels:
    """The answer channels of ``session``, one per rank, with answer sockets if ``mode`` is ``"socket"``.
    ``open(timeout)`` opens them (a rank whose channel cannot be opened within ``timeout`` seconds has none:
    ``reasons`` says why; ``socket_reasons`` why a rank has no sockets); ``send(rank, batch, segments)`` writes a
    batch if the rank has a channel (True): on its sockets from this thread, else through the event loop, and
    returns; ``close()`` closes them. ``socket_chunks`` / ``comm_chunks``: per rank, the answer chunks that came on
    its sockets / its comm."""

    def __init__(self, session, mode: str = "socket", tree: bool = True):
        if mode not in MODES:
            raise ValueError(f"answer channel mode must be one of {MODES}, got {mode!r}")
        self.session = session
        self.client = session.client
        self.mode = mode
        self.comms: list = [None] * session.world_size  # each rank's open comm, or None
        self.links: list = [None] * session.world_size  # each rank's SocketLink, or None
        #: with ``tree``: each rank's ``HostLink`` (``tree.py``) when its host's relay carries its batches and answers
        self.relays: list = [None] * session.world_size
        self.tree = tree and mode == "socket"
        self.fanout = relay_fanout() if self.tree else 0  # Dask config monarch.relay-fanout (``ValueError``)
        #: per leader rank: the answer chunks its host's relay sent (one per fetch, for the whole host)
        self.host_chunks = [0] * session.world_size
        self._made: list = []  # every SocketLink made, lost ones included: joined at close
        self._offers: list = [None] * session.world_size  # what each worker offered in the handshake
        #: rank -> why it has no channel (not opened, or lost)
        self.reasons: dict[int, str] = {}
        #: rank -> why it has no answer sockets (refused, not connected, or lost), with ``mode="socket"``
        self.socket_reasons: dict[int, str] = {}
        self.socket_chunks = [0] * session.world_size
        self.comm_chunks = [0] * session.world_size
        #: the ranks whose worker said on the channel that the session ended there
        self.ended: set[int] = set()
        self._closing = False
        #: per rank: the answer chunks received and not yet acknowledged (on the event loop)
        self._acks: list[list] = [[] for _ in range(session.world_size)]
        self._outgoing: list = []  # (rank, comm, message) sent and not yet handed to the event loop
        self._outgoing_lock = threading.Lock()
        self._wake_pending = False  # a _write_outgoing is on its way to the event loop
        self._writing: set = set()  # the write tasks under way (asyncio keeps only weak references to tasks)

    # ---------------------------------------------------------------------------------------------- opening
    def open(self, timeout: float) -> None:
        """Open every rank's channel, all at once, bounded by ``timeout`` seconds (the seconds each step took go in
        ``session.attach_phases``: ``channels``, ``relays``, ``sockets``)."""
        start = time.perf_counter()
        try:
            self.client.sync(self._open_all, timeout, callback_timeout=timeout + 5)
        except Exception as e:
            for rank in range(len(self.comms)):
                if self.comms[rank] is None:
                    self.reasons.setdefault(rank, f"{type(e).__name__}: {e}")
        phases = self.session.attach_phases
        phases["channels"] = time.perf_counter() - start
        if self.mode == "socket":
            self._connect_sockets(timeout)

    def _connect_sockets(self, timeout: float) -> None:
        """Connect the answer sockets each worker offered, every rank at once (each within ``timeout`` seconds)."""
        ssl_context = self.client.connection_args.get("ssl_context")
        ranks = [rank for rank in range(len(self.comms)) if self.comms[rank] is not None]
        if self.tree:
            offers = {r: self._offers[r] for r in ranks if self._offers[r] is not None and "refused" not in
                      self._offers[r] and self._offers[r]["tls"] == (ssl_context is not None)}
            start = time.perf_counter()
            failed = start_relays(self, offers, ssl_context, timeout)
            self.session.attach_phases["relays"] = time.perf_counter() - start
            if failed:
                logger.warning("dask_monarch: session %s: no relay for %s; those ranks use their own answer sockets",
                               self.session._key, "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items())))
            ranks = [rank for rank in ranks if self.relays[rank] is None]
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max(1, min(32, len(ranks)))) as pool:
            for rank, why in zip(ranks, pool.map(lambda r: self._connect_rank(r, ssl_context, timeout), ranks)):
                if why is None:
                    continue
                self.socket_reasons[rank] = why
                offer = self._offers[rank]
                if offer is not None and "refused" not in offer:  # the worker stops waiting for them
                    self.client.loop.add_callback(self._write, rank, self.comms[rank], {"n": why})
        self.session.attach_phases["sockets"] = time.perf_counter() - start
        self._offers = [None] * len(self._offers)

    def _connect_rank(self, rank: int, ssl_context, timeout: float) -> str | None:
        """Connect rank ``rank``'s answer sockets; None, or why it has none."""
        offer = self._offers[rank]
        if offer is None or "refused" in offer:
            return "the worker offered none" if offer is None else f"the worker refused: {offer['refused']}"
        if offer["tls"] != (ssl_context is not None):
            return ("the worker's sockets want TLS and the client has no TLS context" if offer["tls"] else
                    "the worker's sockets have no TLS and the client uses TLS")
        try:
            link = SocketLink(self, rank, offer, ssl_context, timeout)
        except Exception as e:
            return f"could not connect to {offer['host']}:{offer['port']}: {type(e).__name__}: {e}"
        self._made.append(link)
        self.links[rank] = link
        return None
        if self.socket_reasons:
            logger.warning("dask_monarch: session %s: no answer sockets to %s; their batches and answers go on the "
                           "Dask comm channel", self.session._key,
                           "; ".join(f"rank {r} ({self.session.workers[r]}): {why}"
                                     for r, why in sorted(self.socket_reasons.items())))

    async def _open_all(self, timeout: float) -> None:
        await asyncio.gather(*(self._open(rank, timeout) for rank in range(len(self.comms))))

    async def _open(self, rank: int, timeout: float) -> None:
        session = self.session
        address = session.workers[rank]
        comm = None
        try:
            comm = await connect(address, timeout=timeout, **self.client.connection_args)
            await comm.write({"op": CHANNEL_OP, "reply": False, "params": pickle.dumps(session.params[rank]),
                              "sockets": self.mode == "socket"})
            answer = await asyncio.wait_for(comm.read(), timeout)
        except Exception as e:
            if comm is not None:
                comm.abort()
            self.reasons[rank] = f"{type(e).__name__}: {e}"
            return
        if not isinstance(answer, dict) or "ready" not in answer:  # a worker without the handler, or the session ended
            comm.abort()
            self.reasons[rank] = f"the worker answered {answer!r}"
            return
        self.comms[rank] = comm
        self._offers[rank] = answer.get("sockets")
        asyncio.ensure_future(self._read(rank, comm))

    # ------------------------------------------------------------------------------------------------ sending
    def send(self, rank: int, batch: int, segments: list) -> bool:
        """Write batch ``batch`` on rank ``rank``'s channel (from any thread; the event loop writes it). False if
        the rank has no channel. On the rank's answer sockets the batch is written here and now (``SocketLink``);
        else the batches sent before the event loop gets to them are written on one wake-up of the loop, in the
        order sent. A rank behind a host's relay: on the relay's sockets (``HostLink``)."""
        host = self.relays[rank]
        if host is not None:
            return host.send([(rank, batch, list(range(len(segments))))], segments)
        link = self.links[rank]
        if link is not None and link.send(batch, segments):
            return True
        comm = self.comms[rank]
        if comm is None:
            return False
        with self._outgoing_lock:
            self._outgoing.append((rank, comm, {"b": batch, "s": segments}))
            if self._wake_pending:
                return True
            self._wake_pending = True
        self.client.loop.add_callback(self._write_outgoing)
        return True

    def _write_outgoing(self) -> None:
        """On the event loop: start writing every batch sent so far, each carrying its rank's pending acks."""
        with self._outgoing_lock:
            outgoing, self._outgoing = self._outgoing, []
            self._wake_pending = False
        for rank, comm, msg in outgoing:
            acks = self._acks[rank]
            if acks:
                msg["a"], self._acks[rank] = acks, []
            self._writing.add(asyncio.ensure_future(self._write(rank, comm, msg)))

    async def _write(self, rank: int, comm, msg: dict) -> None:
        try:
            await comm.write(msg)
        except Exception as e:
            self._lost(rank, comm, e)
        finally:
            self._writing.discard(asyncio.current_task())

    # ------------------------------------------------------------------------------------------------ answers
    #: seconds an answer chunk's acknowledgement may wait to travel with the rank's next batch before it goes alone
    ACK_DELAY = 0.002

    async def _read(self, rank: int, comm) -> None:
        answers = self.session._answers
        loop = asyncio.get_running_loop()
        try:
            while True:
                msg = await comm.read()
                if "x" in msg:
                    self.ended.add(rank)
                    continue
                self.comm_chunks[rank] += 1
                answers.put_chunk(rank, msg["d"])
                acks = self._acks[rank]
                acks.append(msg["c"])
                msg = None  # a fetched tensor is the program's now: not kept here until the next answer
                if len(acks) == 1:
                    loop.call_later(self.ACK_DELAY, self._ack, rank, comm)
        except Exception as e:
            self._lost(rank, comm, e)

    def _ack(self, rank: int, comm) -> None:
        """On the event loop: acknowledge what no batch has carried since (``ACK_DELAY``)."""
        acks = self._acks[rank]
        if acks and self.comms[rank] is comm:
            self._acks[rank] = []
            self._writing.add(asyncio.ensure_future(self._write(rank, comm, {"a": acks})))

    def _socket_lost(self, rank: int, link, error: BaseException) -> None:
        """Rank ``rank``'s answer sockets broke or timed out (``SocketLink``, on any thread): the comm channel
        carries its batches and answers from now on, and the tasks of the batches sent meanwhile go now."""
        if self.links[rank] is not link:
            return
        self.links[rank] = None
        if self._closing or rank in self.ended:  # the session ended there: the worker closed them
            return
        self.socket_reasons[rank] = f"lost: {type(error).__name__}: {error}"
        has_comm = self.comms[rank] is not None
        self.session._channel_lost(rank, error, "answer sockets",
                                   "the Dask comm channel" if has_comm else "Dask task results")

    def _lost(self, rank: int, comm, error: BaseException) -> None:
        if self.comms[rank] is not comm:
            return
        self.comms[rank] = None
        comm.abort()
        if not self._closing:
            self.reasons[rank] = f"lost: {type(error).__name__}: {error}"
            self.session._channel_lost(rank, error)

    # ------------------------------------------------------------------------------------------------ closing
    def close(self) -> None:
        """Close every channel: the sockets' reader threads are joined (a few seconds at most), the comms closed
        with no wait."""
        self._closing = True
        self.links = [None] * len(self.links)
        self.relays = [None] * len(self.relays)
        for link in self._made:
            link.close()
        comms, self.comms = self.comms, [None] * len(self.comms)
        for comm in comms:
            if comm is not None:
                try:
                    self.client.loop.add_callback(comm.abort)
                except Exception:
                    pass
