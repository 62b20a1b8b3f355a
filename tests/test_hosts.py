"""A mesh across hosts, simulated on one machine (issue 23 item 5): 4 network namespaces on one bridge
(tests/netns_hosts.py), the stock ``dask scheduler`` in the first, the controller in the second and ``dask worker
--nworkers 2 --nthreads 1`` in the other two (2 hosts x 2 workers, mesh dims host=2, gpu=2). The controller
(tests/hosts_controller.py) checks that the actors of every rank answer from their own host, a reduce over both
dims and each rank's value, ``to_mesh`` from one host's ranks to the other's, a compiled call whose all-reduce
crosses the hosts, ``from_dask``, and the dashboard's ``/monarch`` page at ``mesh.dashboard_link`` with a row per worker host. Needs root and network namespaces (CI has both); skipped, saying why,
elsewhere. The actors, reduce and ``to_mesh`` checks run again with the hosts 1 ms apart (tests/delay_router.py: this
kernel has no ``netem``), after TCP round trips between two hosts show the delay is there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from netns_hosts import HostsUnavailable, NamespaceHosts, round_trip_ms, start_cluster

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKS = ["actors", "reduce", "to_mesh", "compile", "from_dask", "dashboard", "hosts-table", "exit"]
QUICK_CHECKS = ["actors", "reduce", "to_mesh", "exit"]  # hosts_controller.py --quick


def _started(made: NamespaceHosts):
    try:
        made.start()
    except HostsUnavailable as e:
        pytest.skip(f"no namespace hosts on this machine: {e}")
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def hosts():
    yield from _started(NamespaceHosts(4))


@pytest.fixture
def delayed_hosts():
    yield from _started(NamespaceHosts(4, delay_ms=1.0))


def test_a_mesh_over_namespace_hosts_gives_the_right_values_on_every_rank(hosts, tmp_path):
    check_the_mesh(hosts, tmp_path)


def test_a_mesh_over_hosts_1_ms_apart_gives_the_right_values_on_every_rank(delayed_hosts, tmp_path):
    """Through the delay router, 1 ms each way: a TCP round trip from the controller's host to a worker host
    takes at least 2 ms, and every rank answers from its host, the reduce over both dims and to_mesh between the
    hosts hold (the controller's ``--quick`` checks: the others add about 10 s and cross no other path)."""
    trips = round_trip_ms(delayed_hosts, 1, 2, count=50)
    assert len(trips) == 50 and min(trips) >= 2.0, trips
    check_the_mesh(delayed_hosts, tmp_path, quick=True)


def check_the_mesh(hosts: NamespaceHosts, tmp_path, quick: bool = False) -> None:
    """tests/hosts_controller.py (``--quick`` if ``quick``) over a cluster on hosts 2 and 3 (2 workers each), from
    host 1: every check passed, every rank answered from its own host, and nothing failed on the way."""
    address = start_cluster(hosts, [2, 3], 2, log_dir=str(tmp_path))
    argv = [sys.executable, os.path.join(HERE, "hosts_controller.py"), address, "2", "2", *(["--quick"] * quick)]
    proc = hosts.run(1, argv,
                     timeout=240, capture_output=True, text=True, cwd=str(tmp_path))
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("*.log")))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}\n{logs}"
    # the answer sockets reached every worker across the hosts (else the controller warns and falls back to the
    # Dask comm: controller/channel.py), and nothing else looked like a failure
    assert "no answer sockets" not in proc.stderr, proc.stderr
    assert not [line for line in proc.stderr.splitlines() if "Traceback" in line or "ERROR" in line], proc.stderr
    passed = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert passed == (QUICK_CHECKS if quick else CHECKS), proc.stdout
    actors = next(line for line in proc.stdout.splitlines() if line.startswith("ok actors")).split()[2:]
    # every rank answered from its own worker host: ranks 0, 1 on host 2's address, ranks 2, 3 on host 3's
    assert actors == [hosts.address(2)] * 2 + [hosts.address(3)] * 2, actors


def test_a_bad_delay_or_mtu_is_refused_by_name():
    with pytest.raises(ValueError, match="delay_ms"):
        NamespaceHosts(2, delay_ms=-1)
    with pytest.raises(ValueError, match="mtu"):
        NamespaceHosts(2, delay_ms=0.1, mtu=100)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux only")
def test_the_router_names_the_namespace_it_could_not_open_a_device_in():
    """What ``NamespaceHosts.start`` reports (as ``HostsUnavailable``, so the tests skip saying it) where the router
    cannot make a host's TUN device: one line naming the host, the namespace and the kernel's error."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, "delay_router.py"), "--delay-ms", "1",
                           "dm-no-such-ns=10.231.0.10"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == "", (proc.stdout, proc.stderr)
    assert proc.stderr.strip() == ("delay_router: dm-no-such-ns=10.231.0.10: TUN device eth0 in namespace "
                                   "dm-no-such-ns: No such file or directory (/var/run/netns/dm-no-such-ns)"), proc.stderr


@pytest.mark.parametrize("delay_ms", [None, 0.5], ids=["bridge", "router"])
def test_namespace_hosts_are_gone_after_close(delay_ms):
    """``close`` deletes every namespace it made and ends the processes started in them (the delay router too)."""
    made = NamespaceHosts(2, tag=f"dmc{os.getpid()}", delay_ms=delay_ms)
    try:
        made.start()
    except HostsUnavailable as e:
        pytest.skip(f"no namespace hosts on this machine: {e}")
    try:
        sleeper = made.popen(0, ["sleep", "600"])
        ping = made.run(1, ["python3", "-c", "import socket; s = socket.create_connection(('%s', 9), 1)"
                            % made.address(0)], timeout=30, capture_output=True, text=True)
        # the other host is reachable (refused: nothing listens on port 9), not unreachable
        assert "ConnectionRefusedError" in ping.stderr, ping.stderr
    finally:
        made.close()
    assert sleeper.poll() is not None
    if delay_ms is not None:  # the router ended, saying what it forwarded: at least the handshake's packets
        assert made.router_report.startswith("delay_router: forwarded"), made.router_report
        assert int(made.router_report.split()[2]) >= 2, made.router_report
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert made.tag not in listed, listed


def _ended(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (its parent died, and this container's init may not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_killed_run_leaves_no_router_and_the_next_start_removes_its_namespaces():
    """SIGKILL of the process that made delayed hosts: its router ends at once (``PR_SET_PDEATHSIG``), taking the
    TUN devices with it, and the next ``start`` deletes the namespaces left behind."""
    import select
    import signal
    import time

    from netns_hosts import _remove_stale

    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from netns_hosts import NamespaceHosts, HostsUnavailable\n"
            "h = NamespaceHosts(2, delay_ms=1.0)\n"
            "try:\n    h.start()\nexcept HostsUnavailable as e:\n    print('unavailable', e, flush=True); sys.exit()\n"
            "print(h.tag, h.procs[0].pid, flush=True); time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, HERE], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the hosts were not made within 60 s"
        line = proc.stdout.readline().split()
        if line[:1] == ["unavailable"]:
            pytest.skip(f"no namespace hosts on this machine: {' '.join(line[1:])}")
        tag, router = line[0], int(line[1])
        assert not _ended(router)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
    deadline = time.monotonic() + 10
    while not _ended(router) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ended(router), f"the router (pid {router}) outlived its run by 10 s"
    assert tag in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    _remove_stale()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert tag not in listed, listed
