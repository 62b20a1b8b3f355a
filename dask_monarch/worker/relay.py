"""``HostRelay``: the host leader's relay of one session, the fan-out and fan-in tree (issue 23 items 1 and 2;
DESIGN.md "Performance design": a message for a mesh leaves the controller once per host and answers are
accumulated on the way back, as Monarch's multicast tree and accumulating reducers do; ``controller/tree.py`` is
the controller's end, ``worker/sockets.py`` each rank's).

Per host (the host part of the worker address) the session's lowest rank there is its *leader*. The controller
opens every rank's answer channel as before, and each rank offers its answer sockets; for a host of several ranks
the controller does not connect them itself but hands the offers to the leader's worker (Dask comm handler
``monarch_relay``, with the client's ``Security``). The leader's ``HostRelay`` connects to each rank's sockets of
its host (its own rank's included) exactly as a controller would, reads all their up sockets on one thread
(``monarch-<session>-relay``, a selector over non-blocking sockets: the thread count and GIL hand-overs of the
leader's worker do not grow with the host's ranks), tells each rank that its answers now go through
a relay (``{"r": True}``: the rank's ``sync_batch`` tasks then return no answers, which would overtake the
relay's), and offers the controller one pair of sockets of its own (a ``SocketEnd`` whose inbox and outbox are the
relay's):

* down (controller -> relay): ``{"b": [(rank, batch, [segment index, ...]), ...], "s": [segment, ...]}``, every
  rank's batch of one flush with each segment once; the relay writes each rank's batch on that rank's down socket,
  in the order given, so each rank's order is the controller's;
* up (relay -> controller): numbered chunks whose data is a pickled list of entries, in arrival order:
  ``("c", rank, chunk)`` a rank's answer chunk as the rank pickled it (anything but ``Status`` alone),
  ``("s", seq)`` every rank of the host has passed ``seq`` (the minimum of their ``Status``), ``("x", rank, seq)`` the
  session ended on that rank, ``("l", rank, why)`` that rank's sockets broke.

A chunk of ``Status`` alone is absorbed here (a relayed rank sends it as its seq alone, an ``int``: nothing to
unpickle); one of ``Status`` and ``FetchResult`` waits for the next ``("s",
seq)``, so that a fetch costs the controller one answer per host; anything else (a failure) goes at once, with
what waited before it. Nothing is acknowledged: a relayed rank's outbox keeps no chunk (``Outbox.push``), since
the relay is the only way its answers travel and the controller fails the session when the relay's sockets break
(its worker died), naming the leader's worker, instead of looking elsewhere for them.

Quiet ranks: a host relay answers a fetch's barrier itself for the ranks that have nothing else to do
(``worker/quiet.py``).
"""

from __future__ import annotations

import logging
import pickle
import selectors
import socket
import threading
import time

from ..protocol import FetchResult, Status, tensor_bytes
from ..protocol.frames import FrameReader, connect_pair, send_frame, shutdown
from ..protocol.session_id import session_tag
from .proc_state import ProcState
from .quiet import NEVER, QUIET_DELAY, QuietRanks
from .sockets import SEND_TIMEOUT, SocketEnd

__all__ = ["HostRelay", "RELAY_OP"]

logger = logging.getLogger("dask_monarch.worker")

#: the handler's name in ``Worker.handlers``
RELAY_OP = "monarch_relay"
#: seconds to connect to a local rank's answer sockets
CONNECT_TIMEOUT = 10.0
_HELD = (Status, FetchResult)
_STATUS = frozenset({Status})
#: the last entry of what a relay sends at once (not held for the host's minimum): a sub-relay's parent sends it on
#: at once too (``HostRelay.below``); the controller ignores it
_AT_ONCE = ("!",)


class _RankLink:
    """The relay's connection to one local rank's answer sockets (the controller's end, ``controller/sockets.py``):
    the down socket is written by the relay's fan-out, the up socket read by its one fan-in thread (non-blocking)."""

    def __init__(self, relay, rank: int, offer: dict, ssl_context, ranks: list | None = None,
                 procs: list | None = None):
        self.rank = rank  # the rank, or a sub-relay's leader
        self.ranks = ranks  # a sub-relay's ranks; None for a rank
        # the processes of the rank (a sub-relay's ranks': ``procs``, their offers' "proc"): quiet only while they run
        self.procs = [ProcState(p) for p in ([offer.get("proc")] if ranks is None else procs or [None])]
        self.done: set = set()  # the ranks of a sub-relay whose session ended (their ("x", rank, seq) came)
        self.lost_ranks: set = set()  # the ranks a sub-relay lost (their ("l", rank, why) came): it is never quiet
        self.down, self.up = connect_pair(offer, ssl_context, CONNECT_TIMEOUT)
        self.lock = threading.Lock()  # writes on the down socket
        self.ended = False
        self.alive = True  # its sockets are up (not yet ended or closed)
        self.heard = -NEVER  # when a frame of it was read last (``time.monotonic``)
        if ranks is None:  # the rank's answers go through a relay: its tasks return none (``Outbox.for_task``)
            self.send({"r": True})
        self.up.setblocking(False)
        self.reader = FrameReader(self.up, relay.limit)

    def send(self, msg: dict) -> None:
        with self.lock:
            send_frame(self.down, msg, SEND_TIMEOUT)

    def end(self) -> None:
        """On the fan-in thread, once its up socket is done: close both."""
        self.alive = False
        shutdown(self.down)
        with self.lock:  # no forward is writing on it meanwhile
            self.down.close()
        self.up.close()

    def close(self) -> None:
        self.alive = False
        shutdown(self.down)
        shutdown(self.up)


class _RelayInbox:
    """What the controller's down socket delivers to (``SocketEnd`` calls ``put``): one flush's batches."""

    def __init__(self, relay):
        self.relay = relay

    def put(self, batches, segments, quiet=None) -> None:
        self.relay.forward(batches, segments, quiet)

    def noted(self, entries) -> None:
        self.relay.noted(entries)


class _RelayOutbox:
    """What the relay's ``SocketEnd`` pushes to the controller: numbered chunks of entries (the module's docstring).
    Duck-types ``worker/outbox.py``'s channel interface (``attach``, ``detach``, ``push``, ``stale``, ``acked``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: list = []
        self._next = 0
        self._channel = None
        self._early = False  # entries came before the controller connected

    def put(self, entries: list) -> None:
        self.extend(entries)
        self.wake()

    def extend(self, entries: list) -> None:
        """Queue ``entries`` (under the relay's lock: the order of what the relay's threads send is its order)."""
        with self._lock:
            self._entries.extend(entries)

    def wake(self) -> None:
        """Let the controller's sockets push what is queued (outside the relay's lock)."""
        with self._lock:
            channel = self._channel
            if channel is None:
                self._early = True
                return
        channel.wake()

    def attach(self, channel) -> None:
        with self._lock:
            self._channel = channel
            early = self._early
        if early:
            channel.wake()

    def detach(self, channel) -> None:
        with self._lock:
            if self._channel is channel:
                self._channel = None

    def push(self) -> list:
        with self._lock:
            if not self._entries:
                return []
            entries, self._entries = self._entries, []
            chunk = self._next
            self._next += 1
        # a fetched tensor's memory travels out of band (``frames.send_frame``), as from the rank itself
        return [(chunk, tensor_bytes.dumps(entries))]

    def stale(self, channel, closed: bool = False) -> None:
        pass

    def acked(self, chunk: int) -> None:
        pass  # nothing is pushed again: a lost relay fails the session at the controller


class HostRelay(QuietRanks):
    """The relay of session ``session_id`` on this host's leader (rank ``leader``): ``offers`` is ``{rank: offer}``
    of the host's ranks' answer sockets (``worker/sockets.py``), ``host`` where to listen for the controller,
    ``ssl_context`` the worker's listening context and ``client_ssl`` its connecting one (TLS when the cluster uses
    it), ``limit`` the most bytes a frame may declare. ``offer`` is what the controller connects to; ``close()``
    ends it (any thread); it ends by itself once every rank's sockets have closed (the session ended on each rank:
    their ``("x", rank)`` went first) or the controller's broke. Raises ``OSError`` if a rank's sockets cannot be
    connected."""

    def __init__(self, session_id: str, leader: int, offers: dict, host: str, ssl_context, client_ssl, limit: int,
                 children: dict | None = None):
        self.session_id = session_id
        self.limit = limit  # the most bytes a frame may declare (``frames.receivable``)
        self.tag = session_tag(session_id)
        self.leader = leader
        self._lock = threading.Lock()
        self._passed = {rank: 0 for rank in [*offers, *(children or {})]}  # each rank's (sub-relay's) last seq
        self._low = 0  # the last ("s", seq) sent
        self._held: list = []  # entries waiting for the next ("s", seq)
        # the Status each must report to count as quiet (``quiet.py``): none before it answered a barrier
        # that came through here (batches sent before the relay started went another way)
        self._need = dict.fromkeys(self._passed, NEVER)
        self._deferred: dict = {}  # link -> barriers answered here, not yet handed to it
        self._due: float | None = None  # when they are handed over at the latest
        self._fan_out = threading.Lock()  # one writer of the ranks' batches at a time (a flush, or a hand-over)
        self._closed = False
        self.outbox = _RelayOutbox()
        self.links: dict[int, _RankLink] = {}  # this relay's own ranks
        self.children: dict[int, _RankLink] = {}  # sub-relays, by their leader
        self._child_of: dict[int, _RankLink] = {}  # each rank of a sub-relay -> its link
        self._wake_in, self._wake_out = socket.socketpair()  # wakes the fan-in thread for a hand-over's deadline
        self._wake_in.setblocking(False)
        self._wake_out.setblocking(False)
        try:
            for rank in sorted(offers):
                self.links[rank] = _RankLink(self, rank, offers[rank], client_ssl)
            for rank, child in sorted((children or {}).items()):
                link = self.children[rank] = _RankLink(self, rank, child["offer"], client_ssl, list(child["ranks"]),
                                                       child.get("procs"))
                self._child_of.update(dict.fromkeys(link.ranks, link))
            self.end = SocketEnd(session_id, leader, _RelayInbox(self), self.outbox, host, ssl_context,
                                 self._controller_lost, limit)
        except BaseException:
            for link in [*self.links.values(), *self.children.values()]:
                link.end()
            self._close_procs()
            self._wake_in.close()
            self._wake_out.close()
            raise
        self.offer = self.end.offer
        self.thread = threading.Thread(target=self._fan_in, daemon=True, name=f"monarch-{self.tag}-relay")
        self.thread.start()
        self.end.attach()

    # ------------------------------------------------------------------------------------------------ fan-out
    def forward(self, batches, segments, quiet=None) -> None:
        """Write each rank's batch of one flush on its down socket and each sub-relay's ranks' batches in one frame
        (on the down reader). A flush holds one batch per rank, so the order across ranks is free: the sub-relays
        go first (the longest way down), then the other ranks, and the leader's own rank last (its worker's threads
        would otherwise take this process's GIL while the others are still being written). ``quiet``: ``(seq,
        busy)`` for a flush that ends with ``RequestStatus{seq}``, whose barrier is answered here for the quiet
        ranks and sub-relays (``quiet.py``)."""
        below: dict = {}
        own = []
        for rank, batch, indices in batches:
            link = self.links.get(rank)
            if link is not None:
                own.append((link, batch, indices))
            elif rank in self._child_of:
                below.setdefault(self._child_of[rank], []).append((rank, batch, indices))
        extra = {} if quiet is None else {"q": quiet}
        frames = [(link, {"b": sub, "s": segments, **extra}) for link, sub in below.items()]
        if len(own) > 1 and own[0][0].rank == self.leader:
            own.append(own.pop(0))
        frames += [(link, {"b": batch, "s": [segments[i] for i in indices]}) for link, batch, indices in own]
        seq, busy = quiet if quiet is not None else (None, None)
        with self._fan_out:
            out = self._answer_quiet(frames, seq, busy)
            for link, msg in frames:
                if msg is not None:
                    if link in self._deferred:  # its earlier barriers go first, in order
                        self._hand_over(link)
                    self._send(link, msg)
            if out is not None and self._due is None and self._deferred:
                self._due = time.monotonic() + QUIET_DELAY
                try:
                    self._wake_out.send(b"w")
                except OSError:  # closed: the relay is ending
                    pass
        if out:
            self.outbox.wake()

    def _send(self, link: _RankLink, msg: dict) -> None:
        try:
            link.send(msg)
        except OSError as e:
            logger.debug("dask_monarch: relay %s: rank %d's socket broke: %s", self.tag, link.rank, e)
            link.close()  # the fan-in thread reports it

    # ------------------------------------------------------------------------------------------------- fan-in
    def _fan_in(self) -> None:
        """The relay's one reader of every local rank's up socket (``monarch-<session>-relay``): a selector wakes
        it for whatever arrived, from any number of ranks at once, and each rank's frames are taken in order
        (``frames.FrameReader``). One thread instead of one per rank: at 8 ranks on 2 cores the per-rank threads
        cost the leader about 85 us of CPU each per fetch, in wake-ups and GIL hand-overs (BENCHMARKS.md)."""
        try:
            with selectors.DefaultSelector() as selector:
                for link in [*self.links.values(), *self.children.values()]:
                    selector.register(link.up, selectors.EVENT_READ, link)
                selector.register(self._wake_in, selectors.EVENT_READ, None)
                left = len(self.links) + len(self.children)
                while left:
                    due = self._due
                    for key, _ in selector.select(None if due is None else max(0.0, due - time.monotonic())):
                        if key.data is None:  # a barrier was answered here: ``_due`` is set
                            try:
                                self._wake_in.recv(64)
                            except OSError:
                                pass
                            continue
                        link, frames, why = key.data, [], None
                        try:
                            try:
                                link.reader.read(frames)
                            except Exception as e:  # closed (the rank's session ended, or ``close()``) or broken
                                why = f"{type(e).__name__}: {e}"
                            if frames:
                                link.heard = time.monotonic()
                            for msg in frames:
                                if "x" in msg:
                                    link.ended = True
                                    self.ended(link.rank)
                                elif link.ranks is not None:
                                    self.below(link, msg["d"])
                                else:  # no acknowledgement: a relayed rank keeps no chunk (``Outbox.push``)
                                    self.chunk(link.rank, msg["d"])
                        except Exception as e:  # a chunk this relay cannot read: that link counts as lost, not the rest
                            why = f"{type(e).__name__}: {e}"
                        frames = msg = None  # a fetched tensor is the controller's: not kept here until the next read
                        if why is not None:
                            selector.unregister(link.up)
                            link.end()
                            left -= 1
                            if link.ranks is not None:  # every rank under it not yet ended is lost with it
                                for rank in [r for r in link.ranks if r not in link.done]:
                                    self.lost(rank, f"its sub-relay on rank {link.rank} closed ({why})")
                            elif not link.ended:
                                self.lost(link.rank, why)
                    due = self._due
                    if due is not None and time.monotonic() >= due:
                        self._hand_over_all()
        finally:  # every rank's sockets closed (or a bug here): the relay ends, the controller hears it
            self.close()
            self._close_procs()
            self._wake_in.close()
            self._wake_out.close()

    def chunk(self, rank: int, blob) -> None:
        """An answer chunk of ``rank`` (on the fan-in thread): absorbed, held or sent (the module's docstring). An
        ``int`` is a chunk of ``Status`` alone, as a relayed rank sends it (``Outbox._take``): its highest seq."""
        if type(blob) is int:
            kinds, seqs = _STATUS, (blob,)
        else:
            kinds, seqs = self._read_chunk(blob)
        out = None
        with self._lock:
            if kinds - _STATUS:
                self._held.append(("c", rank, blob))
            if seqs:
                self._passed[rank] = max(self._passed[rank], max(seqs))
            low = min(self._passed.values())
            if low > self._low:
                self._low = low
                self._held.append(("s", low))
                out, self._held = self._held, []
            elif kinds - set(_HELD):
                out, self._held = self._held + [_AT_ONCE], []
            if out:
                self.outbox.extend(out)
        if out:
            self.outbox.wake()

    @staticmethod
    def _read_chunk(blob) -> tuple[set, list]:
        """The message classes of a pickled answer chunk, and the seqs of its ``Status``."""
        try:
            _, messages = blob if type(blob) is tuple else pickle.loads(blob)  # a tuple: it had out-of-band tensors
            kinds = {type(m) for m in messages}
            seqs = [m.seq for m in messages if type(m) is Status]
        except Exception:  # a value whose class the relay cannot load: the controller reads it as before
            return {None}, []
        return kinds, seqs

    def ended(self, rank: int) -> None:
        """``rank``'s session ended (its sockets closed after its last chunk): ``("x", rank, seq)`` with the last
        ``Status`` seq it passed, which the host's minimum may not show while another rank of the host is busy
        (an exit waiting for a busy rank must not name the ranks that are done)."""
        with self._lock:
            seq = self._passed.get(rank, 0)
        self._now(("x", rank, seq))

    def lost(self, rank: int, why: str | None) -> None:
        if not self._closed:
            self._now(("l", rank, why or "closed"))

    def _now(self, entry) -> None:
        with self._lock:
            out, self._held = self._held + [entry, _AT_ONCE], []
            self.outbox.extend(out)
        self.outbox.wake()

    def below(self, link: _RankLink, blob) -> None:
        """An answer chunk of the sub-relay ``link`` (on the fan-in thread): its ``("s", seq)`` stands for all its
        ranks; the rest is held with this relay's own until this host's minimum moves, or goes at once if the
        sub-relay sent it at once (``_AT_ONCE``: a failure, a rank's end or loss)."""
        entries = blob if type(blob) is list else pickle.loads(blob)  # a list: it had out-of-band tensors
        seq, now, keep = None, False, []
        for entry in entries:
            kind = entry[0]
            if kind == "s":
                seq = entry[1]
            elif kind == "!":
                now = True
            else:
                if kind == "x":
                    link.done.add(entry[1])
                elif kind == "l":
                    link.lost_ranks.add(entry[1])
                keep.append(entry)
        out = None
        with self._lock:
            self._held.extend(keep)
            if seq is not None:
                self._passed[link.rank] = max(self._passed[link.rank], seq)
            low = min(self._passed.values())
            moved = low > self._low
            if moved:
                self._low = low
                self._held.append(("s", low))
            if moved or now:
                out, self._held = self._held + ([_AT_ONCE] if now else []), []
            if out:
                self.outbox.extend(out)
        if out:
            self.outbox.wake()

    # --------------------------------------------------------------------------------------------------- end
    def _controller_lost(self, error) -> None:
        """The controller's sockets broke: the ranks' sockets close too (they fall back to their comm channels)."""
        logger.debug("dask_monarch: relay %s: the controller's sockets closed: %s", self.tag, error)
        self.close()

    def close(self) -> None:
        self._closed = True
        self.end.close()
        for link in [*self.links.values(), *self.children.values()]:
            link.close()

