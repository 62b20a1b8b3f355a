"""The controller's end of the fan-out and fan-in tree (issue 23 items 1 and 2; DESIGN.md "Performance design";
``worker/relay.py`` is the host leader's end, and its docstring gives the wire format).

With Dask config ``monarch.answer-tree`` (default ``true``) and the answer sockets (``channel.py``), the ranks are
grouped by host (the host part of the worker address their answer sockets listen on); for each host of two ranks
or more, its lowest rank is the leader, and the controller asks the leader's worker (Dask comm handler
``monarch_relay``, with the client's ``Security``) to start a relay connected to every rank's sockets there, then
connects one ``HostLink`` to the relay instead of a ``SocketLink`` per rank. Then:

* a flush writes one frame per host, each segment once (``send``), and the relay hands each rank its batch;
* a fetch or sync costs one answer per host: the relay absorbs its ranks' ``Status`` and sends the minimum
  (``("s", seq)``, applied with ``Session._on_host_answers`` to every rank of the host at once) with the fetched
  value and any failure (a rank's own chunk, naming the rank);
* the link breaking (the leader's worker died, or its relay stopped) fails the session at once, naming the leader's
  worker (``_gone``); a rank's sockets to the relay breaking fails it naming that rank's worker. A host whose relay
  cannot be started keeps a ``SocketLink`` per rank, as without the tree.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading

from distributed.comm import connect

from ..exceptions import SessionError
from ..protocol import FetchResult, SessionFailed, Status
from ..worker.relay import RELAY_OP
from .sockets import SocketLink

__all__ = ["HostLink", "group_by_host", "start_relays"]

logger = logging.getLogger("dask_monarch.controller")


def group_by_host(offers: dict) -> list[list[int]]:
    """The ranks of ``offers`` (``{rank: offer}``) grouped by the host they listen on, lowest rank first, only the
    hosts of two ranks or more (a host of one rank is served by its own ``SocketLink``)."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(offers):
        groups.setdefault(offers[rank]["host"], []).append(rank)
    return [ranks for ranks in groups.values() if len(ranks) > 1]


async def _ask_relay(client, session, ranks: list[int], offers: dict, timeout: float) -> dict:
    """Ask the worker of ``ranks[0]`` (the leader) to start the host's relay; its answer (``{"ready": offer}`` or
    ``{"refused": why}``)."""
    leader = ranks[0]
    comm = await connect(session.workers[leader], timeout=timeout, **client.connection_args)
    try:
        await comm.write({"op": RELAY_OP, "reply": False, "params": pickle.dumps(session.params[leader]),
                          "offers": pickle.dumps({r: offers[r] for r in ranks})})
        return await asyncio.wait_for(comm.read(), timeout)
    finally:
        comm.abort()


def start_relays(channels, offers: dict, ssl_context, timeout: float) -> dict[int, str]:
    """Start a relay on every host of two ranks or more among ``offers`` (``{rank: offer}``: sockets the ranks
    offered, not yet connected) and connect a ``HostLink`` to each (``channels.relays``). Returns ``{rank: why}``
    for the ranks of the hosts whose relay did not start (they get their own sockets)."""
    session, client = channels.session, channels.client
    groups = group_by_host(offers)
    if not groups:
        return {}

    async def ask_all():
        return await asyncio.gather(*(_ask_relay(client, session, ranks, offers, timeout) for ranks in groups),
                                    return_exceptions=True)

    failed: dict[int, str] = {}
    try:
        answers = client.sync(ask_all, callback_timeout=timeout + 5)
    except Exception as e:
        answers = [e] * len(groups)
    for ranks, answer in zip(groups, answers):
        why = None
        if isinstance(answer, BaseException):
            why = f"{type(answer).__name__}: {answer}"
        elif not isinstance(answer, dict) or "ready" not in answer:
            why = f"the leader answered {answer!r}"
        else:
            try:
                link = HostLink(channels, ranks, answer["ready"], ssl_context, timeout)
            except Exception as e:
                why = f"could not connect to the relay: {type(e).__name__}: {e}"
            else:
                channels._made.append(link)
                for rank in ranks:
                    channels.relays[rank] = link
        if why is not None:
            for rank in ranks:
                failed[rank] = f"the relay on rank {ranks[0]} ({session.workers[ranks[0]]}) did not start: {why}"
    return failed


class HostLink(SocketLink):
    """The controller's sockets to one host's relay (``worker/relay.py``): ``ranks`` are the host's ranks, the first
    is the leader. ``send(batches, segments)`` writes one flush's batches for the host (``[(rank, batch, [segment
    index, ...])]``); ``answers`` counts the answer chunks the relay sent (one per fetch when all goes well)."""

    def __init__(self, channels, ranks: list[int], offer: dict, ssl_context, timeout: float):
        self.ranks = list(ranks)
        self.answers = 0
        super().__init__(channels, ranks[0], offer, ssl_context, timeout)

    def _apply(self, blob) -> None:
        """Apply the entries of one answer chunk of the relay, in order, on this link's reader: a rank's own chunk
        (``"c"``, as ``Session._on_chunk`` does without its chunk order: the relay keeps each rank's order), every
        rank of the host past a seq (``"s"``), a rank's end (``"x"``) or its lost sockets (``"l"``)."""
        self.answers += 1
        channels = self.channels
        channels.host_chunks[self.rank] += 1
        session = channels.session
        decoded = []
        for entry in blob if type(blob) is list else pickle.loads(blob):  # a list: it had out-of-band tensors
            kind = entry[0]
            if kind == "s":
                decoded.append((None, entry[1], None))
            elif kind == "c":
                rank = entry[1]
                try:
                    _, messages = entry[2] if type(entry[2]) is tuple else pickle.loads(entry[2])
                except Exception as e:
                    session._fail(SessionError(f"session {session.id}: could not read rank {rank}'s answers: {e}"))
                    return
                messages = [session._unwrap(rank, m) if type(m) is FetchResult else m for m in messages]
                failed = [m for m in messages if type(m) is SessionFailed]
                note = session._departed(failed[0].error.backtrace) if failed and session.failure is None else ""
                decoded.append((rank, messages, note))
            elif kind == "x":  # a rank's end, with the last seq it passed (the host's minimum may lag behind it)
                channels.ended.add(entry[1])
                decoded.append((entry[1], None, entry[2]))
            elif kind == "l" and not session.closed and entry[1] not in channels.ended:
                # its worker died, most likely: the scheduler ends the session on the others, whose report names it
                # (SessionFailed, through this relay); failing here is the bound if nothing else comes
                timer = threading.Timer(self.LOST_GRACE, self._rank_lost, (entry[1], entry[2]))
                timer.daemon = True
                timer.start()
        with session.lock:
            for rank, messages, note in decoded:
                if rank is not None and messages is None:  # "x": this rank alone passed ``note``
                    if session.history.status_many((rank,), note):
                        session._advanced()
                    continue
                if rank is not None:
                    for msg in messages:
                        session._handle(rank, msg, note)
                    continue
                if session.answers is not None:  # every rank's Status, as without the relay (``record_answers``)
                    session.answers.extend((r, Status(messages, session.workers[r])) for r in self.ranks)
                if session.history.status_many(self.ranks, messages):
                    session._advanced()

    #: seconds between a rank's sockets to the relay breaking and the session failing for it, unless the scheduler's
    #: report of the rank's worker leaving (a ``SessionFailed`` of the others) came first
    LOST_GRACE = 5.0

    def _rank_lost(self, rank: int, why: str) -> None:
        session = self.channels.session
        if session.failure is None and not session.closed and rank not in self.channels.ended:
            session._fail(SessionError(
                f"session {session.id}: the answer sockets of rank {rank} ({session.workers[rank]}) to its host's "
                f"relay on rank {self.rank} ({session.workers[self.rank]}) broke ({why}): its worker died or "
                f"stopped{session._meanwhile()}"))

    def _gone(self, error: BaseException) -> None:
        """The relay's sockets broke: its ranks' answers had no other way, so the session fails naming the leader's
        worker (unless the session is ending: then every rank of the host said so first)."""
        channels = self.channels
        if channels._closing or all(r in channels.ended for r in self.ranks):
            return
        session = channels.session
        session._fail(SessionError(
            f"session {session.id}: the relay of ranks {self.ranks} on rank {self.rank} ({session.workers[self.rank]}) "
            f"closed ({type(error).__name__}: {error}): the answers of those ranks travel only through it; its "
            f"worker died or stopped{session._meanwhile()}"))
