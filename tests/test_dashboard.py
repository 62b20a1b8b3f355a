"""Dashboard monitoring: the ``/monarch`` page's data source and Bokeh models, the task keys the Task Stream and
Progress panels group by, the workers' heartbeat metrics and Prometheus metrics, and the page on a live scheduler.
(The page in a real browser: tests/test_dashboard_browser.py.)
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import distributed
import pytest
import torch
from distributed.utils import key_split

import dask_monarch as dm
from dask_monarch.cluster import cluster_workers
from dask_monarch import RemoteException
from dask_monarch.controller.task_keys import KINDS, parse_task_key, session_tag, task_key
from dask_monarch.dashboard.data import NO_SESSION, RANK_COLUMNS, DashboardData, format_bytes, mesh_coords
from dask_monarch.dashboard.page import MonarchPage
from dask_monarch.worker.metrics import summary

S1 = "0123abcd" + "0" * 24
S2 = "fedc9876" + "1" * 24


def snap(rank, received=10, applied=8, queued=2, *, world=4, error=None, failure=None, device="cpu", nbytes=2048):
    return {
        "rank": rank, "world_size": world, "device": device, "received": received, "applied": applied,
        "queued": queued, "inbox_batches": 1, "streams": {"0": {"applied": applied, "queued": queued, "batches": 1,
                                                                "refs": 3}, "1": {"applied": 0, "queued": 0,
                                                                                  "batches": 0, "refs": 0}},
        "refs": 3, "bytes": nbytes, "status_seq": 5, "errors": 1 if error else 0, "last_error": error,
        "failure": failure,
    }


def session(dims, workers, started=1000.0, client="Client-abc"):
    return {"client": client, "dims": dims, "workers": workers, "started": started}


# ------------------------------------------------------------------------------------------------- task keys
def test_task_keys_group_per_session_and_kind_under_key_split():
    prefixes = {(kind, s): key_split(task_key(kind, s, rank, batch))
                for kind in KINDS for s in (S1, S2) for rank in (0, 3) for batch in (0, 17)}
    # every rank and batch of one (kind, session) falls in one group, named after both
    assert len(set(prefixes.values())) == len(KINDS) * 2
    for (kind, s), prefix in prefixes.items():
        assert prefix == f"monarch-{session_tag(s)}-{kind}"
    assert session_tag(S1).isalpha() and session_tag(S2).isalpha()
    assert parse_task_key(task_key("fetch", S2, 3, 17)) == ("fetch", session_tag(S2), 3, 17)
    assert parse_task_key("monarch-batch-0123abcd-0-1") is None
    with pytest.raises(ValueError, match="task kind"):
        task_key("sync", S1, 0, 0)


# ------------------------------------------------------------------------------------------------ data source
def test_data_without_session_says_so():
    view = DashboardData().update({}, {"tcp://w0": {"time": 1.0, "sessions": {}, "closed": {}}}, now=10.0)
    assert view["running"] is False
    assert view["summary"] == NO_SESSION
    assert all(len(v) == 0 for v in view["ranks"].values())
    assert all(len(v) == 0 for v in view["sessions"].values())


def test_data_rows_per_session_and_rank():
    workers = [f"tcp://w{i}" for i in range(4)]
    error = {"seq": 7, "text": "ValueError: boom"}
    metrics = {w: {"time": 5.0, "sessions": {S1: snap(r, error=error if r == 2 else None)}, "closed": {}}
               for r, w in enumerate(workers)}
    view = DashboardData().update({S1: session({"host": 2, "gpu": 2}, workers)}, metrics, now=1065.0)
    assert view["running"] is True
    assert view["summary"] == "1 session, 4 ranks"
    s = view["sessions"]
    assert s["session"] == [session_tag(S1)] and s["id"] == [S1] and s["controller"] == ["Client-abc"]
    assert s["mesh"] == ["host=2 × gpu=2"] and s["shape"] == ["(2, 2)"] and s["ranks"] == [4]
    assert s["age"] == ["1m 05s"] and s["state"] == ["running"]
    r = view["ranks"]
    assert set(r) == set(RANK_COLUMNS)
    assert r["rank"] == [0, 1, 2, 3]
    assert r["worker"] == workers
    assert r["coords"] == ["host=0, gpu=0", "host=0, gpu=1", "host=1, gpu=0", "host=1, gpu=1"]
    assert r["device"] == ["cpu"] * 4
    assert r["received"] == [10] * 4 and r["applied"] == [8] * 4 and r["queued"] == [2] * 4
    assert r["inbox"] == [1] * 4 and r["refs"] == [3] * 4 and r["bytes"] == [2048] * 4
    assert r["streams"] == ["main: 2, s1: 0"] * 4  # stream 0 is main; an unnamed stream by its id
    assert r["bytes_text"] == ["2.0 KiB tensors"] * 4  # what a CPU worker counts: its refs' tensor bytes
    assert r["last_error"] == ["", "", "seq 7: ValueError: boom", ""]
    assert r["state"] == ["running"] * 4


def test_data_rate_per_rank_from_successive_heartbeats():
    data = DashboardData()
    workers = ["tcp://w0", "tcp://w1"]
    sessions = {S1: session({"dp": 2}, workers)}

    def metrics(t, received):
        return {w: {"time": t, "sessions": {S1: snap(r, received=received * (r + 1), world=2)}, "closed": {}}
                for r, w in enumerate(workers)}

    first = data.update(sessions, metrics(100.0, 50), now=1.0)
    assert first["ranks"]["rate"] == [0.0, 0.0]
    assert first["rates"]["ys"] == [[], []]  # one heartbeat: no rate yet
    second = data.update(sessions, metrics(100.5, 150), now=1.5)  # +100 and +200 messages in 0.5 s
    assert second["ranks"]["rate"] == [200.0, 400.0]
    assert second["rates"]["ys"] == [[200.0], [400.0]]
    assert second["rates"]["label"] == [f"{session_tag(S1)} rank 0", f"{session_tag(S1)} rank 1"]
    assert second["rates"]["xs"] == [[1500.0], [1500.0]]
    repeated = data.update(sessions, metrics(100.5, 150), now=2.0)  # the same heartbeat again: no new point
    assert repeated["rates"]["ys"] == [[200.0], [400.0]]
    assert repeated["ranks"]["rate"] == [200.0, 400.0]
    gone = data.update({}, {}, now=3.0)  # the session ended: its history goes
    assert gone["rates"]["ys"] == [] and data.current_rate == {}


def test_data_names_streams_and_starts_rate_lines_at_the_session_start():
    """Streams by the names the controller gave them (``Stream("side")``); each rank's rate line begins at its
    session's start (rate 0), not at the first heartbeat this data source saw."""
    data = DashboardData()
    info = {**session({"dp": 1}, ["tcp://w0"], started=0.25), "streams": {"1": "side"}}

    def metrics(t, received):
        return {"tcp://w0": {"time": t, "sessions": {S1: snap(0, received=received, world=1)}, "closed": {}}}

    data.update({S1: info}, metrics(100.0, 10), now=1.0)
    view = data.update({S1: info}, metrics(100.5, 60), now=1.5)
    assert view["ranks"]["streams"] == ["main: 2, side: 0"]
    assert view["rates"]["xs"] == [[250.0, 1500.0]] and view["rates"]["ys"] == [[0.0, 100.0]]


def test_data_failed_rank_gone_worker_and_second_session():
    w = ["tcp://w0", "tcp://w1", "tcp://w2"]
    metrics = {
        w[0]: {"time": 1.0, "sessions": {S2: snap(0, world=1)}, "closed": {S1: "stream 0: KeyError: 'x'"}},
        w[1]: {"time": 1.0, "sessions": {S1: snap(1, world=2, failure="malformed message: bad")}, "closed": {}},
    }
    sessions = {S1: session({"dp": 3}, w, started=10.0), S2: session({"workers": 1}, [w[0]], started=20.0)}
    view = DashboardData().update(sessions, metrics, now=30.0)
    r = view["ranks"]
    assert r["session"] == [session_tag(S1)] * 3 + [session_tag(S2)]
    assert r["state"] == ["failed", "failed", "worker gone", "running"]
    assert r["last_error"][:3] == ["session failed: stream 0: KeyError: 'x'", "session failed: malformed message: bad",
                                   "the worker tcp://w2 left the cluster"]
    assert view["sessions"]["state"] == ["failed on rank 0, 1, 2", "running"]
    assert view["summary"] == "2 sessions, 4 ranks, 1 failed"


def test_data_clean_end_stays_ended_when_its_workers_leave_the_cluster_after():
    """The embedded cluster closes after ``mesh.exit()``: its workers leave once the session has ended cleanly.
    Seen in a browser (issue 25's screenshots): the ended session read "failed on rank 0, 1", its ranks "worker
    gone". It stays ``ended``, its ranks ``exited``, and the memory plot keeps naming what it measured."""
    w = ["tcp://w0", "tcp://w1"]
    data = DashboardData()
    info = session({"dp": 2}, w, started=10.0)
    live = {a: {"time": 1.0, "sessions": {S1: snap(r, world=2)}, "closed": {}} for r, a in enumerate(w)}
    assert data.update({S1: info}, live, now=20.0)["ranks"]["state"] == ["running", "running"]
    clean = {**info, "ended": 30.0, "reason": None}
    view = data.update({S1: clean}, {}, now=31.0)  # both workers have left the cluster
    assert view["ranks"]["state"] == ["exited", "exited"]
    assert view["ranks"]["device"] == ["cpu", "cpu"]  # the last heartbeat's: the memory title still says tensors
    assert view["sessions"]["state"] == ["ended"] and view["health"][0]["state"] == "ended"
    # a session that failed, then lost its workers, still reads failed and names the gone worker
    failed = {**info, "ended": 30.0, "reason": "rank 1 failed"}
    view = data.update({S1: failed}, {}, now=32.0)
    assert view["ranks"]["state"] == ["worker gone", "worker gone"]
    assert view["sessions"]["state"][0].startswith("failed")


def test_formatting_helpers():
    assert mesh_coords({"a": 2, "b": 3}, 5) == "a=1, b=2"
    assert format_bytes(512) == "512 B" and format_bytes(3 * 1024**3) == "3.0 GiB"
    assert summary("CallFunction seq 3: failed\nTraceback (most recent call last):\n  x\nValueError: boom") == \
        "CallFunction seq 3: failed … ValueError: boom"
    assert summary(None) is None and len(summary("x" * 1000)) == 300


# ------------------------------------------------------------------------------------------------ Bokeh models
def fake_scheduler(sessions: dict, metrics: dict):
    plugin = SimpleNamespace(sessions=sessions)
    workers = {a: SimpleNamespace(metrics={"monarch": m}) for a, m in metrics.items()}
    return SimpleNamespace(plugins={"dask-monarch": plugin}, workers=workers)


def test_page_models_show_no_session_then_rows():
    scheduler = fake_scheduler({}, {})
    page = MonarchPage(scheduler)
    page.update()
    assert page.summary.text == NO_SESSION and page.tables.visible is False
    scheduler.plugins["dask-monarch"].sessions[S1] = session({"dp": 2}, ["tcp://w0", "tcp://w1"], started=time.time())
    scheduler.workers["tcp://w0"] = SimpleNamespace(metrics={"monarch": {"time": 1.0, "sessions": {S1: snap(0)},
                                                                         "closed": {}}})
    page.update()
    assert page.tables.visible is True
    assert page.summary.text == "1 session, 2 ranks, 1 failed"  # rank 1's worker is not in the cluster
    # a failed rank is listed before the running ones (dashboard/hosts.py ``order``)
    assert list(page.rank_source.data["worker"]) == ["tcp://w1", "tcp://w0"]
    assert list(page.rank_source.data["state"]) == ["worker gone", "running"]
    assert list(page.session_source.data["id"]) == [S1]
    assert page.ranks.height > page.sessions.height  # tables grow with their rows


def test_hosts_table_shows_no_rank_behind_as_an_empty_cell():
    """The hosts table's ``slowest rank`` is None when no rank is behind; Bokeh's default cell showed "(null)"."""
    page = MonarchPage(fake_scheduler({}, {}))
    column = next(c for c in page.hosts.columns if c.field == "slowest")
    assert column.formatter.null_format == ""


def test_page_columns_keep_widths_that_fit_their_titles():
    """No header is cut ("inbox batc"): the tables keep their columns' widths (a narrow window scrolls instead of
    squeezing them), and each is wider than its title at the dashboard's font (under 7 px a character, measured
    in Chromium; tests/test_dashboard_browser.py measures the rendered page)."""
    page = MonarchPage(fake_scheduler({}, {}))
    for table in (page.sessions, page.ranks):
        assert table.autosize_mode == "none"
        for col in table.columns:
            assert col.width >= 7 * len(col.title) + 8, (col.title, col.width)


def test_install_page_without_a_dashboard_does_nothing():
    from dask_monarch.dashboard import install_page

    assert install_page(SimpleNamespace(http_application=SimpleNamespace(applications=[]))) is False
    assert install_page(SimpleNamespace()) is False


# ----------------------------------------------------------------------------------------- on a live cluster
def add_one(x):
    return x + 1


def fail(x):
    raise ValueError("boom from the dashboard test")


def fail_shape(x):
    return torch.empty_like(x)


def wait_until(condition, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_live_session_metrics_prometheus_task_keys_and_page(client2):
    mesh = dm.attach(client2, dims={"dp": 2}, comm_timeout=60)
    sid, tag = mesh.session_id, session_tag(mesh.session_id)
    with mesh.activate():
        x = dm.remote(torch.ones)(256)
    for _ in range(50):
        x = dm.remote(add_one)(x)
    bad = dm.remote(fail, propagate=fail_shape)(x)
    mesh._session.flush()  # a batch without a wait: a monarch-<session>-messages task
    assert dm.inspect(x).tolist() == [51.0] * 256
    with pytest.raises(RemoteException, match="boom from the dashboard test"):
        dm.inspect(bad)

    # a wait's Dask futures (one per rank), for Dask's own progress and wait tools
    answer = dm.fetch_shard(x, dp=1)
    distributed.wait(answer.futures, timeout=30)
    assert sorted(parse_task_key(f.key)[::2] for f in answer.futures) == [("fetch", 0), ("fetch", 1)]
    assert answer.result().tolist() == [51.0] * 256

    # heartbeat metrics, as the scheduler (and so the page) sees them
    def heartbeat():
        seen = client2.run_on_scheduler(
            lambda dask_scheduler: {a: (ws.metrics.get("monarch") or {}).get("sessions", {}).get(sid)
                                    for a, ws in dask_scheduler.workers.items()})
        ranks = {s["rank"]: s for s in seen.values() if s and s["received"] >= 53 and s["errors"] == 1}
        return ranks if len(ranks) == 2 else None

    ranks = wait_until(heartbeat, "both ranks' metrics in a heartbeat after the work")
    for rank, s in ranks.items():
        assert s["device"] == "cpu" and s["world_size"] == 2
        assert s["applied"] >= 53 and s["queued"] == 0
        assert s["refs"] >= 2 and s["bytes"] >= 256 * 4  # x (and the failed result's error entry)
        assert s["last_error"]["seq"] > 0 and "boom from the dashboard test" in s["last_error"]["text"]

    # Prometheus, on each worker's /metrics
    for address, info in cluster_workers(client2).items():
        port = info["services"]["dashboard"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        rank = 0 if mesh.workers[0] == address else 1
        labels = f'{{rank="{rank}",session="{sid}"}}'
        assert "# TYPE dask_monarch_messages_received_total counter" in text
        line = next(l for l in text.splitlines() if l.startswith(f"dask_monarch_messages_received_total{labels}"))
        assert float(line.split()[-1]) >= 53
        assert f"dask_monarch_remote_errors_total{labels} 1.0" in text
        assert f'dask_monarch_stream_messages_queued{{rank="{rank}",session="{sid}",stream="0"}}' in text
        assert "dask_monarch_memory_bytes{" in text and "dask_monarch_refs{" in text

    # the page and its entry in the dashboard's "More..." menu
    port = client2.scheduler_info()["services"]["dashboard"]
    for path in ("/monarch", "/individual-monarch", "/status"):
        html = urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10).read().decode()
        assert 'href="individual-monarch"' in html, path
    mesh.exit()

    # the session's tasks, grouped by kind per session (Task Stream colors and Progress bars by these prefixes)
    prefixes = set(client2.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.task_prefixes)))
    mine = {p for p in prefixes if tag in p}
    assert mine == {f"monarch-{tag}-messages", f"monarch-{tag}-fetch", f"monarch-{tag}-exit"}, prefixes


# ------------------------------------------------------------------------------- the page from the scheduler's start
def start_scheduler(tmp_path, *args: str, env: dict | None = None):
    """``dask scheduler`` with ``args``; returns the process and its dashboard port (from its scheduler file)."""
    import json
    import os
    import subprocess
    import sys

    scheduler_file = tmp_path / "scheduler.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dask", "scheduler", "--port", "0", "--dashboard-address", "127.0.0.1:0",
         "--scheduler-file", str(scheduler_file), *args],
        env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    info = wait_until(lambda: scheduler_file.exists() and json.loads(scheduler_file.read_text() or "{}"),
                      "the scheduler file", timeout=60)
    return proc, info["address"], info["services"]["dashboard"]


@pytest.mark.parametrize("how", ["--preload", "config"])
def test_page_exists_from_the_scheduler_start_with_the_preload(tmp_path, how):
    """``dask scheduler --preload dask_monarch`` (or ``distributed.scheduler.preload`` in Dask config): ``/monarch``
    answers before any controller attached, saying that no session runs; a controller attaching later shares
    the same scheduler plugin. Without it the page appears at the first attach (404 before)."""
    from bokeh.client import pull_session

    args, env = (["--preload", "dask_monarch"], {}) if how == "--preload" else \
        ([], {"DASK_DISTRIBUTED__SCHEDULER__PRELOAD": '["dask_monarch"]'})
    proc, address, port = start_scheduler(tmp_path, *args, env=env)
    try:
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/monarch", timeout=30)
        assert page.status == 200 and 'href="individual-monarch"' in page.read().decode()
        with pull_session(url=f"http://127.0.0.1:{port}/monarch") as browser:
            summary = browser.document.select_one({"name": "monarch-summary"})
            assert summary.text == NO_SESSION
        with distributed.Client(address, timeout=30) as client:
            plugins = client.run_on_scheduler(lambda dask_scheduler: [
                type(p).__name__ for p in dask_scheduler.plugins.values() if "Monarch" in type(p).__name__])
            assert plugins == ["MonarchSchedulerPlugin"]
            from dask_monarch.scheduler import MonarchSchedulerPlugin

            client.register_plugin(MonarchSchedulerPlugin())  # what attach does: keeps the running one
            assert client.run_on_scheduler(lambda dask_scheduler: len(
                [p for p in dask_scheduler.plugins.values() if "Monarch" in type(p).__name__])) == 1
            assert client.sync(client.scheduler.monarch_sessions) == {}
    finally:
        proc.terminate()
        proc.wait(30)


def test_page_without_the_preload_answers_404_until_a_controller_attaches(tmp_path):
    proc, address, port = start_scheduler(tmp_path)
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/monarch", timeout=30)
        assert info.value.code == 404
    finally:
        proc.terminate()
        proc.wait(30)


def test_live_stream_names_and_rates_sampled_from_the_session_start_without_a_page(client2):
    """The scheduler samples the page's data from the plugin's start, page or no page: the rate line of a session
    goes back to its start; a stream shows by its name (``side``), the default stream as ``main``."""
    from dask_monarch.dashboard.install import read_scheduler

    mesh = dm.attach(client2, dims={"dp": 2}, comm_timeout=60)
    sid = mesh.session_id
    side = dm.Stream("side")
    with mesh.activate():
        x = torch.ones(4)
        xs, borrow = side.borrow(x)
        with side.activate():
            y = xs * 2
        borrow.drop()
        for _ in range(30):
            x = x + 1
    assert dm.inspect(y).tolist() == [2.0] * 4 and dm.inspect(x).tolist() == [31.0] * 4

    def page_view(dask_scheduler):
        plugin = dask_scheduler.plugins["dask-monarch"]
        view = plugin.dashboard.update(*read_scheduler(dask_scheduler), time.time())
        ranks = [i for i, tag in enumerate(view["ranks"]["session"]) if tag == session_tag(sid)]
        lines = [i for i, label in enumerate(view["rates"]["label"]) if label.startswith(session_tag(sid))]
        return {"streams": [view["ranks"]["streams"][i] for i in ranks],
                "xs": [view["rates"]["xs"][i] for i in lines], "started": plugin.sessions[sid]["started"]}

    def sampled():
        v = client2.run_on_scheduler(page_view)
        return v if v["streams"] == ["main: 0, side: 0"] * 2 and all(len(xs) >= 3 for xs in v["xs"]) else None

    try:
        view = wait_until(sampled, "both ranks' stream names and rate points, with no page open")
        assert all(xs[0] == view["started"] * 1000.0 for xs in view["xs"]), view
    finally:
        mesh.exit()


def test_one_session_tag_in_repr_link_logs_task_keys_threads_and_page(client2, caplog):
    """One name per session (issue 25 item 5): the mesh's repr, the dashboard link's ``?session=``, the controller's
    log lines and errors, the tasks' keys (``monarch-<session>-<kind>-...``), the session's threads on both sides
    and the page's rows all show the same 8 letters, the first of the session id."""
    import logging
    import threading

    from dask_monarch.dashboard.install import read_scheduler
    from dask_monarch.protocol import ArgsKwargs, CallFunction, FunctionPath
    from dask_monarch.controller.session import DEFAULT_STREAM

    mesh = dm.attach(client2, dims={"dp": 2}, comm_timeout=60)
    sid = mesh.session_id
    tag = sid[:8]
    try:
        assert len(sid) == 32 and set(sid) <= set("ghijklmnopqrstuv") and session_tag(sid) == tag
        assert repr(mesh).endswith(f"session={tag})") and mesh.dashboard_link.endswith(f"/monarch?session={tag}")
        answer = dm.fetch_shard(mesh.rank("dp"), dp=1)
        assert answer.result().item() == 1
        assert {f.key.rsplit("-", 2)[0] for f in answer.futures} == {f"monarch-{tag}-fetch"}
        mine = sorted(t.name for t in threading.enumerate() if tag in t.name)
        # the controller's answer sockets: one link per host (the host's relay on its first rank: answer-tree)
        assert {"flush", "answers", "socket-r0"} <= {n.split("-", 2)[2] for n in mine}, mine
        assert all(n.startswith(f"monarch-{tag}-") for n in mine), mine
        on_workers = client2.run(lambda: sorted(t.name for t in threading.enumerate() if t.name.startswith("monarch-")))
        assert {f"monarch-{tag}-dispatch", f"monarch-{tag}-stream0"} <= set(on_workers[mesh.workers[1]]), on_workers

        def page_rows(dask_scheduler):
            view = dask_scheduler.plugins["dask-monarch"].dashboard.update(*read_scheduler(dask_scheduler), time.time())
            return [t for t, i in zip(view["sessions"]["session"], view["sessions"]["id"]) if i == sid]

        assert client2.run_on_scheduler(page_rows) == [tag]
        caplog.set_level(logging.ERROR, logger="dask_monarch.controller")
        session = mesh._session
        session.send(CallFunction(session.new_seq(), [None], [], FunctionPath("__test_panic"), ArgsKwargs(),
                                  DEFAULT_STREAM, []))
        with pytest.raises(dm.SessionError, match=rf"^session {tag}\w* failed on rank"):
            dm.fetch_shard(mesh.rank("dp")).result(timeout=60)
        logged = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "dask_monarch.controller"]
        assert any(level == logging.ERROR and m.startswith(f"session {tag}") for level, m in logged), logged
        assert all(f"session {tag}" in m for _, m in logged), logged
    finally:
        mesh.exit()


def test_live_progress_row_counts_compiled_calls_and_shows_reported_values(client2):
    """A compiled step called 40 times and ``dm.report`` of a number and of a remote loss (fetched without waiting):
    the scheduler's page data shows the step's calls (finished on both ranks) and the reported values' last values
    (issue 25 item 6)."""
    import math

    from dask_monarch.dashboard.install import read_scheduler

    mesh = dm.attach(client2, dims={"dp": 2}, comm_timeout=60)
    sid, tag = mesh.session_id, session_tag(mesh.session_id)
    try:
        with mesh.activate():
            w = torch.ones(4)

            @dm.compile
            def train_step(x):
                return (x * w).sum()

            x = torch.arange(4.0) + mesh.rank("dp")
            for step in range(40):
                loss = train_step(x)
                dm.report(step=step, loss=loss)
        assert dm.inspect(loss).item() == 6.0
        with pytest.raises(TypeError, match="dask_monarch.report: note must be a number"):
            dm.report(mesh, note="text")
        with pytest.raises(ValueError, match="dask_monarch.report: lr is nan"):
            dm.report(mesh, lr=math.nan)
        with pytest.raises(TypeError, match=r"remote tensor of shape \(4,\)"):
            dm.report(mesh, x=x)

        def progress(dask_scheduler):
            view = dask_scheduler.plugins["dask-monarch"].dashboard.update(*read_scheduler(dask_scheduler),
                                                                          time.time())
            return {"rows": [r["text"] for r in view["progress"] if r["session"] == tag],
                    "calls": [l for l, s in zip(view["calls"]["label"], view["calls"]["session"]) if s == tag],
                    "reports": [l for l, s in zip(view["reports"]["label"], view["reports"]["session"]) if s == tag]}

        def shown():
            p = client2.run_on_scheduler(progress)
            done = p["rows"] and "(40 calls)" in p["rows"][0] and "step 39" in p["rows"][0] and "loss 6" in p["rows"][0]
            return p if done else None

        seen = wait_until(shown, "the step's 40 calls and the last reported values on the page's progress row")
        assert seen["calls"] == [f"{tag} test_live_progress_row_counts_compiled_calls_and_shows_reported_values."
                                 "<locals>.train_step"], seen
        assert sorted(seen["reports"]) == [f"{tag} loss = 6", f"{tag} step = 39"], seen
    finally:
        mesh.exit()
