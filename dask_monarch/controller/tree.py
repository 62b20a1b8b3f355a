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
  worker (``_gone``), or the rank whose sockets to the relay the relay reported broken before it closed; a rank's
  sockets to the relay breaking fails it naming that rank's worker. A host whose relay
  cannot be started keeps a ``SocketLink`` per rank, as without the tree;
* on a host of more ranks than Dask config ``monarch.relay-fanout`` (default 8), the host relay serves the first
  that many ranks itself and the rest through sub-relays of that many ranks each, every one in its own leader's
  worker process (a second level of the tree: the work of a big host is spread over processes and cores instead of
  one GIL; a sub-relay's ``("s", seq)`` stands for all its ranks). A lost sub-relay fails the session naming its
  ranks and its leader's worker (``("l", rank, why)`` for each of its ranks).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading

import dask
from distributed.comm import connect

from ..exceptions import SessionError
from ..protocol import FetchResult, SessionFailed, Status
from ..worker.relay import RELAY_OP
from .sockets import SocketLink

__all__ = ["HostLink", "group_by_host", "relay_fanout", "split_host", "start_relays"]

logger = logging.getLogger("dask_monarch.controller")


def group_by_host(offers: dict) -> list[list[int]]:
    """The ranks of ``offers`` (``{rank: offer}``) grouped by the host they listen on, lowest rank first, only the
    hosts of two ranks or more (a host of one rank is served by its own ``SocketLink``)."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(offers):
        groups.setdefault(offers[rank]["host"], []).append(rank)
    return [ranks for ranks in groups.values() if len(ranks) > 1]


def relay_fanout() -> int:
    """Dask config ``monarch.relay-fanout`` (default 8): the most ranks a relay serves itself; a host of more ranks
    gets sub-relays of that many ranks each (the next ranks in order, the lowest leading), each in its leader's worker
    process, under the host's relay. The default of 8 (a host of 8 GPUs: one relay) was the faster of 8 and 64 on the
    16-core host at 16 and 64 ranks (fetch p50 1.38 / 2.08 ms against 1.68 / 3.11 ms, BENCHMARKS.md). Raises
    ``ValueError`` naming the key unless it is an integer of 2 or more."""
    value = dask.config.get("monarch.relay-fanout", 8)
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError(f"Dask config monarch.relay-fanout must be an integer of 2 or more, got {value!r}")
    return value


def split_host(ranks: list[int], fanout: int) -> tuple[list[int], list[list[int]]]:
    """A host's ranks (lowest first) as the host relay's own ranks and its sub-relays' groups (``relay_fanout``);
    a last group of one rank is the host relay's own."""
    groups = [ranks[i:i + fanout] for i in range(0, len(ranks), fanout)]
    if len(groups) > 1 and len(groups[-1]) == 1:
        groups[0] = groups[0] + groups.pop()
    return groups[0], groups[1:]


async def _ask_relay(client, session, ranks: list[int], offers: dict, timeout: float, children=None) -> dict:
    """Ask the worker of ``ranks[0]`` (the leader) to start a relay of ``ranks`` (and of the sub-relays
    ``children``, ``{leader: {"offer", "ranks"}}``); its answer (``{"ready": offer}`` or ``{"refused": why}``)."""
    leader = ranks[0]
    comm = await connect(session.workers[leader], timeout=timeout, **client.connection_args)
    try:
        msg = {"op": RELAY_OP, "reply": False, "params": pickle.dumps(session.params[leader]),
               "offers": pickle.dumps({r: offers[r] for r in ranks})}
        if children:
            msg["children"] = pickle.dumps(children)
        await comm.write(msg)
        return await asyncio.wait_for(comm.read(), timeout)
    finally:
        comm.abort()


async def _ask_host(client, session, ranks: list[int], offers: dict, timeout: float, fanout: int) -> dict:
    """Start a host's relays: its sub-relays first (all at once), then the host relay over them and its own ranks;
    the host relay's answer, or the first refusal (naming the sub-relay's leader)."""
    own, groups = split_host(ranks, fanout)
    answers = await asyncio.gather(*(_ask_relay(client, session, g, offers, timeout) for g in groups))
    children = {}
    for group, answer in zip(groups, answers):
        if not isinstance(answer, dict) or "ready" not in answer:
            return {"refused": f"the sub-relay of ranks {group} on rank {group[0]} ({session.workers[group[0]]}) "
                               f"answered {answer!r}"}
        children[group[0]] = {"offer": answer["ready"], "ranks": group,
                              "procs": [offers[r].get("proc") for r in group]}  # ``worker/proc_state.py``
    return await _ask_relay(client, session, own, offers, timeout, children)


def start_relays(channels, offers: dict, ssl_context, timeout: float) -> dict[int, str]:
    """Start a relay on every host of two ranks or more among ``offers`` (``{rank: offer}``: sockets the ranks
    offered, not yet connected) and connect a ``HostLink`` to each (``channels.relays``). Returns ``{rank: why}``
    for the ranks of the hosts whose relay did not start (they get their own sockets)."""
    session, client = channels.session, channels.client
    groups = group_by_host(offers)
    if not groups:
        return {}
    fanout = channels.fanout

    async def ask_all():
        return await asyncio.gather(*(_ask_host(client, session, ranks, offers, timeout, fanout) for ranks in groups),
                                    return_exceptions=True)

    failed: dict[int, str] = {}
    try:
        answers = client.sync(ask_all, callback_timeout=2 * timeout + 5)  # sub-relays, then the host's
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
                link = HostLink(channels, ranks, answer["ready"], ssl_context, timeout, fanout)
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

    def __init__(self, channels, ranks: list[int], offer: dict, ssl_context, timeout: float, fanout: int = 64):
        self.ranks = list(ranks)
        self.answers = 0
        #: each rank served by a sub-relay -> the sub-relay's leader (``split_host``)
        self.sub_relay = {r: group[0] for group in split_host(self.ranks, fanout)[1] for r in group}
        #: rank -> why, for the ranks whose sockets to the relay broke (``"l"``), in the order the relay said so
        self.lost_ranks: dict[int, str] = {}
        super().__init__(channels, ranks[0], offer, ssl_context, timeout)

    def send(self, batches: list, segments: list, quiet: tuple | None = None) -> bool:
        """Write one flush's ``batches`` for this host (``[(rank, batch, [segment index, ...])]``) and ``segments``;
        ``quiet``, for a flush that ends with ``RequestStatus{seq}`` (no ``Exit``): ``(seq, busy)``, ``busy`` the
        ranks that get more than that (None: every rank), so that the relay may answer it for the others
        (``worker/relay.py``, "Quiet ranks"). False if the link is lost (``SocketLink.send``)."""
        return super().send(batches, segments, None if quiet is None else {"q": quiet})

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
                self.lost_ranks.setdefault(entry[1], entry[2])
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
            closed = session._client_closed()  # the program closed its Client: the scheduler ended the session
            if closed:
                session._fail(SessionError(f"session {session.id}: {closed}"))
                return
            relay = self.sub_relay.get(rank, self.rank)
            kind = "sub-relay" if relay != self.rank else "host's relay"
            session._fail(SessionError(
                f"session {session.id}: the answer sockets of rank {rank} ({session.workers[rank]}) to its {kind} "
                f"on rank {relay} ({session.workers[relay]}) broke ({why}): that worker or the rank's died or "
                f"stopped{session._meanwhile()}"))

    def _gone(self, error: BaseException) -> None:
        """The relay's sockets broke: its ranks' answers had no other way, so the session fails naming the leader's
        worker (unless the session is ending: then every rank of the host said so first). If the relay said first
        that a rank's sockets broke (``"l"``), that rank is the news and the relay's end came after it: the error names
        that rank (``_rank_lost``), even though the relay closed before the grace ended or the scheduler's report
        came. Where the scheduler already sees workers of the session shutting down, restarted or gone (a cluster
        restart closes every relay too), that leads the error, as liveness would say it; where the program closed the
        session's Client (the scheduler then ends the session on its workers, relays included), that is the error,
        here and in ``_rank_lost``."""
        channels = self.channels
        if channels._closing or all(r in channels.ended for r in self.ranks):
            return
        lost = [r for r in self.lost_ranks if r not in channels.ended]
        if lost:
            self._rank_lost(lost[0], f"{self.lost_ranks[lost[0]]}; then the relay on rank {self.rank} closed: "
                                     f"{type(error).__name__}: {error}")
            return
        session = channels.session
        closed = session._client_closed()
        if closed:
            session._fail(SessionError(f"session {session.id}: {closed}"))
            return
        relay = (f"the relay of ranks {self.ranks} on rank {self.rank} ({session.workers[self.rank]}) closed "
                 f"({type(error).__name__}: {error})")
        departed = session._departed()
        if departed:  # the scheduler already sees why (workers shutting down, restarted, gone): that leads
            session._fail(SessionError(f"session {session.id}: {departed}; then {relay}"))
            return
        session._fail(SessionError(f"session {session.id}: {relay}: the answers of those ranks travel only through "
                                   "it; its worker died or stopped"))
