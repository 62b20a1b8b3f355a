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
before; what a broken channel did not deliver comes with the tasks. Dask config ``monarch.answer-channel: false``
turns the channels off.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading

from distributed.comm import connect

from ..worker.channel import CHANNEL_OP

__all__ = ["Channels"]

logger = logging.getLogger("dask_monarch.controller")


class Channels:
    """The answer channels of ``session``, one per rank. ``open(timeout)`` opens them (a rank whose channel cannot be
    opened within ``timeout`` seconds has none: ``reasons`` says why); ``send(rank, batch, segments)`` writes a
    batch if the rank has a channel (True) and returns at once; ``close()`` closes them."""

    def __init__(self, session):
        self.session = session
        self.client = session.client
        self.comms: list = [None] * session.world_size  # each rank's open comm, or None
        #: rank -> why it has no channel (not opened, or lost)
        self.reasons: dict[int, str] = {}
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
        """Open every rank's channel, all at once, bounded by ``timeout`` seconds."""
        try:
            self.client.sync(self._open_all, timeout, callback_timeout=timeout + 5)
        except Exception as e:
            for rank in range(len(self.comms)):
                if self.comms[rank] is None:
                    self.reasons.setdefault(rank, f"{type(e).__name__}: {e}")

    async def _open_all(self, timeout: float) -> None:
        await asyncio.gather(*(self._open(rank, timeout) for rank in range(len(self.comms))))

    async def _open(self, rank: int, timeout: float) -> None:
        session = self.session
        address = session.workers[rank]
        comm = None
        try:
            comm = await connect(address, timeout=timeout, **self.client.connection_args)
            await comm.write({"op": CHANNEL_OP, "reply": False, "params": pickle.dumps(session.params[rank])})
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
        asyncio.ensure_future(self._read(rank, comm))

    # ------------------------------------------------------------------------------------------------ sending
    def send(self, rank: int, batch: int, segments: list) -> bool:
        """Write batch ``batch`` on rank ``rank``'s channel (from any thread; the event loop writes it). False if
        the rank has no channel. The batches sent before the event loop gets to them are written on one wake-up
        of the loop, in the order sent."""
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
                answers.put_chunk(rank, msg["d"])
                acks = self._acks[rank]
                acks.append(msg["c"])
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
        """Close every channel (no wait)."""
        self._closing = True
        comms, self.comms = self.comms, [None] * len(self.comms)
        for comm in comms:
            if comm is not None:
                try:
                    self.client.loop.add_callback(comm.abort)
                except Exception:
                    pass
