"""The ``/monarch`` page's data for a person watching a run (issue 25 item 6): rates smoothed over a window and the
health line from the same figure, memory labelled by what it measures, the progress row (compiled calls per second
per compiled function, values reported with ``dask_monarch.report``), and no traceback when a browser tab closes.
Unit tests of the data source and the page's models (no cluster); the live ones are in tests/test_dashboard.py."""

from __future__ import annotations

import logging
from collections import deque
from types import SimpleNamespace

import pytest

from dask_monarch.controller.task_keys import session_tag
from dask_monarch.dashboard import quiet_logs
from dask_monarch.dashboard.data import DashboardData, memory_text, memory_title, select
from dask_monarch.dashboard.history import RATE_WINDOW, WindowRate
from dask_monarch.dashboard.page import NO_PROGRESS, MonarchPage

S1 = "ghijklmn" + "g" * 24
S2 = "vutsrqpo" + "h" * 24
T1, T2 = session_tag(S1), session_tag(S2)
W = ["tcp://w0", "tcp://w1"]


def snap(rank, received, *, device="cpu", nbytes=4096, recordings=None):
    return {"rank": rank, "world_size": 2, "device": device, "received": received, "applied": received, "queued": 0,
            "inbox_batches": 0, "streams": {"0": {"applied": received, "queued": 0, "batches": 0, "refs": 1}},
            "refs": 1, "bytes": nbytes, "status_seq": 0, "errors": 0, "last_error": None, "failure": None,
            "now": [], "progress": 1, "stacks": {}, "recent_errors": [], "recordings": recordings or {}}


def session(**extra):
    return {"client": "Client-abc", "dims": {"dp": 2}, "workers": W, "started": 100.0, **extra}


def metrics(t, received, sid=S1, **kwargs):
    return {w: {"time": t, "closed": {}, "sessions": {sid: snap(r, received[r], **kwargs)}} for r, w in enumerate(W)}


# --------------------------------------------------------------------------------------------------- rates
def test_window_rate_is_the_growth_over_the_window():
    rate = WindowRate(window=2.0)
    assert rate.add(0.0, 0) == 0.0  # one sample: no rate yet
    assert rate.add(0.5, 100) == 200.0
    for i in range(2, 20):  # 100 messages every other 0.5 s: 100 per second on average
        value = rate.add(i * 0.5, 100 * (1 + i // 2))
        if i >= 8:  # once the window holds only the steady pattern
            assert 75.0 <= value <= 125.0, (i, value)
    assert rate.add(10.5, 0) == 0.0  # a counter that went back (a restart) is no growth


def test_rates_are_smoothed_and_the_health_line_shows_the_same_figure():
    """Batches come in bursts: a heartbeat's counter grows by 600, the next by 0, ... (the rate from two successive
    heartbeats jumped between 0 and 1,200 per second, issue 25). Over the window the page shows about 600 per second
    on each rank, steadily, in the table, in the lines and on the health line (their sum)."""
    data = DashboardData()
    received = 0
    for i in range(40):
        received += 600 if i % 2 else 0
        view = data.update({S1: session()}, metrics(1000.0 + 0.5 * i, [received, received]), now=200.0 + 0.5 * i)
        if 0.5 * i > RATE_WINDOW + 0.5:
            rates = view["ranks"]["rate"]
            assert all(540.0 <= r <= 660.0 for r in rates), (i, rates)
            health = view["health"][0]
            assert health["rate"] == round(sum(rates), 1), (health["rate"], rates)
            assert f"{health['rate']:,.1f} msg/s" in health["text"]
            assert [ys[-1] for ys in view["rates"]["ys"]] == rates
    assert min(min(ys[12:]) for ys in view["rates"]["ys"]) >= 540.0  # the lines never drop to 0 mid-run


# -------------------------------------------------------------------------------------------------- memory
def test_memory_is_labelled_by_what_it_measures():
    assert memory_text(2048, "cpu") == "2.0 KiB tensors" and memory_text(3 * 1024**3, "cuda:0") == "3.0 GiB CUDA"
    assert "tensor bytes" in memory_title(["cpu", "cpu"]) and "CUDA" not in memory_title(["cpu"])
    assert memory_title(["cuda:0", "cuda:0"]).startswith("CUDA memory allocated")
    assert "CUDA memory allocated on GPU workers, tensor bytes" in memory_title(["cuda:0", "cpu"])
    page = MonarchPage(SimpleNamespace(plugins={}, workers={}), DashboardData())
    view = page.data.update({S1: session()}, metrics(1.0, [5, 5], device="cuda:0"), now=101.0)
    page.show(view)
    assert page.held.title.text == memory_title(["cuda:0"]) and view["ranks"]["bytes_text"] == ["4.0 KiB CUDA"] * 2
    page.show(page.data.update({S1: session()}, metrics(2.0, [6, 6]), now=102.0))
    assert page.held.title.text == memory_title(["cpu"])


# ------------------------------------------------------------------------------------------------ progress
def test_compiled_calls_per_second_per_function_count_calls_finished_on_every_rank():
    """Two compiled functions, ``train_step`` (two recordings: its first and its verifying second) and ``evaluate``;
    rank 1 lags: the calls per second are those every rank has finished, over the window."""
    data = DashboardData()
    info = session(recordings={"7": "train_step", "9": "train_step", "12": "evaluate"})
    for i in range(30):
        steps = 10 * i  # 20 per second on rank 0, rank 1 one heartbeat behind
        per_rank = [{"7": 1, "9": steps + 10, "12": i // 10}, {"7": 1, "9": max(0, steps), "12": i // 10}]
        m = {w: {"time": 50.0 + 0.5 * i, "closed": {}, "sessions": {S1: snap(r, i, recordings=per_rank[r])}}
             for r, w in enumerate(W)}
        view = data.update({S1: info}, m, now=300.0 + 0.5 * i)
    calls = view["calls"]
    assert calls["label"] == [f"{T1} train_step", f"{T1} evaluate"] and calls["session"] == [T1, T1]
    assert calls["ys"][0][-1] == pytest.approx(20.0)  # 1 + 10 i calls on every rank, 2 heartbeats a second
    assert calls["ys"][1][-1] == pytest.approx(0.2, abs=0.11)
    assert len(calls["xs"][0]) == 30 and calls["xs"][0][-1] == (300.0 + 0.5 * 29) * 1000.0
    again = data.update({S1: info}, m, now=316.0)  # the same heartbeats again: no new point
    assert len(again["calls"]["xs"][0]) == 30
    assert view["progress"] == [{"session": T1, "text": f"{T1}: train_step 20.0 calls/s (291 calls) · evaluate 0.2 "
                                                        "calls/s (2 calls)"}]


def test_reported_values_are_lines_with_their_last_value_and_a_progress_row():
    data = DashboardData()
    reports = {"loss": deque([(310.0, 2.5), (310.5, 1.25)]), "step": deque([(310.5, 40.0)])}
    info = session(reports=reports)
    view = data.update({S1: info, S2: session()}, {**metrics(1.0, [1, 1])}, now=311.0)
    r = view["reports"]
    assert r["label"] == [f"{T1} loss = 1.25", f"{T1} step = 40"] and r["ys"] == [[2.5, 1.25], [40.0]]
    assert r["xs"] == [[310000.0, 310500.0], [310500.0]]
    reports["loss"].append((311.5, 0.625))  # the scheduler plugin keeps the newest points until they are taken
    view = data.update({S1: info, S2: session()}, {**metrics(2.0, [2, 2])}, now=312.0)
    assert view["reports"]["ys"][0] == [2.5, 1.25, 0.625]
    assert view["progress"] == [{"session": T1, "text": f"{T1}: loss 0.625 · step 40"}]
    assert select(view, T2)["reports"]["label"] == [] and select(view, T2)["progress"] == []
    assert select(view, T1)["progress"] == view["progress"]
    page = MonarchPage(SimpleNamespace(plugins={}, workers={}), DashboardData())
    page.show(view)
    assert "loss 0.625 · step 40" in page.progress.text
    # a plot per name: a step count beside a loss would flatten the loss on one axis
    assert [p.title.text.split(",")[0] for p in page.reports.children] == ["loss", "step"]
    assert page.report_plots["loss"][1].data["ys"] == [[2.5, 1.25, 0.625]]
    page.show(data.update({}, {}, now=313.0))  # the session went: its lines, plots and row go too
    assert page.progress.text == NO_PROGRESS and list(page.reports.children) == []


# -------------------------------------------------------------------------------------- a tab that closes
def _closed_websocket_error() -> BaseException:
    """The AssertionError Tornado raises when a tab closed before its websocket opened (real Tornado code)."""
    from tornado.websocket import WebSocketHandler

    try:
        WebSocketHandler.selected_subprotocol.fget(SimpleNamespace(ws_connection=None))
    except AssertionError as e:
        return e
    raise RuntimeError("tornado no longer asserts here: find what it raises now")


def test_a_closed_websocket_logs_at_debug_and_other_errors_as_they_were():
    quiet_logs.install()
    logger = logging.getLogger("tornado.application")
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append((record.levelname, record.getMessage(), record.exc_info[0] if record.exc_info else None))

    handler = Keep()
    logger.addHandler(handler)
    level = logger.level
    try:
        logger.setLevel(logging.ERROR)  # as Dask's logging config sets it
        closed = _closed_websocket_error()
        logger.error("Uncaught exception GET /monarch/ws", exc_info=(type(closed), closed, closed.__traceback__))
        assert seen == []  # not shown at Dask's level
        try:
            raise AssertionError("an assertion of our own")
        except AssertionError:
            logger.error("a real error", exc_info=True)
        assert seen == [("ERROR", "a real error", AssertionError)]
        logger.setLevel(logging.DEBUG)  # shown, at DEBUG, to whoever asks for DEBUG
        logger.error("Uncaught exception GET /monarch/ws", exc_info=(type(closed), closed, closed.__traceback__))
        assert seen[-1] == ("DEBUG", "Uncaught exception GET /monarch/ws", AssertionError)
    finally:
        logger.setLevel(level)
        logger.removeHandler(handler)
    bokeh = logging.getLogger("bokeh.server.views.ws")
    record = bokeh.makeRecord(bokeh.name, logging.WARNING, __file__, 1,
                              "Failed sending message as connection was closed", (), None)
    assert bokeh.filter(record) is bokeh.isEnabledFor(logging.DEBUG) and record.levelno == logging.DEBUG


def test_a_dispatcher_waiting_in_exit_for_its_streams_is_not_flagged(monkeypatch):
    """After ``mesh.exit()`` the dispatcher waits in ``Exit`` for a busy stream (issue 25 item 2): the stream is
    flagged when it is stuck; the dispatcher, which only waits for it, is busy on ``Exit`` but never STUCK."""
    import threading

    from dask_monarch.protocol import Exit
    from dask_monarch.worker import activity

    class Owner:  # what activity reads of a stream or a tensor worker (it keeps weak references to them)
        def __init__(self, **attributes):
            self.__dict__.update(attributes, thread=threading.current_thread())

    stream = Owner(current=None, busy=False, applied=3)
    tw = Owner(streams={0: stream}, stuck_after=5.0, completed_seq=0, current=Exit(None), busy=True, received=10,
               exiting=True)
    clock = [1000.0]
    monkeypatch.setattr(activity.time, "monotonic", lambda: clock[0])
    activity.observe(tw)
    clock[0] += 60.0
    dispatcher = activity.observe(tw)[1]
    assert (dispatcher["kind"], dispatcher["busy"], dispatcher["for_s"], dispatcher["flagged"]) == ("Exit", True,
                                                                                                  60.0, False)
    tw.exiting = False  # a dispatcher busy that long on anything else is flagged
    assert activity.observe(tw)[1]["flagged"] is True


def test_many_reported_names_share_the_last_plot():
    from dask_monarch.dashboard.page import OTHER_REPORTS, REPORT_PLOTS

    names = [f"v{i}" for i in range(REPORT_PLOTS + 2)]
    info = session(reports={n: deque([(310.0, float(i))]) for i, n in enumerate(names)})
    page = MonarchPage(SimpleNamespace(plugins={}, workers={}), DashboardData())
    page.show(page.data.update({S1: info}, metrics(1.0, [1, 1]), now=311.0))
    assert list(page.report_plots) == [*names[:REPORT_PLOTS - 1], OTHER_REPORTS]
    assert page.report_plots[OTHER_REPORTS][1].data["label"] == [f"{T1} {n} = {i}" for i, n in
                                                                  enumerate(names) if i >= REPORT_PLOTS - 1]


def test_an_operation_of_a_replay_shows_as_its_call_with_the_calls_seq():
    """A stream replaying a compiled call runs the recording's operations, whose seqs are those they were recorded
    with (33, say) long before: the page shows the ``CallRecording`` and its seq (7120), and the rank's progress,
    which the health line compares, is taken from that seq, not from 33 (a rank was "7087 seqs behind")."""
    import threading

    import torch

    from dask_monarch.protocol import Factory, Reduce, Reduction, Ref, StreamRef
    from dask_monarch.worker import activity

    class Owner:
        def __init__(self, **attributes):
            self.__dict__.update(attributes, thread=threading.current_thread())

    recorded = Reduce(Ref(3), Ref(2), Factory((4,), torch.float32), Ref(1), StreamRef(0), ["dp"], Reduction.Avg,
                      False, False, None, 33)
    call = SimpleNamespace(seq=7120, recording=SimpleNamespace(ref_id=5))
    stream = Owner(current=recorded, busy=True, applied=3, replay=call)
    tw = Owner(streams={0: stream}, stuck_after=5.0, completed_seq=7000, current=None, busy=False, received=10)
    entry = activity.observe(tw)[0]
    assert (entry["kind"], entry["seq"], entry["name"]) == ("CallRecording", 7120, "recording r5 at Reduce avg over dp")
    assert activity.progress(tw, activity.observe(tw)) == 7119
