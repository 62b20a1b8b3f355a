"""The ``/monarch`` Bokeh page, refreshed every half second from ``DashboardData`` (spec/dask-notes.md §2 "Writing
a component"; issue 18). From the top:

* one health line per session (``health.py``), with links to Dask's own Task Stream, Workers and Profile pages
  and to the session's own view (``/monarch?session=<tag>``, ``mesh.dashboard_link``);
* the program's progress (``progress.py``): compiled calls per second per compiled function, and the values it
  reports (``dask_monarch.report``), as a line of text per session and two plots;
* where each rank is now: per rank and stream (and dispatcher), the message it applies and for how long, STUCK
  past the session's ``monarch.dashboard.stuck-after``; below it the Python stacks of the stuck ranks' busy
  threads, as the workers sampled them;
* history since each session's start: messages per second (over ``history.RATE_WINDOW`` seconds), queued
  messages and memory held (CUDA memory on a GPU worker, the refs' tensor bytes on a CPU one), one line per rank;
* the hosts table (a row per host of each session: its ranks, how many are stuck or failed, the most seqs one is
  behind: ``hosts.py``), the sessions and ranks tables (stuck ranks first, then failed, then most behind), and
  the sessions' remote errors (time, session, rank, seq, first line). A table shows ``MAX_ROWS`` rows and
  scrolls; a plot of more than ``MAX_LEGEND`` lines shows no legend.

The page only reads: it has no buttons and serves no control endpoint (the dashboard has no authentication).
"""

from __future__ import annotations

import html
import logging
import re
import time

from bokeh.layouts import column
from bokeh.models import (ColumnDataSource, CustomJS, DataTable, DateFormatter, Div, NumberFormatter,
                          NumeralTickFormatter, TableColumn)
from bokeh.plotting import figure

from .data import (ERROR_COLUMNS, NO_SESSION, NOW_COLUMNS, RANK_COLUMNS, RATE_COLUMNS, SESSION_COLUMNS,
                   DashboardData, memory_title, select)
from .history import RATE_WINDOW
from .hosts import HOST_COLUMNS
from .install import read_scheduler

__all__ = ["MonarchPage", "monarch_doc", "UPDATE_MS", "DASK_LINKS"]
logger = logging.getLogger("dask_monarch.dashboard")

UPDATE_MS = 500
_ROW = 28
# room for the horizontal scrollbar a narrow window shows: columns keep their widths (autosize_mode="none"), so
# that no header is cut ("inbox batc"), and scroll instead
_SCROLLBAR = 18
#: rows a table shows before it scrolls (the rows that need a look come first: ``hosts.order``)
MAX_ROWS = 20
#: lines a plot names in its legend; past that (many ranks) the legend would cover the plot, and a line's name shows
#: in the ranks table instead
MAX_LEGEND = 16
#: Dask's own pages linked from each session's health line (relative to the page, so a dashboard prefix works)
DASK_LINKS = (("Task Stream", "individual-task-stream"), ("Workers", "workers"), ("Profile", "profile"))
_COLORS = {"running": "#2ca02c", "finishing": "#ff7f0e", "failed": "#d62728", "ended": "#7f7f7f"}
#: reported names with a plot of their own (the later ones share the last plot, ``OTHER_REPORTS``)
REPORT_PLOTS = 6
OTHER_REPORTS = "other values"
NO_PROGRESS = ("<i>No compiled calls or reported values yet: a function compiled with <code>dask_monarch.compile"
               "</code> shows its calls per second here, and <code>dask_monarch.report(loss=...)</code> a line of "
               "each value.</i>")
_TAG = re.compile(r"[g-v]{8}")


def _shared_data(scheduler) -> DashboardData:
    """The data the scheduler plugin samples from its start (``install.start_sampling``), else a new one."""
    from ..scheduler.plugin import PLUGIN_NAME

    data = getattr(scheduler.plugins.get(PLUGIN_NAME), "dashboard", None)
    return data if isinstance(data, DashboardData) else DashboardData()


def _table(source, name: str, columns: list) -> DataTable:
    table = DataTable(source=source, name=name, sizing_mode="stretch_width", height=2 * _ROW, index_position=None,
                      autosize_mode="none", columns=columns)
    # BokehJS redraws a table when its rows' indices change, not when only their values do (bokeh 3.9): redraw it
    # on every new data
    source.js_on_change("data", CustomJS(args={"view": table.view}, code="view.change.emit()"))
    return table


def _lines(title: str, axis: str, name: str, source, x_range=None):
    plot = figure(title=title, x_axis_type="datetime", height=220, sizing_mode="stretch_width", name=name,
                  tools="", toolbar_location=None, **({"x_range": x_range} if x_range is not None else {}))
    plot.multi_line(xs="xs", ys="ys", line_color="color", legend_field="label", line_width=2, source=source)
    plot.legend.location = "top_left"
    plot.yaxis.axis_label = axis
    return plot


def health_html(health: list, session: str | None = None) -> str:
    """The health lines as HTML: a colored state, the line's text, and its links."""
    if not health:
        return f"<i>no session {html.escape(session)} on this cluster</i>" if session else ""
    lines = []
    for h in health:
        links = " ".join(f'<a href="{url}" target="_blank">{name}</a>' for name, url in DASK_LINKS)
        if session is None:
            links += f' <a href="monarch?session={h["session"]}">this session only</a>'
        color = _COLORS.get(h["state"], "#7f7f7f")
        lines.append(f'<div class="monarch-health-line" style="margin:2px 0"><span style="color:{color}">&#9679;'
                     f"</span> {html.escape(h['text'])} &nbsp; {links}</div>")
    if session is not None:
        lines.append('<div><a href="monarch">all sessions</a></div>')
    return "".join(lines)


def summary_html(view: dict, session: str | None) -> str:
    """The summary line as HTML; ``session`` (the page's ``?session=``, any text a link may carry) is escaped."""
    if session is None:
        return html.escape(view["summary"])
    return f"Session {html.escape(session)}. {html.escape(view['summary'])}"


def progress_html(rows: list) -> str:
    """The progress rows (``progress.Progress.view``) as HTML, one line per session."""
    if not rows:
        return NO_PROGRESS
    return "".join(f'<div class="monarch-progress-line">{html.escape(r["text"])}</div>' for r in rows)


def stacks_html(stacks: list) -> str:
    if not stacks:
        return ("<i>No rank is stuck (busy on one message for longer than the session's "
                "<code>monarch.dashboard.stuck-after</code>).</i>")
    return "".join(f"<div><b>{html.escape(s['title'])}</b><pre style='margin:2px 0 8px 0;font-size:11px'>"
                   f"{html.escape(s['text'])}</pre></div>" for s in stacks)


class MonarchPage:
    """The page's Bokeh models (``root``) and ``update()``, reading ``scheduler`` (the Dask scheduler); ``data``
    defaults to the scheduler plugin's, shared by every page (its history goes back to each session's start);
    ``session`` (a session tag, from ``?session=``) shows that session only."""

    def __init__(self, scheduler, data: DashboardData | None = None, session: str | None = None):
        self.scheduler = scheduler
        self.data = data or _shared_data(scheduler)
        self.session = session
        self.title = Div(text="<h2>dask_monarch</h2>", name="monarch-title")
        self.summary = Div(text=NO_SESSION, name="monarch-summary", sizing_mode="stretch_width")
        self.health = Div(text="", name="monarch-health", sizing_mode="stretch_width")
        self.session_source = ColumnDataSource({c: [] for c in SESSION_COLUMNS}, name="monarch-sessions-source")
        self.rank_source = ColumnDataSource({c: [] for c in RANK_COLUMNS}, name="monarch-ranks-source")
        self.host_source = ColumnDataSource({c: [] for c in HOST_COLUMNS}, name="monarch-hosts-source")
        self.now_source = ColumnDataSource({c: [] for c in NOW_COLUMNS}, name="monarch-now-source")
        self.error_source = ColumnDataSource({c: [] for c in ERROR_COLUMNS}, name="monarch-errors-source")
        self.line_sources = {key: ColumnDataSource({c: [] for c in RATE_COLUMNS}, name=f"monarch-{key}-source")
                             for key in ("rates", "queued", "held", "calls")}
        self.rate_source = self.line_sources["rates"]
        count = NumberFormatter(format="0,0")
        self.sessions = _table(self.session_source, "monarch-sessions", [
            TableColumn(field="session", title="session", width=90),
            TableColumn(field="id", title="id", width=250),
            TableColumn(field="controller", title="controller (client)", width=330),
            TableColumn(field="mesh", title="mesh", width=140),
            TableColumn(field="shape", title="shape", width=70),
            TableColumn(field="ranks", title="ranks", width=50),
            TableColumn(field="age", title="age", width=70),
            TableColumn(field="state", title="state", width=140),
        ])
        self.ranks = _table(self.rank_source, "monarch-ranks", [
            TableColumn(field="session", title="session", width=80),
            TableColumn(field="rank", title="rank", width=40),
            TableColumn(field="coords", title="coords", width=100),
            TableColumn(field="worker", title="worker", width=170),
            TableColumn(field="device", title="device", width=60),
            TableColumn(field="received", title="received", formatter=count, width=80),
            TableColumn(field="applied", title="applied", formatter=count, width=80),
            TableColumn(field="queued", title="queued", formatter=count, width=60),
            TableColumn(field="inbox", title="inbox batches", width=110),
            TableColumn(field="streams", title="stream backlog", width=140),
            TableColumn(field="refs", title="live refs", formatter=count, width=72),
            TableColumn(field="bytes_text", title="memory held", width=110),
            TableColumn(field="rate", title="msgs/s", formatter=NumberFormatter(format="0,0.0"), width=70),
            TableColumn(field="behind", title="behind (seqs)", formatter=count, width=100),
            TableColumn(field="state", title="state", width=70),
            TableColumn(field="last_error", title="last error", width=300),
        ])
        self.hosts = _table(self.host_source, "monarch-hosts", [
            TableColumn(field="session", title="session", width=80),
            TableColumn(field="host", title="host", width=150),
            TableColumn(field="ranks", title="ranks", width=50),
            TableColumn(field="running", title="running", width=60),
            TableColumn(field="stuck", title="stuck", width=50),
            TableColumn(field="failed", title="failed", width=50),
            TableColumn(field="rate", title="msgs/s", formatter=NumberFormatter(format="0,0.0"), width=80),
            TableColumn(field="queued", title="queued", formatter=count, width=70),
            TableColumn(field="bytes_text", title="memory held", width=110),
            TableColumn(field="behind", title="most behind (seqs)", formatter=count, width=130),
            TableColumn(field="slowest", title="slowest rank", width=90),
            TableColumn(field="errors", title="remote errors", width=100),
            TableColumn(field="state", title="state", width=70),
        ])
        self.now = _table(self.now_source, "monarch-now", [
            TableColumn(field="session", title="session", width=80),
            TableColumn(field="rank", title="rank", width=40),
            TableColumn(field="stream", title="stream", width=80),
            TableColumn(field="state", title="state", width=60),
            TableColumn(field="message", title="applying (kind, seq: function)", width=520),
            TableColumn(field="for_text", title="for", width=70),
        ])
        self.errors = _table(self.error_source, "monarch-errors", [
            TableColumn(field="time", title="time", formatter=DateFormatter(format="%Y-%m-%d %H:%M:%S"), width=140),
            TableColumn(field="session", title="session", width=80),
            TableColumn(field="rank", title="rank", width=40),
            TableColumn(field="seq", title="seq", width=60),
            TableColumn(field="text", title="error (first line … last line)", width=700),
        ])
        self.stacks = Div(text=stacks_html([]), name="monarch-stacks", sizing_mode="stretch_width")
        self.rates = _lines(f"messages received per second (over {RATE_WINDOW:g} s), per rank, since the session's "
                            "start", "messages / s", "monarch-rates", self.line_sources["rates"])
        self.queued = _lines("messages queued on the streams, per rank", "messages", "monarch-queued",
                             self.line_sources["queued"], self.rates.x_range)
        self.held = _lines(memory_title(()), "bytes", "monarch-held", self.line_sources["held"], self.rates.x_range)
        self.held.yaxis.formatter = NumeralTickFormatter(format="0.0 b")
        self.progress = Div(text=NO_PROGRESS, name="monarch-progress", sizing_mode="stretch_width")
        self.calls = _lines(f"compiled calls per second (over {RATE_WINDOW:g} s; calls finished on every rank), per "
                            "compiled function", "calls / s", "monarch-calls", self.line_sources["calls"],
                            self.rates.x_range)
        # one plot per reported name (a loss and a step count on one axis would flatten the loss), made as they come
        self.reports = column(name="monarch-reports", sizing_mode="stretch_width")
        self.report_plots: dict = {}  # name (or OTHER_REPORTS) -> (figure, its source)
        self.tables = column(
            Div(text="<b>Hosts</b> (the host with a stuck, failed or lagging rank first)"), self.hosts,
            Div(text="<b>Progress</b>"), self.progress, self.calls, self.reports,
            Div(text="<b>Where each rank is now</b>"), self.now,
            Div(text="<b>Stacks of stuck ranks</b> (sampled on the worker while a rank is stuck)"), self.stacks,
            Div(text="<b>History</b>"), self.rates, self.queued, self.held,
            Div(text="<b>Sessions</b>"), self.sessions, Div(text="<b>Ranks</b>"), self.ranks,
            Div(text="<b>Remote errors</b>"), self.errors,
            sizing_mode="stretch_width", visible=False, name="monarch-tables",
        )
        self.root = column(self.title, self.summary, self.health, self.tables, sizing_mode="stretch_width",
                           name="monarch-root")

    def update(self) -> None:
        try:
            view = self.data.update(*read_scheduler(self.scheduler), time.time())
        except Exception:
            logger.exception("dask_monarch dashboard: could not read the sessions")
            return
        self.show(view)

    def show(self, view: dict) -> None:
        """Put a ``DashboardData.update`` result on the page (only what changed is sent to the browser)."""
        view = select(view, self.session)
        summary = summary_html(view, self.session)
        for div, text in ((self.summary, summary), (self.health, health_html(view["health"], self.session)),
                          (self.progress, progress_html(view["progress"])),
                          (self.stacks, stacks_html(view["stacks"]))):
            if div.text != text:
                div.text = text
        if self.tables.visible != view["shown"]:
            self.tables.visible = view["shown"]
        for source, table, columns in ((self.session_source, self.sessions, view["sessions"]),
                                       (self.rank_source, self.ranks, view["ranks"]),
                                       (self.host_source, self.hosts, view["hosts"]),
                                       (self.now_source, self.now, view["now"]),
                                       (self.error_source, self.errors, view["errors"])):
            if dict(source.data) != columns:
                source.data = columns
            rows = min(MAX_ROWS, max(1, len(next(iter(columns.values()), []))))
            height = _ROW * (1 + rows) + _SCROLLBAR
            if table.height != height:
                table.height = height
        for key, source in self.line_sources.items():
            if dict(source.data) != view[key]:
                source.data = view[key]
        for plot, key in ((self.rates, "rates"), (self.queued, "queued"), (self.held, "held"),
                          (self.calls, "calls")):
            legend = len(view[key]["xs"]) <= MAX_LEGEND
            if plot.legend.visible != legend:
                plot.legend.visible = legend
        self._show_reports(view["reports"])
        title = memory_title(view["ranks"]["device"])  # what the memory line measures on the ranks shown
        if self.held.title.text != title:
            self.held.title.text = title


    def _show_reports(self, lines: dict) -> None:
        """A plot per reported name (its lines: one per session), the first ``REPORT_PLOTS - 1`` names that came
        each on its own, any later ones together on the last."""
        groups: dict = {}
        for i, name in enumerate(lines["name"]):
            key = name if name in groups or len(groups) < REPORT_PLOTS - 1 else OTHER_REPORTS
            groups.setdefault(key, []).append(i)
        plots = []
        for key, rows in groups.items():
            entry = self.report_plots.get(key)
            if entry is None:
                source = ColumnDataSource({c: [] for c in RATE_COLUMNS}, name=f"monarch-report-{key}-source")
                title = (f"{key}, as the program reports it (dask_monarch.report)" if key != OTHER_REPORTS else
                         "other values the program reports (dask_monarch.report)")
                plot = _lines(title, key if key != OTHER_REPORTS else "value", f"monarch-report-{key}", source,
                              self.rates.x_range)
                plot.height = 160
                entry = self.report_plots[key] = (plot, source)
            data = {c: [lines[c][i] for i in rows] for c in RATE_COLUMNS}
            if dict(entry[1].data) != data:
                entry[1].data = data
            plots.append(entry[0])
        if list(self.reports.children) != plots:
            self.reports.children = plots


def session_argument(doc) -> str | None:
    """The page's ``?session=<tag>`` (a session tag: 8 letters g-v), None without one; another value is shown as
    a session that does not exist."""
    try:
        values = doc.session_context.request.arguments.get("session") or []
    except AttributeError:
        return None
    if not values:
        return None
    value = values[0].decode("utf-8", "replace") if isinstance(values[0], bytes) else str(values[0])
    value = value.strip()
    return value if _TAG.fullmatch(value) else value[:40]


def monarch_doc(scheduler, extra: dict, doc) -> None:
    """Bokeh document function (``distributed.dashboard.core.BokehApplication`` passes ``scheduler`` and the
    dashboard's template variables ``extra``): the page inside the dashboard's own template and theme;
    ``?session=<tag>`` shows one session."""
    page = MonarchPage(scheduler, session=session_argument(doc))
    page.update()
    doc.add_periodic_callback(page.update, UPDATE_MS)
    doc.add_root(page.root)
    doc.title = "Dask: Monarch"
    try:  # the dashboard's navigation bar and theme (internals of distributed; the page works without them)
        from distributed.dashboard.components.scheduler import BOKEH_THEME, env

        doc.template = env.get_template("simple.html")
        doc.template_variables.update(extra)
        doc.theme = BOKEH_THEME
    except Exception:
        logger.debug("dask_monarch dashboard: Dask's page template is not available", exc_info=True)
