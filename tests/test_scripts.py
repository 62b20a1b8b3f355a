"""Controller programs as a user writes and runs them: a script in a subprocess, on the embedded cluster or on one
started with ``dask scheduler``/``dask worker``. Each must do its work, print what it promises, and print no
error-looking line on a normal exit: with ``with``, with ``mesh.exit()``, without either (a notebook's last cell),
attaching twice in one process, and without ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

import pytest
from distributed import Client

from conftest import _cli_cluster

# what a user reads as a failure: log levels, tracebacks, and the phrases Dask and dask_monarch use for failures
ERROR_LOOKING = re.compile(
    r"error|exception|traceback|warn|fail|fatal|killing|still alive|lose |lost|cannot|unable|timed? ?out|abort",
    re.IGNORECASE,
)
TIMEOUT = 240

# the README's top example, as a Monarch user writes it: no main guard
EXAMPLE = """
import torch
import torch.nn.functional as F
import dask_monarch as dm

with dm.attach({cluster}dims={{"dp": 2}}) as mesh:
    with mesh.activate():
        x = torch.arange(4.0) + 10 * mesh.rank("dp")
        model = torch.nn.Linear(4, 2)
        loss = F.mse_loss(model(x), torch.zeros(2))
        loss.backward()
        dm.reduce_([p.grad for p in model.parameters()], "dp", "avg")
        total = x.reduce("dp", "sum")
    print(dm.inspect(total))
    print(dm.fetch_shard(x, dp=1).result())
    print("session", mesh.session_id)
"""
EXPECTED = ["tensor([10., 12., 14., 16.])", "tensor([10., 11., 12., 13.])"]


def run_script(tmp_path, source: str, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(source))
    proc = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=tmp_path)
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    return proc


def assert_quiet(proc: subprocess.CompletedProcess) -> None:
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if ERROR_LOOKING.search(line)]
    assert not lines, "error-looking lines on a normal exit:\n" + "\n".join(lines) + f"\n\nstderr:\n{proc.stderr}"


def session_ids(proc) -> list[str]:
    return re.findall(r"^session ([g-v]{32})$", proc.stdout, re.MULTILINE)


# ---------------------------------------------------------------------------------------------- embedded cluster
def test_script_without_main_guard_runs_on_the_embedded_cluster_and_exits_quietly(tmp_path):
    """The README's example without ``if __name__ == "__main__":``: the embedded cluster's workers do not import
    the script again, the values are the promised ones, and the only other line is the dashboard link."""
    proc = run_script(tmp_path, EXAMPLE.format(cluster=""))
    assert proc.stdout.splitlines()[:2] == EXPECTED
    assert_quiet(proc)
    link = re.findall(
        r"^dask_monarch: 2 workers on this machine; dashboard: (http://127\.0\.0\.1:\d+/monarch\?session=[g-v]{8})$",
        proc.stderr, re.MULTILINE)
    assert len(link) == 1, proc.stderr  # printed once, at attach


def test_notebook_style_exit_and_reattach_on_the_embedded_cluster_are_quiet(tmp_path):
    """A session left open at the end (no ``with``, no ``exit()``) ends at interpreter exit like ``mesh.exit()``;
    attaching again in the same process starts a new embedded cluster; neither prints an error-looking line."""
    proc = run_script(tmp_path, """
        import torch
        import dask_monarch as dm

        with dm.attach(dims={"dp": 2}) as mesh:
            with mesh.activate():
                total = (torch.ones(3) * (mesh.rank("dp") + 1)).reduce("dp")
            print(dm.inspect(total))
        mesh = dm.attach(dims={"dp": 2})             # attached again (a new embedded cluster), left open as in a notebook
        with mesh.activate():
            total = (torch.ones(3) * (mesh.rank("dp") + 1)).reduce("dp")
        print(dm.inspect(total))
    """)
    assert proc.stdout.splitlines() == ["tensor([3., 3., 3.])"] * 2
    assert_quiet(proc)


def test_embedded_mesh_has_client_and_dashboard_link_serving_the_page(tmp_path):
    """``mesh.client`` is the embedded cluster's ``Client``; ``mesh.dashboard_link`` is its session's view of the
    ``/monarch`` page (``?session=<tag>``), on Dask's default port 8787 when it is free, else on another port
    without a warning; it answers while the session runs."""
    proc = run_script(tmp_path, """
        import socket, urllib.request
        import distributed
        import dask_monarch as dm
        from dask_monarch.cluster import DASHBOARD_PORT
        from dask_monarch.controller.task_keys import session_tag

        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", DASHBOARD_PORT))
                free = True
            except OSError:
                free = False
        with dm.attach(dims={"w": 1}) as mesh:
            assert isinstance(mesh.client, distributed.Client)
            assert mesh.client.submit(sum, [1, 2]).result() == 3        # ordinary Dask work beside the mesh
            link = mesh.dashboard_link
            assert link.startswith("http://127.0.0.1:"), link
            assert link.endswith(f"/monarch?session={session_tag(mesh.session_id)}"), link
            assert link == mesh.slice(w=0).dashboard_link
            if free:
                assert link.startswith(f"http://127.0.0.1:{DASHBOARD_PORT}/monarch?session="), link
            page = urllib.request.urlopen(link, timeout=30)
            print("page", page.status, 'href="individual-monarch"' in page.read().decode())
            assert urllib.request.urlopen(link.split("?")[0], timeout=30).status == 200   # every session's view
            with dm.attach(dims={"w": 1}) as other:   # 8787 is taken now: another port, without a word
                assert other.dashboard_link.split("/monarch")[0] != link.split("/monarch")[0]
                assert other.dashboard_link.endswith(f"/monarch?session={session_tag(other.session_id)}")
                print("other page", urllib.request.urlopen(other.dashboard_link, timeout=30).status)
    """)
    assert "page 200 True" in proc.stdout.splitlines() and "other page 200" in proc.stdout.splitlines()
    assert_quiet(proc)
    assert len(re.findall(r"dashboard: http://127\.0\.0\.1:\d+/monarch\?session=[g-v]{8}$", proc.stderr,
                          re.MULTILINE)) == 2


def _alive(pids) -> list[int]:
    """Those of ``pids`` still running (a zombie waiting for its parent's wait is not)."""
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(pids, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(pids)


CHILDREN = """
import os, psutil
import dask_monarch as dm
mesh = dm.attach(dims={"dp": 2})
print("pids", os.getpid(), mesh.client.run_on_scheduler(os.getpid),
      " ".join(str(p.pid) for p in psutil.Process().children(recursive=True)), flush=True)
"""


def test_embedded_scheduler_runs_in_its_own_process_and_every_process_ends_with_the_script(tmp_path):
    """Issue 23 item 4: the embedded default's scheduler is a child process of the controller (it shares no GIL
    with the script's eager loop), and when the script ends every process the cluster started has ended too."""
    proc = run_script(tmp_path, CHILDREN + """
with mesh.activate():
    import torch
    print(dm.inspect(torch.ones(2).reduce("dp")))
mesh.exit()
""")
    me, scheduler, *children = (int(p) for p in re.search(r"^pids (.*)$", proc.stdout, re.MULTILINE)[1].split())
    assert scheduler != me and scheduler in children, proc.stdout
    assert len(children) >= 5, proc.stdout  # the scheduler, 2 nannies and their 2 workers
    assert "tensor([2., 2.])" in proc.stdout
    assert_quiet(proc)
    assert not _wait_gone(children, 10), f"still running after the script ended: {_alive(children)}"


def test_embedded_cluster_ends_when_its_controller_is_killed(tmp_path):
    """A controller killed with SIGKILL closes nothing; its scheduler notices that its parent is gone
    (``dask_monarch.scheduler.parent_watch``, every second) and closes, and the workers end with it."""
    import signal

    path = tmp_path / "script.py"
    path.write_text(CHILDREN + "import time\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        assert line.startswith("pids "), line + proc.stderr.read()
        _, scheduler, *children = (int(p) for p in line.split()[1:])
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert not _wait_gone(children, 30), f"still running 30 s after the controller was killed: {_alive(children)}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


# ----------------------------------------------------------------------------------------- an existing cluster
@pytest.fixture
def cli_scheduler(tmp_path):
    yield from _cli_cluster(tmp_path)


def ended_here(address: str, ids: list[str]) -> dict:
    """How each session of ``ids`` ended on the cluster's workers: session id -> set of failure texts (None for
    a clean end), from the worker plugins' records."""
    def closed(dask_worker):
        plugin = dask_worker.plugins.get("dask-monarch")
        return dict(plugin.closed) if plugin is not None else {}

    with Client(address, timeout=30) as client:
        deadline = time.monotonic() + 30
        while True:  # a worker records an end just after the controller's exit returned
            per_worker = client.run(closed)
            ended = {sid: {c.get(sid, "missing") for c in per_worker.values()} for sid in ids}
            if time.monotonic() > deadline or not any("missing" in v for v in ended.values()):
                return ended
            time.sleep(0.2)


def test_every_normal_exit_on_an_existing_cluster_counts_as_ended_and_is_quiet(tmp_path, cli_scheduler):
    """``with``, ``mesh.exit()`` and a session left open at the end of the program: each ends cleanly on every
    worker (``dask_monarch_sessions_ended{outcome="exited"}``, no failure), with no error-looking line."""
    address, _ = cli_scheduler
    proc = run_script(tmp_path, (EXAMPLE.format(cluster="ADDRESS, ") + """
mesh = dm.attach(ADDRESS, dims={"dp": 2})
with mesh.activate():
    y = torch.ones(2) * mesh.rank("dp")
print(dm.inspect(y.reduce("dp")))
print("session", mesh.session_id)
mesh.exit()
left_open = dm.attach(ADDRESS, dims={"dp": 2})
with left_open.activate():
    z = torch.ones(2).reduce("dp")
print(dm.inspect(z))
print("session", left_open.session_id)
""").replace("ADDRESS", repr(address)))
    assert proc.stdout.splitlines()[:2] == EXPECTED
    assert_quiet(proc)
    ids = session_ids(proc)
    assert len(ids) == 3
    assert ended_here(address, ids) == {sid: {None} for sid in ids}


def test_a_program_that_closes_its_client_under_an_open_session_exits_quietly(tmp_path, cli_scheduler):
    """The program closed its own ``Client`` with a session still open: nothing is left to end at interpreter
    exit, and nothing is printed about it."""
    address, _ = cli_scheduler
    proc = run_script(tmp_path, f"""
        import torch
        from distributed import Client
        import dask_monarch as dm

        client = Client({address!r})
        mesh = dm.attach(client, dims={{"dp": 2}})
        with mesh.activate():
            print(dm.inspect(torch.ones(2).reduce("dp")))
        client.close()
    """)
    assert proc.stdout.splitlines() == ["tensor([2., 2.])"]
    assert_quiet(proc)


def test_closing_the_embedded_meshs_own_client_under_an_open_session_is_quiet(tmp_path):
    """The same on the embedded cluster, whose workers print here: their end of the session, because its
    controller's Client disconnected, is not logged as a failure."""
    proc = run_script(tmp_path, """
        import torch
        import dask_monarch as dm

        import time

        mesh = dm.attach(dims={"dp": 2})
        with mesh.activate():
            print(dm.inspect(torch.ones(2).reduce("dp")))
        mesh.client.close()
        time.sleep(3)  # the workers end the session before the cluster closes (a known race otherwise: a worker
        # process that exits while it is closing a session may print "terminate called without an active exception")
    """)
    assert proc.stdout.splitlines() == ["tensor([2., 2.])"]
    assert_quiet(proc)


def test_embedded_worker_that_cannot_start_fails_attach_within_seconds_naming_it():
    """A worker process that exits while starting (here: a nanny preload that does not exist, passed down with
    this process's Dask config) fails ``attach`` at once, not at its ``timeout`` (600 s, beyond pytest's 300 s
    limit for a test)."""
    import dask

    import dask_monarch as dm

    with dask.config.set({"distributed.nanny.preload": ["dask_monarch_no_such_module"]}):
        with pytest.raises(RuntimeError, match=r"worker processes exited before joining \(worker 0: exit code"):
            dm.attach(dims={"w": 1}, timeout=600)
