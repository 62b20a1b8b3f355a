"""Hosts simulated on one Linux machine as network namespaces (issue 23 item 5), for tests/test_hosts.py and by
hand.

``NamespaceHosts(n)`` makes ``n`` network namespaces, each a "host" with one interface ``eth0`` and an address
``10.231.0.(10 + i)/24``, joined by veth pairs to a bridge that lives in a namespace of its own (``<tag>-sw``).
No namespace has a route beyond that /24, and nothing is added to the machine's own namespace: traffic between
the hosts stays on the bridge, and nothing else is reachable from them; it crosses veth pairs and a bridge, not
loopback, with no delay.

``NamespaceHosts(n, delay_ms=1.0)`` joins them with a delay instead (this kernel has no ``netem`` qdisc): each
host's ``eth0`` is a TUN device (MTU ``mtu``, 9000 by default) held by one router process in ``<tag>-sw``
(tests/delay_router.py), which holds every IPv4 packet ``delay_ms`` before it writes it to the TUN of the host
that owns its destination address, and drops the rest. A round trip between two hosts then takes at least
``2 * delay_ms`` plus the router's own time (``delay_ms=0``: the router without a delay, to measure that time).
``round_trip_ms`` measures TCP round trips between two hosts.

``start_cluster`` runs the stock command lines in them: ``dask scheduler`` on host 0, ``dask worker --nworkers
W --nthreads 1`` on hosts 2.. (host 1 is left for the controller). ``close`` ends every process started here (its
process group: SIGTERM, then SIGKILL after 5 s) and deletes the namespaces, also after a failure; ``start``
first deletes those a killed run left (named after a pid that no longer runs).

Needs root, ``ip`` (iproute2) and a kernel that allows network namespaces, veth and bridges;
``NamespaceHosts.start`` raises ``HostsUnavailable`` saying which is missing.

By hand (root)::

    python tests/netns_hosts.py [--delay-ms 0.1] [--workers-per-host 2] [--worker-hosts 2] [--ops 3000] [--fetches 200]

starts 2 + worker-hosts namespaces and the cluster, prints the TCP round trip between the controller's host and
a worker host, then runs ``bench/hosts.py`` in the controller's namespace: the fetch p50/p90 and the controller
time per eager op over the hosts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

__all__ = ["HostsUnavailable", "NamespaceHosts", "round_trip_ms", "start_cluster", "SUBNET"]

#: the hosts' /24 (a private range); host i has SUBNET.(10 + i)
SUBNET = "10.231.0"
SCHEDULER_PORT = 8786
_IP_TIMEOUT = 30.0  # seconds one ``ip`` command may take
_ROUTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delay_router.py")


class HostsUnavailable(RuntimeError):
    """This machine cannot make the namespace hosts (not Linux, not root, no ``ip``, or the kernel refuses)."""


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, ["ip", *args], proc.stdout, proc.stderr)


class NamespaceHosts:
    """``n`` network namespaces on one bridge, ``address(i)`` each (see the module's docstring); a context
    manager. ``tag`` prefixes every name (default ``dm<pid>``, so two runs do not collide). ``delay_ms`` (a float
    >= 0, milliseconds one way): join them through tests/delay_router.py instead of the bridge, with TUN devices
    of MTU ``mtu`` (576 to 65000); ``router_report`` then has the router's counters after ``close``."""

    def __init__(self, n: int, *, tag: str | None = None, subnet: str = SUBNET, delay_ms: float | None = None,
                 mtu: int = 9000):
        if type(n) is not int or not 2 <= n <= 200:
            raise ValueError(f"n must be an int from 2 to 200 (hosts), got {n!r}")
        if delay_ms is not None and not (isinstance(delay_ms, (int, float)) and 0 <= delay_ms <= 1000):
            raise ValueError(f"delay_ms must be None (the bridge) or a number of ms from 0 to 1000, got {delay_ms!r}")
        if type(mtu) is not int or not 576 <= mtu <= 65000:
            raise ValueError(f"mtu must be an int from 576 to 65000 (bytes), got {mtu!r}")
        self.delay_ms, self.mtu = delay_ms, mtu
        self.router_report = ""
        self._router_log = None
        self.tag = tag or f"dm{os.getpid()}"
        self.subnet = subnet
        self.names = [f"{self.tag}-h{i}" for i in range(n)]
        self.switch = f"{self.tag}-sw"
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    def address(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def start(self) -> "NamespaceHosts":
        """Make the namespaces, the bridge and the links. Raises ``HostsUnavailable`` (having removed what it
        made) where this machine cannot."""
        if not sys.platform.startswith("linux"):
            raise HostsUnavailable(f"network namespaces are Linux only (this is {sys.platform})")
        if shutil.which("ip") is None:
            raise HostsUnavailable("`ip` (iproute2) is not installed")
        if os.geteuid() != 0:
            raise HostsUnavailable("making network namespaces needs root (`ip netns add`)")
        _remove_stale()
        try:
            self._netns(self.switch)
            _ip("-n", self.switch, "link", "set", "lo", "up")
            if self.delay_ms is not None:
                self._start_router()
                return self
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                self._netns(name)
                _ip("-n", self.switch, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("-n", self.switch, "link", "set", f"v{i}", "master", "br0")
                _ip("-n", self.switch, "link", "set", f"v{i}", "up")
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            self.close()
            detail = getattr(e, "stderr", None) or str(e)
            cmd = " ".join(getattr(e, "cmd", None) or [])
            raise HostsUnavailable(f"the kernel refused: {cmd + ': ' if cmd else ''}{str(detail).strip()}") from None
        return self

    def _start_router(self) -> None:
        """Make the hosts' namespaces, start the router in the switch's (it makes each host's TUN ``eth0``), then
        give each device its address and MTU. The router dies with this process (``PR_SET_PDEATHSIG``)."""
        import select
        import tempfile

        for name in self.names:
            self._netns(name)
            _ip("-n", name, "link", "set", "lo", "up")
        self._router_log = tempfile.TemporaryFile()
        hosts = [f"{name}={self.address(i)}" for i, name in enumerate(self.names)]
        router = self.popen(None, [sys.executable, _ROUTER, "--delay-ms", repr(float(self.delay_ms)), "--mtu",
                                   str(self.mtu), *hosts], stdout=subprocess.PIPE, stderr=self._router_log)
        ready, _, _ = select.select([router.stdout], [], [], _IP_TIMEOUT)
        line = router.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            _end(router, grace=0)
            self._router_log.seek(0)
            raise OSError(f"the delay router did not start: {self._router_log.read().decode()[-2000:].strip()}")
        for i, name in enumerate(self.names):
            _ip("-n", name, "link", "set", "eth0", "mtu", str(self.mtu))
            _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def popen(self, i: int | None, argv: list[str], **kwargs) -> subprocess.Popen:
        """Run ``argv`` in host ``i``'s namespace (``None``: the switch's), in a process group of its own (``close``
        ends it)."""
        name = self.switch if i is None else self.names[i]
        proc = subprocess.Popen(["ip", "netns", "exec", name, *argv], start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, i: int, argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` in host ``i``'s namespace to its end, at most ``timeout`` seconds (its process group is
        killed then, and ``subprocess.TimeoutExpired`` raised)."""
        if kwargs.pop("capture_output", False):
            kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc = self.popen(i, argv, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end(proc, grace=0)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def close(self) -> None:
        """End every process started here, then delete the namespaces (each step even if one before failed)."""
        for proc in reversed(self.procs):
            _end(proc)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        self.procs.clear()
        if self._router_log is not None:
            self._router_log.seek(0)
            self.router_report = self._router_log.read().decode(errors="replace").strip()
            self._router_log.close()
            self._router_log = None
        for name in reversed(self._made):
            try:
                _ip("netns", "del", name)
            except Exception as e:  # keep deleting the others; say which one is left
                print(f"netns_hosts: could not delete namespace {name}: {e}", file=sys.stderr)
        self._made.clear()

    def __enter__(self) -> "NamespaceHosts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _remove_stale() -> None:
    """Delete the namespaces a run killed before its ``close`` left (``dm<pid>-...``, ``dmc<pid>-...`` of a pid
    that no longer runs); the processes in them went with that run's process groups or go now."""
    import re

    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=_IP_TIMEOUT).stdout
    for line in listed.splitlines():
        match = re.match(r"^(dmc?(\d+)-(?:h\d+|sw))\b", line)
        if match is None:
            continue
        try:
            os.kill(int(match[2]), 0)
            continue  # its run is still going
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        for pid in subprocess.run(["ip", "netns", "pids", match[1]], capture_output=True, text=True,
                                  timeout=_IP_TIMEOUT).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", match[1]], capture_output=True, timeout=_IP_TIMEOUT)


_ECHO = """import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(64)):
    c.sendall(b)
"""
_PING = """import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), 10)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
out = []
for _ in range(int(sys.argv[3])):
    t0 = time.perf_counter()
    c.sendall(b"x")
    assert c.recv(64) == b"x"
    out.append((time.perf_counter() - t0) * 1e3)
print(" ".join(f"{t:.4f}" for t in out))
"""


def round_trip_ms(hosts: NamespaceHosts, client: int, server: int, count: int = 200, port: int = 7009,
                  timeout: float = 60.0) -> list[float]:
    """``count`` TCP round trips (1 byte there and back, ``TCP_NODELAY``) from host ``client`` to an echo
    server on host ``server``'s address, in milliseconds each (the first connection's handshake not counted).
    Raises ``RuntimeError`` with either side's output if a side fails or takes over ``timeout`` seconds."""
    echo = hosts.popen(server, [sys.executable, "-c", _ECHO, hosts.address(server), str(port)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        import select

        ready, _, _ = select.select([echo.stdout], [], [], timeout)
        if not ready or echo.stdout.readline().strip() != "listening":  # it ended (its error is on stderr) or hung
            raise RuntimeError(f"the echo server on host {server} did not start: {echo.stderr.read()[-2000:]}")
        proc = hosts.run(client, [sys.executable, "-c", _PING, hosts.address(server), str(port), str(count)],
                         timeout=timeout, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"round trips from host {client} to host {server} failed: {proc.stderr[-2000:]}")
        return [float(t) for t in proc.stdout.split()]
    finally:
        _end(echo, grace=0)
        echo.stdout.close()
        echo.stderr.close()
        hosts.procs.remove(echo)


def _end(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL it after ``grace`` seconds if its leader still runs."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # whatever of the group outlived its leader
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def start_cluster(hosts: NamespaceHosts, worker_hosts: list[int], workers_per_host: int, *, log_dir: str,
                  timeout: float = 120.0) -> str:
    """Start ``dask scheduler`` on host 0 and ``dask worker <scheduler> --nworkers workers_per_host --nthreads 1``
    on each host of ``worker_hosts``, their output in ``log_dir``; wait (at most ``timeout`` s) until every worker
    joined. Returns the scheduler's address. Raises ``TimeoutError`` saying how many joined."""
    bin_dir = os.path.dirname(sys.executable)
    dask = os.path.join(bin_dir, "dask") if os.path.exists(os.path.join(bin_dir, "dask")) else "dask"
    host0 = hosts.address(0)
    address = f"tcp://{host0}:{SCHEDULER_PORT}"
    logs = []

    def log(name):
        f = open(os.path.join(log_dir, name), "w")
        logs.append(f)
        return f

    hosts.popen(0, [dask, "scheduler", "--host", host0, "--port", str(SCHEDULER_PORT), "--dashboard-address",
                    f"{host0}:8787", "--preload", "dask_monarch"], stdout=log("scheduler.log"), stderr=subprocess.STDOUT)
    for i in worker_hosts:
        ip = hosts.address(i)
        hosts.popen(i, [dask, "worker", address, "--nworkers", str(workers_per_host), "--nthreads", "1",
                        "--host", ip, "--dashboard-address", f"{ip}:0"],
                    stdout=log(f"worker-h{i}.log"), stderr=subprocess.STDOUT)
    for f in logs:
        f.close()  # the children hold their own descriptors
    want = len(worker_hosts) * workers_per_host
    probe = ("import sys; from distributed import Client\n"
             "with Client(sys.argv[1], timeout=30) as c:\n"
             "    c.wait_for_workers(int(sys.argv[2]), timeout=float(sys.argv[3]))\n"
             "    print(len(c.scheduler_info()['workers']))\n")
    proc = hosts.run(1, [sys.executable, "-c", probe, address, str(want), str(timeout)], timeout=timeout + 40,
                     capture_output=True, text=True)
    if proc.returncode:
        raise TimeoutError(f"{want} workers did not join {address} within {timeout:g} s; logs in {log_dir}\n"
                           f"{proc.stderr[-3000:]}")
    return address


def main() -> None:
    parser = argparse.ArgumentParser(description="Namespace hosts with a stock Dask cluster; runs bench/hosts.py")
    parser.add_argument("--worker-hosts", type=int, default=2)
    parser.add_argument("--workers-per-host", type=int, default=2)
    parser.add_argument("--log-dir", default=None, help="where the scheduler's and workers' output goes")
    parser.add_argument("--delay-ms", type=float, default=None,
                        help="one-way delay between the hosts (tests/delay_router.py); default: the bridge, no delay")
    parser.add_argument("--mtu", type=int, default=9000, help="the router's TUN devices' MTU (with --delay-ms)")
    args, rest = parser.parse_known_args()
    import statistics
    import tempfile

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="netns-hosts-")
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "hosts.py")
    with NamespaceHosts(2 + args.worker_hosts, delay_ms=args.delay_ms, mtu=args.mtu) as hosts:
        trips = sorted(round_trip_ms(hosts, 1, 2, count=200))
        print(f"{'bridge' if args.delay_ms is None else f'delay router, {args.delay_ms:g} ms one way'}: TCP round "
              f"trip host 1 -> host 2 p50 {statistics.median(trips):.3f} ms  p90 {trips[len(trips) * 9 // 10]:.3f}"
              f"  min {trips[0]:.3f}", flush=True)
        address = start_cluster(hosts, list(range(2, 2 + args.worker_hosts)), args.workers_per_host,
                                log_dir=log_dir)
        dims = ["--dims", f"host={args.worker_hosts}", f"gpu={args.workers_per_host}"]
        proc = hosts.popen(1, [sys.executable, bench, address, *dims, *rest])
        code = proc.wait()
    if hosts.router_report:
        print(hosts.router_report, file=sys.stderr)
    print(f"logs: {log_dir}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
