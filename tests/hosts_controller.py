"""The controller program of tests/test_hosts.py, run in the controller's namespace host by
``python tests/hosts_controller.py <scheduler address> <worker-hosts> <workers-per-host> [--quick]``: it attaches
over the namespace hosts, checks values, and prints one ``ok <check>`` line per check that passed (an assertion
stops it with a traceback). ``--quick``: only actors, reduce and to_mesh (then exit)."""

import sys
import time
import urllib.request

import dask.array as da
import numpy as np
import torch
from distributed import get_worker

import dask_monarch as dm

address, n_hosts, per_host = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
quick = sys.argv[4:] == ["--quick"]
dims = {"host": n_hosts, "gpu": per_host}
world = n_hosts * per_host
TIMEOUT = 120


class Where:
    """An actor that says where it runs."""

    def address(self):
        return get_worker().address


def rank_of(host, gpu):
    return host * per_host + gpu


with dm.attach(address, dims=dims, timeout=TIMEOUT) as mesh:
    # actors: one per rank, each on its rank's worker; ranks are sorted by host, then port
    where = mesh.spawn(Where)
    addresses = where.address.call().result(timeout=TIMEOUT)
    seen = {}
    for point, worker in addresses.items():
        rank = rank_of(point["host"], point["gpu"])
        seen[rank] = worker
    assert sorted(seen) == list(range(world)), seen
    hosts = [w.split("://")[1].rsplit(":", 1)[0] for _, w in sorted(seen.items())]
    assert len(set(hosts)) == n_hosts, hosts
    assert all(hosts[rank_of(h, g)] == hosts[rank_of(h, 0)] for h in range(n_hosts) for g in range(per_host)), hosts
    print("ok actors", " ".join(hosts), flush=True)

    # a reduce over both dims, and every rank's own value
    with mesh.activate():
        mine = torch.ones(3) * (mesh.rank("host") * per_host + mesh.rank("gpu") + 1)
        total = mine.reduce(("host", "gpu"), "sum")
        per_gpu = mine.reduce("host", "sum")
    expected = world * (world + 1) / 2
    for h in range(n_hosts):
        for g in range(per_host):
            assert torch.equal(dm.inspect(total, host=h, gpu=g), torch.full((3,), expected)), (h, g)
            assert torch.equal(dm.inspect(mine, host=h, gpu=g), torch.full((3,), rank_of(h, g) + 1.0)), (h, g)
            want = sum(rank_of(k, g) + 1.0 for k in range(n_hosts))
            assert torch.equal(dm.inspect(per_gpu, host=h, gpu=g), torch.full((3,), want)), (h, g)
    print("ok reduce", flush=True)

    # to_mesh from the first host's ranks to the last host's
    first, last = mesh.slice(host=0), mesh.slice(host=n_hosts - 1)
    with first.activate():
        y = torch.arange(4.0) * 10 + mesh.rank("gpu")
    moved = y.to_mesh(last)
    for g in range(per_host):
        assert torch.equal(dm.inspect(moved, gpu=g), torch.arange(4.0) * 10 + g), g
    print("ok to_mesh", flush=True)

    if not quick:  # the checks after to_mesh (tests/test_hosts.py leaves them out where the hosts are apart)
        # a compiled call (a recording replayed on every rank), whose all-reduce crosses the hosts
        @dm.compile(verify=False)
        def step(w, x):
            g = (w * x).reduce(("host", "gpu"), "sum")
            w.sub_(0.5 * g)
            return g

        with mesh.activate():
            w = torch.ones(2)
            for _ in range(3):
                x = torch.ones(2) * (mesh.rank("host") * per_host + mesh.rank("gpu") + 1)
                g = step(w, x)
            last_g, last_w = dm.inspect((g, w), host=n_hosts - 1, gpu=per_host - 1)
        # by hand: g = w * sum(ranks + 1) elementwise; w <- w - 0.5 g
        s, ww = expected, 1.0
        for _ in range(3):
            gg = ww * s
            ww -= 0.5 * gg
        assert torch.allclose(last_g, torch.full((2,), gg)) and torch.allclose(last_w, torch.full((2,), ww)), (last_g, last_w)
        assert step.recordings == 1, step.recordings
        print("ok compile", flush=True)

        # from_dask: partitions computed on the workers of other hosts, sharded along host
        data = np.arange(2 * 4 * n_hosts, dtype=np.float32).reshape(4 * n_hosts, 2)
        t = dm.from_dask(da.from_array(data, chunks=(3, 2)), mesh, "host")
        for h in range(n_hosts):
            for g in range(per_host):
                got = dm.inspect(t, host=h, gpu=g).numpy()
                assert np.array_equal(got, data[4 * h: 4 * (h + 1)]), (h, g, got)
        print("ok from_dask", flush=True)
        # the dashboard's page, on the scheduler's host, reached from the controller's
        link = mesh.dashboard_link
        assert link.startswith(f"http://{address.split('://')[1].rsplit(':', 1)[0]}:"), link
        page = urllib.request.urlopen(link, timeout=30)
        assert page.status == 200 and "individual-monarch" in page.read().decode(), link
        print("ok dashboard", link, flush=True)

        # the page's hosts table, from the scheduler's data: a row per worker host, every rank running there
        def hosts_table(dask_scheduler):
            from dask_monarch.dashboard.data import DashboardData
            from dask_monarch.dashboard.install import read_scheduler

            return DashboardData().update(*read_scheduler(dask_scheduler), time.time())["hosts"]

        deadline = time.monotonic() + 60
        while True:  # a rank counts as running once a heartbeat carried the session's numbers
            table = mesh.client.run_on_scheduler(hosts_table)
            if sum(table["running"]) == world or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert table["ranks"] == [per_host] * n_hosts and table["running"] == [per_host] * n_hosts, table
        print("ok hosts-table", " ".join(table["host"]), flush=True)
print("ok exit", flush=True)
