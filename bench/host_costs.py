"""The controller's cost per host of the fan-out and fan-in tree (issue 23 item 6: the inputs of the model of 1,024
ranks in BENCHMARKS.md "A model at 1,024 ranks").

Parts 1 and 2 are a **microbenchmark of the controller's side**: the real ``Transport._flush_locked``,
``HostLink`` (its ``send``, its reader thread, ``_apply``), ``History.status_many`` and ``MonarchFuture``, on a
controller state of H hosts x R ranks, with a ``socket.socketpair`` per direction standing in for each host's
relay (``controller/tree.py``'s ``connect_pair`` is pointed at them; nothing else is replaced). No worker runs:

* ``flush``: one flush of one eager op's messages (a ``CallFunction``-sized segment and a ``DeleteRefs`` for
  every rank, as ``x + x`` sends) to every host: batching, pickling once, and one ``sendall`` per host. The relay
  ends are drained between rounds, outside the timing, so the figure is the controller's alone.
* ``flush100/op``: one flush of 100 such ops (the flusher's batch: ``flush_interval`` 5 ms of ~25 us ops holds
  ~200), per op.
* ``fetch``: a whole ``sync``: ``_flush_locked`` with ``RequestStatus`` to every host, then each stand-in relay
  writes its answer chunk (``[("s", seq)]`` pickled as ``worker/relay.py`` pickles it, one ``send_frame`` per
  host, from a forked process: on another core, as the relays are on other hosts), then the controller's reader threads
  (one per host) receive, unpickle and apply them (``status_many`` for R ranks) and the last one wakes the
  waiting ``MonarchFuture``. ``apply`` is ``HostLink._apply`` alone (unpickle + ``status_many``), called inline.

Each figure is the median of ``--rounds`` rounds at each host count, and the cost per extra host is the slope of a
least-squares line over the host counts (printed with the intercept).

Part 3 (``--attach``, a real cluster): ``dm.attach`` of 1, 2, 4 ... ranks on one stock CLI cluster (``dask
scheduler`` + ``dask worker --nworkers N``, loopback, ``bench/scale.py``'s ``CliCluster``), with the answer tree
off and on: per rank (the slope with the tree off) and per host (the relay's start: on minus off at the same
ranks, all ranks on one host here).

Usage: ``python bench/host_costs.py [--hosts 1,2,4,8,16,32] [--per-host 8] [--rounds 200] [--attach 1,2,4]``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import selectors
import socket
import statistics
import sys
import time
from collections import Counter

import dask
import torch

from dask_monarch import interpreter
from dask_monarch.controller import sockets as controller_sockets
from dask_monarch.controller.bookkeeping import Bookkeeping
from dask_monarch.controller.dispatch import op_path
from dask_monarch.controller.future import MonarchFuture
from dask_monarch.controller.transport import Transport
from dask_monarch.controller.tree import HostLink
from dask_monarch.protocol import ArgsKwargs, CallFunction, DeleteRefs, Ref, StreamRef
from dask_monarch.protocol.frames import send_frame
from dask_monarch.protocol.session_id import new_session_id, session_tag

BUFFER = 4 * 2**20  # socket buffers: a round's frames fit, so no write waits for the drain


class Controller(Bookkeeping, Transport):
    """The state a ``Session`` gives ``Transport`` and ``HostLink`` (``_init_bookkeeping``, ``_init_transport``),
    for ``hosts`` x ``per_host`` ranks, without a cluster."""

    def __init__(self, hosts: int, per_host: int):
        self.id = new_session_id()
        self.tag = session_tag(self.id)
        self.world_size = hosts * per_host
        self.workers = [f"tcp://10.0.{r // per_host}.1:{40000 + r}" for r in range(self.world_size)]
        self._all = tuple(range(self.world_size))
        self.task_interval = 0.05
        self.max_batch = 10**9
        self.failure = None
        self.closed = False
        self._waiters: list = []
        self._record_answers = False
        self.liveness_interval = 1.0
        self._init_bookkeeping()
        self._init_transport()

    def check_alive(self) -> None:
        pass


class Channels:
    """What ``HostLink`` reads of ``Channels`` (``controller/channel.py``)."""

    def __init__(self, session):
        self.session = session
        self.tree = True
        self.relays: dict = {}
        self.host_chunks: Counter = Counter()
        self.socket_chunks: Counter = Counter()
        self.ended: set = set()
        self._closing = False


class Mesh:
    """A ``Controller`` with a ``HostLink`` per host on socketpairs. The relays' ends of the down sockets are drained
    here (``drain``, outside the timings); their up ends belong to a forked process (``_relays``), which writes
    every host's answer when told (``answer``): on another core, as the relays are on other hosts."""

    def __init__(self, hosts: int, per_host: int):
        pairs = []
        for _ in range(hosts):
            down, up = socket.socketpair(), socket.socketpair()
            for s in (*down, *up):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
            pairs.append((down, up))
        self.told, told = socket.socketpair()
        self.relays = os.fork()  # before any thread of this process starts
        if self.relays == 0:
            try:
                self.told.close()
                _relays(told, [up[1] for _, up in pairs])
            finally:
                os._exit(0)
        told.close()
        self.session = Controller(hosts, per_host)
        self.session.channels = self.channels = Channels(self.session)
        self.relay_down, self.links = [], []
        connect_pair = controller_sockets.connect_pair
        controller_sockets.connect_pair = lambda offer, ssl_context, timeout: offer["pair"]
        try:
            for h, (down, up) in enumerate(pairs):
                up[1].close()
                ranks = list(range(h * per_host, (h + 1) * per_host))
                link = HostLink(self.channels, ranks, {"pair": (down[0], up[0])}, None, 5.0)
                for r in ranks:
                    self.channels.relays[r] = link
                self.links.append(link)
                self.relay_down.append(down[1])
        finally:  # only these links: a real session in this process connects for real (part 3)
            controller_sockets.connect_pair = connect_pair
        self.selector = selectors.DefaultSelector()
        for s in self.relay_down:
            s.setblocking(False)
            self.selector.register(s, selectors.EVENT_READ)

    def drain(self) -> None:
        """Read what the controller wrote to the relays (outside the timings)."""
        while True:
            events = self.selector.select(0)
            if not events:
                return
            for key, _ in events:
                try:
                    while key.fileobj.recv(1 << 20):
                        pass
                except BlockingIOError:
                    pass

    def forget_tasks(self) -> None:
        """The controller's batches wait for their Dask tasks in ``_later``: none are submitted here."""
        s = self.session
        for entries in s._later:
            entries.clear()
        s._later_due = None

    def answer(self, seq: int) -> None:
        """Every relay answers that its ranks passed ``seq`` (from the forked process)."""
        self.told.sendall(seq.to_bytes(8, "little"))

    def close(self) -> None:
        self.channels._closing = True
        self.told.close()  # the relays' process ends, closing the up sockets: the readers end
        os.waitpid(self.relays, 0)
        for link in self.links:
            link.close()
        for s in self.relay_down:
            s.close()


def _relays(told: socket.socket, ups: list) -> None:
    """The forked relays: for each seq told, one answer chunk per host, ``[("s", seq)]`` pickled as ``HostRelay``'s
    outbox pickles it (``worker/relay.py``), written with ``send_frame``."""
    chunk = 0
    while True:
        data = told.recv(8)
        if len(data) < 8:
            return
        seq = int.from_bytes(data, "little")
        blob = pickle.dumps([("s", seq)], protocol=5)
        chunk += 1
        for up in ups:
            send_frame(up, {"c": chunk, "d": blob}, 5.0)


_ADD = op_path(torch.ops.aten.add.Tensor)
_STREAM = StreamRef(0)


def op_messages(session: Controller) -> None:
    """Buffer what one eager ``y = x + x`` sends every rank: a ``CallFunction`` of ``aten.add.Tensor`` on the default
    stream, and the ``DeleteRefs`` of the ``y`` the previous op dropped (as ``controller/dispatch.py`` sends them)."""
    seq = session._next_seq
    session._next_seq += 1
    session._buffer.append((session._all, CallFunction(seq, [Ref(seq + 1)], (), _ADD,
                                                       ArgsKwargs((Ref(0), Ref(0)), {}), _STREAM, ())))
    if seq:
        session._buffer.append((session._all, DeleteRefs([Ref(seq)])))


def time_flush(mesh: Mesh, rounds: int, ops: int = 1) -> float:
    """Median seconds of one flush of ``ops`` eager ops."""
    s = mesh.session
    times = []
    for i in range(rounds):
        for _ in range(ops):
            op_messages(s)
        t = time.perf_counter()
        with s.lock:
            s._flush_locked(None)
        times.append(time.perf_counter() - t)
        mesh.forget_tasks()
        if ops > 1 or i % 16 == 15:
            mesh.drain()
    mesh.drain()
    return statistics.median(times)


def time_fetch(mesh: Mesh, rounds: int) -> float:
    """Median seconds of a whole sync."""
    s = mesh.session
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        with s.lock:
            seq = s._next_seq
            s._next_seq += 1
            future = MonarchFuture(s, seq, "bench")
            s._waiters.append((seq, future, None))
            s._flush_locked(seq, tasks=future.tasks)
        mesh.answer(seq + 1)
        future.result(timeout=10)
        times.append(time.perf_counter() - t)
        mesh.forget_tasks()
        mesh.drain()
    return statistics.median(times)


def time_apply(mesh: Mesh, rounds: int) -> float:
    """Median seconds of ``HostLink._apply`` of every host's answer (inline: no socket, no thread)."""
    s = mesh.session
    times = []
    for _ in range(rounds):
        seq = s._next_seq = s._next_seq + 1
        blob = pickle.dumps([("s", seq)], protocol=5)
        t = time.perf_counter()
        for link in mesh.links:
            link._apply(blob)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def fit(xs: list, ys: list) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    n, mx, my = len(xs), statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def controller_side(hosts: list[int], per_host: int, rounds: int) -> None:
    print(f"controller side (microbenchmark: socketpairs stand in for the relays), {per_host} ranks per host, "
          f"median of {rounds} rounds, us", flush=True)
    print(f"{'hosts':>6} {'ranks':>6} {'flush':>9} {'flush100/op':>12} {'fetch':>9} {'apply':>9}", flush=True)
    rows = []
    for h in hosts:
        mesh = Mesh(h, per_host)
        try:
            time_flush(mesh, rounds // 4)  # warm up
            flush = time_flush(mesh, rounds)
            batched = time_flush(mesh, max(5, rounds // 20), ops=100) / 100
            time_fetch(mesh, rounds // 4)
            fetch = time_fetch(mesh, rounds)
            apply = time_apply(mesh, rounds)
        finally:
            mesh.close()
        rows.append((h, flush * 1e6, fetch * 1e6, apply * 1e6, batched * 1e6))
        print(f"{h:>6} {h * per_host:>6} {flush * 1e6:>9.1f} {batched * 1e6:>12.1f} {fetch * 1e6:>9.1f} "
              f"{apply * 1e6:>9.1f}", flush=True)
    xs = [r[0] for r in rows]
    for name, col in (("flush", 1), ("fetch", 2), ("apply", 3), ("flush100/op", 4)):
        slope, icpt = fit(xs, [r[col] for r in rows])
        small = [r for r in rows if r[0] <= 8]
        slope8, _ = fit([r[0] for r in small], [r[col] for r in small]) if len(small) > 1 else (float("nan"), 0)
        print(f"per extra host: {name}: {slope:.2f} us over all (intercept {icpt:.1f} us); {slope8:.2f} us up to 8 "
              f"hosts", flush=True)


def attach_costs(counts: list[int], rounds: int) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from scale import CliCluster  # noqa: E402  (bench/scale.py)

    import dask_monarch as dm

    cluster = CliCluster(max(counts))
    try:
        dm.attach(cluster.client, dims={"dp": max(counts)}).exit()  # the workers' first session (imports)
        print(f"attach (real cluster: stock CLI, {max(counts)} workers on loopback, one host), median of {rounds}, s",
              flush=True)
        results: dict = {}
        for _ in range(rounds):
            for tree in (False, True):
                for n in counts:
                    with dask.config.set({"monarch.answer-tree": tree}):
                        start = time.perf_counter()
                        mesh = dm.attach(cluster.client, dims={"dp": n})
                        took = time.perf_counter() - start
                    mesh.exit()
                    results.setdefault((tree, n), []).append(took)
        for n in counts:
            off, on = (statistics.median(results[(t, n)]) for t in (False, True))
            print(f"{n:>3} ranks: tree off {off:.3f} s, tree on {on:.3f} s (relay start {on - off:+.3f} s)", flush=True)
        for tree in (False, True):
            slope, icpt = fit(counts, [statistics.median(results[(tree, n)]) for n in counts])
            print(f"per extra rank (tree {'on' if tree else 'off'}): {slope * 1e3:.2f} ms (intercept {icpt:.3f} s)",
                  flush=True)
    finally:
        cluster.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="1,2,4,8,16,32")
    parser.add_argument("--per-host", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--attach", default="", help="rank counts for part 3, e.g. 1,2,4 (default: skipped)")
    parser.add_argument("--attach-rounds", type=int, default=3)
    args = parser.parse_args()
    interpreter.hold()  # the switch interval a session sets (``interpreter.py``)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, switch interval "
          f"{sys.getswitchinterval() * 1e6:.0f} us", flush=True)
    if args.hosts:
        controller_side([int(h) for h in args.hosts.split(",")], args.per_host, args.rounds)
    if args.attach:
        attach_costs([int(n) for n in args.attach.split(",")], args.attach_rounds)


if __name__ == "__main__":
    main()
