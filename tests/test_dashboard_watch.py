"""The ``/monarch`` page for a person watching a long run (issue 18): health per session, where each rank is now and
the stacks of a stuck one, history since the session's start, remote errors, ended sessions, one session's view.

Unit tests of the data source (``dashboard/history.py``, ``health.py``, ``data.py``) and of the worker's side
(``worker/activity.py``), then one live session with a rank made slow on purpose. The page in a real browser:
tests/test_dashboard_browser.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import dask
import pytest
import torch

import dask_monarch as dm
from dask_monarch.controller.task_keys import session_tag
from dask_monarch.dashboard.data import NO_SESSION, DashboardData, select
from dask_monarch.dashboard.health import RankProgress, session_health
from dask_monarch.dashboard.history import Series
from dask_monarch.dashboard.page import MonarchPage, health_html
from dask_monarch.protocol import ArgsKwargs, CallFunction, FunctionPath, Ref, StreamRef
from dask_monarch.worker import activity
from dask_monarch.worker.metrics import summary

S1 = "0123abcd" + "0" * 24
S2 = "fedc9876" + "1" * 24
T1, T2 = session_tag(S1), session_tag(S2)


# ------------------------------------------------------------------------------------------------------ history
def test_series_stays_bounded_keeps_its_start_and_merges_by_mean_or_max():
    rate, peak = Series("mean", limit=8), Series("max", limit=8)
    for i in range(1000):
        rate.add(float(i), float(i % 2))  # 0, 1, 0, 1, ...: a mean of 0.5 once merged
        peak.add(float(i), 100.0 if i == 500 else 1.0)
    for series in (rate, peak):
        times, values = series.view()
        assert len(series) <= 8 and len(times) == len(values)
        assert times == sorted(times) and times[-1] >= 992  # the newest samples are there
        assert times[0] < 130  # and the first point still covers the start of the run
    assert set(rate.view()[1][:-1]) == {0.5}
    assert max(peak.view()[1]) == 100.0  # a peak survives the merging
    with pytest.raises(ValueError, match="combine"):
        Series("median")
    with pytest.raises(ValueError, match="limit"):
        Series("max", limit=2)


# ------------------------------------------------------------------------------------------------------- health
def rank(r, progress, *, idle=False, rate=10.0, errors=0, flagged=False):
    return {"rank": r, "rate": rate, "progress": progress, "idle": idle, "errors": errors, "flagged": flagged}


def test_health_names_the_slowest_rank_and_how_far_behind_it_is():
    fast, slow = RankProgress(), RankProgress()
    for t, p in ((100.0, 5), (101.0, 9), (102.0, 9), (104.0, 12)):
        fast.add(t, p)
    slow.add(100.0, 5)
    h = session_health(T1, S1, "running", "", [rank(0, 12, idle=True), rank(1, 5, flagged=True, errors=1)],
                       {0: fast, 1: slow}, now=110.0, age="1m 00s")
    # rank 0 got past seq 5 at t=101: rank 1 is 7 seqs and 9 s behind
    assert (h["slowest"], h["fastest"], h["behind_seqs"], h["behind_s"]) == (1, 0, 7, 9.0)
    assert h["rate"] == 20.0 and h["errors"] == 1 and h["flagged"] == [1]
    assert h["text"] == (f"{T1} running · 2 ranks · 20.0 msg/s · slowest rank 1: 7 seqs, 9.0 s behind rank 0 · "
                         "1 remote error · stuck: rank 1 · 1m 00s")


def test_health_an_idle_rank_with_nothing_queued_is_never_behind():
    """A rank outside a sub-mesh does not get that sub-mesh's seqs: idle and lower, it has still caught up."""
    progress = {0: RankProgress(), 1: RankProgress()}
    h = session_health(T1, S1, "running", "", [rank(0, 40), rank(1, 12, idle=True)], progress, 5.0, "5s")
    assert h["slowest"] is None and h["behind_seqs"] == 0 and "no rank behind" in h["text"]
    ended = session_health(T1, S1, "failed", "rank 1 (tcp://w1) left the cluster", [rank(0, 3), rank(1, 1)],
                           progress, 5.0, "ran 5s")
    assert ended["slowest"] is None
    assert ended["text"] == f"{T1} failed (rank 1 (tcp://w1) left the cluster) · 2 ranks · 0 remote errors · ran 5s"


# -------------------------------------------------------------------------------------------------- data source
def now_entry(stream, busy=False, kind="CallFunction", seq=3, name="torch.add", for_s=0.0, flagged=False):
    return {"stream": stream, "busy": busy, "kind": kind, "seq": seq, "name": name, "for_s": for_s,
            "flagged": flagged}


def snap(r, *, received=10, queued=0, nbytes=1024, now=(), stacks=None, progress=3, errors=()):
    return {
        "rank": r, "world_size": 2, "device": "cpu", "received": received, "applied": received - queued,
        "queued": queued, "inbox_batches": 0, "streams": {"0": {"applied": 1, "queued": queued, "batches": 0,
                                                               "refs": 1}},
        "refs": 1, "bytes": nbytes, "status_seq": 0, "errors": len(errors), "last_error": None, "failure": None,
        "now": list(now), "progress": progress, "stacks": stacks or {}, "recent_errors": list(errors),
    }


def session(workers, started=100.0, **extra):
    return {"client": "Client-abc", "dims": {"dp": len(workers)}, "workers": workers, "started": started, **extra}


def test_data_where_each_rank_is_now_stacks_errors_and_history():
    w = ["tcp://w0", "tcp://w1"]
    sessions = {S1: session(w, streams={"1": "side"})}
    error = {"time": 150.0, "seq": 2, "text": "ValueError: boom"}
    stack = '  File "job.py", line 3, in sleepy\n    time.sleep(60)'

    def metrics(t, received1):
        return {
            w[0]: {"time": t, "closed": {}, "sessions": {S1: snap(
                0, received=received1, progress=4, errors=[error],
                now=[now_entry("0", kind="Reduce", seq=4, name="sum over dp"), now_entry("dispatcher", seq=None,
                                                                                          kind="CreateStream",
                                                                                          name="")])}},
            w[1]: {"time": t, "closed": {}, "sessions": {S1: snap(
                1, received=received1, queued=2, nbytes=4096, progress=1, errors=[error], stacks={"0": stack},
                now=[now_entry("0", busy=True, seq=2, name="job.sleepy", for_s=75.5, flagged=True),
                     now_entry("1", kind="", seq=None, name="")])}},
        }

    data = DashboardData()
    data.update(sessions, metrics(10.0, 10), now=120.0)
    view = data.update(sessions, metrics(11.0, 30), now=121.0)
    now = view["now"]
    # the stuck thread first, then the others by rank (data.py ``_stuck_first``)
    assert now["rank"] == [1, 0, 0, 1] and now["stream"] == ["main", "main", "dispatcher", "side"]
    assert now["state"] == ["STUCK", "idle", "idle", "idle"]
    assert now["message"] == ["CallFunction seq 2: job.sleepy", "last: Reduce seq 4: sum over dp", "last: CreateStream",
                              ""]
    assert now["for_text"] == ["1m 15s", "", "", ""] and now["flagged"] == [True, False, False, False]
    assert view["stacks"] == [{"session": T1, "rank": 1, "stream": "main", "text": stack,
                               "title": f"{T1} rank 1, stream main: busy 1m 15s on CallFunction seq 2: job.sleepy"}]
    # one error per rank that reported it, in time order, kept once however many heartbeats carry it
    assert view["errors"] == {"time": [150000.0] * 2, "session": [T1] * 2, "rank": [0, 1], "seq": [2, 2],
                              "text": ["ValueError: boom"] * 2}
    health = view["health"][0]
    assert health["slowest"] == 1 and health["behind_seqs"] == 3 and health["flagged"] == [1]
    assert health["rate"] == 40.0 and health["errors"] == 2
    # history from the session's start (t=100, value 0): a point per heartbeat of rates, queued and bytes held
    assert view["rates"]["xs"] == [[100000.0, 121000.0]] * 2 and view["rates"]["ys"] == [[0.0, 20.0]] * 2
    assert view["queued"]["ys"] == [[0.0, 0.0, 0.0], [0.0, 2.0, 2.0]]
    assert view["held"]["ys"] == [[0.0, 1024.0, 1024.0], [0.0, 4096.0, 4096.0]]
    assert view["held"]["label"] == [f"{T1} rank 0", f"{T1} rank 1"]


def test_data_keeps_ended_sessions_and_selects_one_session():
    w = ["tcp://w0"]
    data = DashboardData()
    metrics = {w[0]: {"time": 1.0, "closed": {}, "sessions": {S2: snap(0)}}}
    data.update({S1: session(w), S2: session(w, started=110.0)},
                {w[0]: {"time": 1.0, "closed": {}, "sessions": {S1: snap(0), S2: snap(0)}}}, now=120.0)
    ended = {**session(w), "ended": 118.0, "reason": None}
    view = data.update({S1: ended, S2: session(w, started=110.0)}, metrics, now=121.0)
    assert [h["state"] for h in view["health"]] == ["ended", "running"]
    assert view["health"][0]["age"] == "ran 18s" and view["ranks"]["state"] == ["exited", "running"]
    assert view["summary"] == "1 session, 1 rank (1 ended lately, below)"
    assert len(view["rates"]["xs"]) == 2  # the ended session's history stays while the scheduler lists it
    failed = data.update({S1: {**ended, "reason": "stream 0: boom"}}, {}, now=122.0)
    assert failed["health"][0]["state"] == "failed" and failed["running"] is False and failed["shown"] is True
    assert failed["summary"].startswith(NO_SESSION)
    one = select(view, T2)
    assert [h["session"] for h in one["health"]] == [T2] and one["ranks"]["session"] == [T2]
    assert one["rates"]["label"] == [f"{T2} rank 0"] and one["shown"] is True
    assert select(view, "gggggggg")["shown"] is False
    assert data.update({}, {}, now=130.0)["shown"] is False and data.current_rate == {}


def test_data_a_rank_still_busy_after_exit_is_finishing_not_exited():
    """``mesh.exit()`` came (issue 25 item 2): rank 0 ended the session there, rank 1 still runs what was sent
    before (its snapshot says ``exiting``): rank 1 is "finishing", and so is the session, until it ends."""
    w = ["tcp://w0", "tcp://w1"]
    busy = now_entry("0", busy=True, seq=2, name="job.sleepy", for_s=12.0)
    metrics = {w[0]: {"time": 1.0, "closed": {S1: None}, "sessions": {}},
               w[1]: {"time": 1.0, "closed": {}, "sessions": {S1: {**snap(1, now=[busy], progress=1),
                                                                   "exiting": True}}}}
    view = DashboardData().update({S1: session(w)}, metrics, now=121.0)
    assert view["ranks"]["state"] == ["exited", "finishing"]
    assert view["health"][0]["state"] == "finishing" and view["sessions"]["state"] == ["finishing"]
    assert view["health"][0]["text"].startswith(f"{T1} finishing · 2 ranks · ")
    metrics[w[1]]["sessions"][S1]["exiting"] = False  # a rank that was not told to exit is running
    assert DashboardData().update({S1: session(w)}, metrics, now=121.0)["ranks"]["state"] == ["exited", "running"]


def test_page_health_links_and_one_session_view():
    h = session_health(T1, S1, "running", "", [rank(0, 1)], {0: RankProgress()}, 1.0, "1s")
    everything = health_html([h])
    for url in ("individual-task-stream", "workers", "profile", f"monarch?session={T1}"):
        assert f'href="{url}"' in everything
    assert f"monarch?session={T1}" not in health_html([h], T1) and 'href="monarch"' in health_html([h], T1)
    assert "no session &lt;b&gt; on this cluster" in health_html([], "<b>")  # escaped, never markup
    from types import SimpleNamespace

    page = MonarchPage(SimpleNamespace(plugins={}, workers={}), DashboardData(), session=T1)
    page.update()
    assert page.tables.visible is False and page.summary.text.startswith(f"Session {T1}.")
    hostile = MonarchPage(SimpleNamespace(plugins={}, workers={}), DashboardData(),
                          session="<img src=x onerror=alert(1)>")  # ?session= comes from any link
    hostile.update()
    assert "<img" not in hostile.summary.text and "&lt;img src=x" in hostile.summary.text


def test_summary_of_a_bare_traceback_is_its_exception():
    assert summary("Traceback (most recent call last):\n  File 'x', line 1\nValueError: boom") == "ValueError: boom"


# ---------------------------------------------------------------------------------------------- worker activity
class _Thread:
    """A stand-in for a stream or the dispatcher: what ``activity`` reads of them."""

    def __init__(self, current=None, busy=False, thread=None):
        self.current, self.busy, self.applied, self.received = current, busy, 0, 0
        self.thread = thread or threading.current_thread()


def test_activity_durations_flags_and_stacks_only_while_flagged(monkeypatch):
    release = threading.Event()

    def sleepy_worker_function():
        release.wait(30)

    thread = threading.Thread(target=sleepy_worker_function, daemon=True)
    thread.start()
    try:
        msg = CallFunction(7, [Ref(1)], [], FunctionPath("torch.ops.aten.add.Tensor"), ArgsKwargs((), {}),
                           StreamRef(0), [])
        stream = _Thread(msg, busy=True, thread=thread)
        tw = _Thread(thread=threading.current_thread())
        tw.streams, tw.stuck_after, tw.completed_seq = {0: stream}, 5.0, 0
        clock = [1000.0]
        monkeypatch.setattr(activity.time, "monotonic", lambda: clock[0])
        first = activity.observe(tw)
        assert first[0] == {"stream": "0", "busy": True, "kind": "CallFunction", "seq": 7,
                            "name": "torch.ops.aten.add.Tensor", "for_s": 0.0, "flagged": False}
        assert first[1]["stream"] == "dispatcher" and first[1]["busy"] is False
        assert activity.progress(tw, first) == 6 and activity.stacks(tw, first) == {}  # no stack unless flagged
        clock[0] += 4.0
        assert activity.observe(tw)[0]["for_s"] == 4.0
        clock[0] += 2.0
        late = activity.observe(tw)
        assert late[0]["for_s"] == 6.0 and late[0]["flagged"] is True
        stacks = activity.stacks(tw, late)
        assert list(stacks) == ["0"] and "sleepy_worker_function" in stacks["0"] and "release.wait" in stacks["0"]
        assert len(stacks["0"]) <= activity.STACK_CHARS and stacks["0"].count("File ") <= activity.STACK_FRAMES
        stream.applied += 1  # the next message (the same object would be a new one once the count moved)
        assert activity.observe(tw)[0]["for_s"] == 0.0
        stream.busy = False
        idle = activity.observe(tw)
        assert idle[0]["busy"] is False and idle[0]["seq"] == 7 and activity.progress(tw, idle) == 7
    finally:
        release.set()
        thread.join(10)


# ----------------------------------------------------------------------------------------- on a live cluster
def hold_rank_one(mesh, release: str, bound: float = 60.0):
    """Rank 1 sleeps until the file ``release`` exists (at most ``bound`` s); the other ranks return at once."""
    if mesh.dims["dp"].rank == 1:
        deadline = time.monotonic() + bound
        while not Path(release).exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def wait_until(condition, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_bad_stuck_after_config_names_the_key(client2):
    with dask.config.set({"monarch.dashboard.stuck-after": "soon"}):
        with pytest.raises(ValueError, match="monarch.dashboard.stuck-after"):
            dm.attach(client2, dims={"dp": 2})


def test_live_slow_rank_is_flagged_with_its_stack_and_the_session_ends_in_the_table(client2, tmp_path):
    from dask_monarch.dashboard.install import read_scheduler

    release = tmp_path / "release"
    with dask.config.set({"monarch.dashboard.stuck-after": 1.0}):
        mesh = dm.attach(client2, dims={"dp": 2}, comm_timeout=60)
    sid = mesh.session_id
    tag = session_tag(sid)

    def view(dask_scheduler):
        plugin = dask_scheduler.plugins["dask-monarch"]
        return select(plugin.dashboard.update(*read_scheduler(dask_scheduler), time.time()), tag)

    try:
        with mesh.activate():
            x = torch.ones(4)
            dm.remote(hold_rank_one, propagate="inspect")(mesh, str(release))
            y = x + 1
        mesh._session.flush()

        def stuck():
            v = client2.run_on_scheduler(view)
            return v if v["stacks"] and v["health"][0]["flagged"] == [1] else None

        v = wait_until(stuck, "rank 1 flagged, with its stacks")
        assert [s["rank"] for s in v["stacks"]] == [1]
        assert "hold_rank_one" in v["stacks"][0]["text"] and "time.sleep" in v["stacks"][0]["text"]
        row = v["now"]["state"].index("STUCK")
        assert v["now"]["rank"][row] == 1 and "hold_rank_one" in v["now"]["message"][row]
        assert v["health"][0]["slowest"] == 1 and v["health"][0]["behind_seqs"] >= 1
        assert "STUCK" not in [s for r, s in zip(v["now"]["rank"], v["now"]["state"]) if r == 0]
        release.touch()
        assert dm.inspect(y).tolist() == [2.0] * 4
        cleared = wait_until(lambda: (v := client2.run_on_scheduler(view)) and not v["stacks"] and v,
                             "the stacks gone once rank 1 moved on")
        assert cleared["health"][0]["flagged"] == []
    finally:
        release.touch()
        mesh.exit()
    ended = wait_until(lambda: (v := client2.run_on_scheduler(view))["health"] and
                       v["ranks"]["state"] == ["exited", "exited"] and v, "the session's ranks shown as exited")
    assert ended["health"][0]["state"] == "ended" and ended["health"][0]["age"].startswith("ran ")


def test_64_ranks_on_8_hosts_a_row_per_host_and_stuck_failed_lagging_ranks_first():
    """Issue 23 item 8: at 64 ranks the page lists the ranks that need a look first (stuck, then failed, then most
    behind) and sums each host up in a row; its tables scroll past ``MAX_ROWS`` and its plots drop the legend."""
    from types import SimpleNamespace

    from dask_monarch.dashboard.page import MAX_ROWS

    workers = [f"tcp://10.231.0.{10 + h}:{4000 + g}" for h in range(8) for g in range(8)]
    sessions = {S1: {**session(workers), "dims": {"host": 8, "gpu": 8}}}

    def metrics(t):
        out = {}
        for r, w in enumerate(workers):
            if r == 50:
                continue  # its worker left the cluster
            now = [now_entry("0", busy=True, for_s=90.0, flagged=True)] if r == 37 else []
            out[w] = {"time": t, "closed": {}, "sessions": {S1: snap(
                r, received=100, queued=5 if r == 12 else 0, progress=2 if r == 12 else 10, now=now)}}
        return out

    data = DashboardData()
    data.update(sessions, metrics(10.0), now=120.0)
    view = data.update(sessions, metrics(11.0), now=121.0)
    ranks = view["ranks"]
    assert ranks["rank"][:4] == [37, 50, 12, 0] and ranks["rank"][4:] == [r for r in range(1, 64) if r not in (12, 37, 50)]
    assert ranks["state"][:3] == ["running", "worker gone", "running"] and ranks["behind"][:4] == [0, 0, 8, 0]
    hosts = view["hosts"]
    assert hosts["host"] == [f"10.231.0.{10 + h}" for h in (4, 6, 1, 0, 2, 3, 5, 7)]
    assert hosts["ranks"] == [8] * 8 and sum(hosts["running"]) == 63
    assert hosts["stuck"] == [1, 0, 0, 0, 0, 0, 0, 0] and hosts["failed"] == [0, 1, 0, 0, 0, 0, 0, 0]
    assert hosts["state"][:3] == ["stuck", "failed", "running"]
    assert hosts["behind"][:3] == [0, 0, 8] and hosts["slowest"][:3] == [None, None, 12]
    assert hosts["bytes_text"][0] == "8.0 KiB tensors"  # 8 ranks of 1 KiB
    assert view["now"]["rank"][0] == 37 and view["now"]["state"][0] == "STUCK"

    scheduler = SimpleNamespace(plugins={"dask-monarch": SimpleNamespace(sessions=sessions)},
                                workers={a: SimpleNamespace(metrics={"monarch": m}) for a, m in metrics(12.0).items()})
    page = MonarchPage(scheduler, data=data)
    page.update()
    assert list(page.host_source.data["host"])[0] == "10.231.0.14" and len(page.host_source.data["host"]) == 8
    assert page.ranks.height == page.hosts.height + (MAX_ROWS - 8) * 28  # 20 rows shown, then it scrolls
    assert page.rates.legend.visible is False  # 64 lines
