"""The cost of tests/delay_router.py, the userspace router that puts a delay between the namespace hosts (issue 23
item 5), against the kernel's bridge, in one run (root; Linux network namespaces and /dev/net/tun).

For the bridge and for the router at each ``--delays`` (ms, one way): 2 namespace hosts (tests/netns_hosts.py),
then the TCP round trip (``--trips`` of 1 byte there and back, ``TCP_NODELAY``: p50, p90, min, in ms), then a bulk
TCP transfer of ``--megabytes`` MB from host 0 to host 1 (MB/s of the receiver's wall time, and for the router
the packets it forwarded a second over that transfer, data and acknowledgements both ways). The round trip at
delay 0 over the bridge's is the router's own latency; the bulk rate is its throughput::

    python bench/delay_router.py [--delays 0 0.1 1] [--trips 500] [--megabytes 200] [--mtu 9000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from netns_hosts import NamespaceHosts, round_trip_ms  # noqa: E402

_SINK = """import socket, sys, time
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
c, _ = s.accept()
n, t0 = 0, time.perf_counter()
while (b := c.recv(1 << 20)):
    n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""
_SOURCE = """import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), 10)
block = bytes(1 << 20)
for _ in range(int(sys.argv[3])):
    c.sendall(block)
c.close()
"""


def bulk(hosts: NamespaceHosts, megabytes: int, port: int = 7010) -> tuple[float, float]:
    """Send ``megabytes`` MB over one TCP connection from host 0 to host 1: (MB/s at the receiver, seconds)."""
    import subprocess

    sink = hosts.popen(1, [sys.executable, "-c", _SINK, hosts.address(1), str(port)], stdout=subprocess.PIPE,
                       text=True)
    assert sink.stdout.readline().strip() == "listening"
    hosts.run(0, [sys.executable, "-c", _SOURCE, hosts.address(1), str(port), str(megabytes)], timeout=300)
    got, seconds = sink.stdout.readline().split()
    sink.wait(30)
    assert int(got) == megabytes << 20, got
    return megabytes / float(seconds), float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.1, 1.0])
    parser.add_argument("--trips", type=int, default=500)
    parser.add_argument("--megabytes", type=int, default=200)
    parser.add_argument("--mtu", type=int, default=9000)
    args = parser.parse_args()
    print(f"load {os.getloadavg()[0]:.1f}, cores {os.cpu_count()}, MTU {args.mtu} (router)")
    bridge_p50 = None
    for delay in [None, *args.delays]:
        with NamespaceHosts(2, delay_ms=delay, mtu=args.mtu) as hosts:
            trips = sorted(round_trip_ms(hosts, 0, 1, count=args.trips))
            rate, seconds = bulk(hosts, args.megabytes)
        p50 = statistics.median(trips)
        name = "bridge" if delay is None else f"router, {delay:g} ms"
        line = (f"{name:18s} round trip p50 {p50:7.3f} ms  p90 {trips[len(trips) * 9 // 10]:7.3f}  min "
                f"{trips[0]:7.3f}   bulk {rate:7.1f} MB/s")
        if delay is None:
            bridge_p50 = p50
        else:
            forwarded = int(hosts.router_report.split()[2])
            line += f"  {forwarded / seconds:8.0f} packets/s  (+{(p50 - bridge_p50) * 1e3:.0f} us p50 over the bridge)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
