"""A userspace router that joins the namespace hosts of tests/netns_hosts.py with a one-way delay (issue 23 item 5):
this kernel has no ``netem`` qdisc, so the delay is made here, on the packets' path, instead of in a qdisc.

Run by ``NamespaceHosts(n, delay_ms=...)``, never by hand::

    python tests/delay_router.py --delay-ms 0.1 --mtu 9000 NETNS=ADDRESS [NETNS=ADDRESS ...]

For each ``NETNS=ADDRESS`` it enters that network namespace (``setns(2)`` through ctypes: Python 3.11 has no
``os.setns``), opens a TUN device ``eth0`` there (``IFF_TUN | IFF_NO_PI``: the fd reads and writes bare IP
packets), and goes back to its own namespace; the fds keep working from there. It prints ``ready`` once every
device exists (the caller then gives each its address, its MTU and ``up`` with ``ip``). Then one loop (stdlib
``selectors``): every IPv4 packet read from a host's TUN is held until ``its arrival + delay`` in a heap and then
written to the TUN of the namespace that owns its destination address; a packet to any other address, and any
packet that is not IPv4 (the kernel's IPv6 link-local traffic when a device comes up), is dropped (counted). The heap's earliest deadline is the selector's timeout; the
selector is ``select(2)``, whose timeout has microsecond resolution (``epoll`` rounds it up to milliseconds),
and the process asks for 1 us timer slack (``prctl(PR_SET_TIMERSLACK)``; the default is 50 us). Equal delays
keep each flow's order (the heap breaks ties by arrival).

So a packet between two hosts takes ``delay`` plus this process's own time (a read, a heap push and pop, a
write: its cost is in docs/clusters.md); a round trip takes at least ``2 * delay``. The devices are not
persistent: they go when this process ends, however it ends; on SIGTERM it prints its counters (``forwarded``,
``dropped`` (IPv4 to no host, or refused by the receiving device), ``not-IPv4``, the most packets held at once) to
stderr and exits.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import fcntl
import heapq
import os
import selectors
import signal
import socket
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000
PR_SET_TIMERSLACK, PR_SET_PDEATHSIG = 29, 1
DEVICE = "eth0"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def setns(fd: int) -> None:
    """Move this thread into the network namespace ``fd`` names (``setns(2)``); raises ``OSError``."""
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def open_tun(netns: str) -> int:
    """A non-blocking fd of a new TUN device ``eth0`` made inside the network namespace ``netns`` (a name of
    ``ip netns``); this process stays in its own namespace. Raises ``OSError`` naming the namespace."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = -1
    try:
        target = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
        setns(target)
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            try:
                fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", DEVICE.encode(), IFF_TUN | IFF_NO_PI))
            except OSError:
                os.close(fd)
                raise
        finally:
            setns(home)
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        raise OSError(e.errno, f"TUN device {DEVICE} in namespace {netns}: {e.strerror or e}{where}") from None
    finally:
        os.close(home)
        if target >= 0:
            os.close(target)
    return fd


class Router:
    """Forwards IPv4 packets among TUN fds by destination address, each held ``delay`` seconds."""

    def __init__(self, tuns: dict[str, int], delay: float, mtu: int):
        self.delay = delay
        self.mtu = mtu
        self.by_address = {socket.inet_aton(a): fd for a, fd in tuns.items()}
        self.selector = selectors.SelectSelector()  # select(2): microsecond timeouts (epoll's are milliseconds)
        for fd in tuns.values():
            self.selector.register(fd, selectors.EVENT_READ)
        self.held: list[tuple[float, int, int, bytes]] = []  # (due, arrival order, out fd, packet)
        self.order = 0
        self.forwarded = self.dropped = self.not_ipv4 = self.most_held = 0

    def _read(self, fd: int, now: float) -> None:
        while True:
            try:
                packet = os.read(fd, self.mtu + 64)
            except BlockingIOError:
                return
            if len(packet) < 20 or packet[0] >> 4 != 4:
                self.not_ipv4 += 1
                continue
            out = self.by_address.get(packet[16:20])
            if out is None:
                self.dropped += 1
            elif self.delay <= 0:
                self._write(out, packet)
            else:
                self.order += 1
                heapq.heappush(self.held, (now + self.delay, self.order, out, packet))

    def _write(self, fd: int, packet: bytes) -> None:
        try:
            os.write(fd, packet)
            self.forwarded += 1
        except OSError as e:  # the receiving stack refused it (e.g. its device went down): a lost packet
            if e.errno not in (errno.EAGAIN, errno.EIO, errno.EINVAL, errno.ENOBUFS):
                raise
            self.dropped += 1

    def run(self) -> None:
        held, clock = self.held, time.monotonic
        while True:
            timeout = max(0.0, held[0][0] - clock()) if held else None
            for key, _ in self.selector.select(timeout):
                self._read(key.fd, clock())
            if len(held) > self.most_held:
                self.most_held = len(held)
            now = clock()
            while held and held[0][0] <= now:
                _, _, out, packet = heapq.heappop(held)
                self._write(out, packet)


def main() -> None:
    parser = argparse.ArgumentParser(description="a delay router between namespace hosts (tests/netns_hosts.py)")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay of every packet, ms")
    parser.add_argument("--mtu", type=int, default=9000)
    parser.add_argument("hosts", nargs="+", help="NETNS=ADDRESS: a namespace and the IPv4 address it owns")
    args = parser.parse_args()
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)  # end (and so remove the devices) with the caller
    if os.getppid() == 1:  # it ended already
        return
    if not args.delay_ms >= 0:
        parser.error(f"--delay-ms must be >= 0, got {args.delay_ms}")
    tuns = {}
    for spec in args.hosts:
        netns, _, address = spec.partition("=")
        try:
            socket.inet_aton(address)
            tuns[address] = open_tun(netns)
        except OSError as e:  # a bad address, or the kernel refused the device: one line for the caller
            sys.exit(f"delay_router: {spec}: {e.strerror or e}")
    _libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    router = Router(tuns, args.delay_ms / 1e3, args.mtu)

    def stop(signum, frame):
        print(f"delay_router: forwarded {router.forwarded} dropped {router.dropped} not-IPv4 {router.not_ipv4} "
              f"most held {router.most_held}", file=sys.stderr, flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    router.run()


if __name__ == "__main__":
    main()
