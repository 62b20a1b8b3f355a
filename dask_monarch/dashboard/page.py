"""The ``/monarch`` Bokeh page: sessions, one row per rank, and messages per second per rank, refreshed every
half second from ``DashboardData`` (spec/dask-notes.md §2 "Writing a component").

The page only reads: it has no buttons and serves no control endpoint (the dashboard has no authentication).
"""

from __future__ import annotations

import logging
import time

from bokeh.layouts import column
from bokeh.models import ColumnDataSource, CustomJS, DataTable, Div, NumberFormatter, TableColumn
from bokeh.plotting import figure

from .data import NO_SESSION, RANK_COLUMNS, RATE_COLUMNS, SESSION_COLUMNS, DashboardData
from .install import read_scheduler

__all__ = ["MonarchPage", "monarch_doc", "UPDATE_MS"]

logger = logging.getLogger("dask_monarch.dashboard")

UPDATE_MS = 500
_ROW = 28
# room for the horizontal scrollbar a narrow window shows: columns keep their widths (autosize_mode="none"), so
# that no header is cut ("inbox batc"), and scroll instead
_SCROLLBAR = 18


def _shared_data(scheduler) -> DashboardData:
    """The data the scheduler plugin samples from its start (``install.start_sampling``), else a new one."""
    from ..scheduler.plugin import PLUGIN_NAME

    data = getattr(scheduler.plugins.get(PLUGIN_NAME), "dashboard", None)
    return data if isinstance(data, DashboardData) else DashboardData()


class MonarchPage:
    """The page's Bokeh models (``root``) and ``update()``, reading ``scheduler`` (the Dask scheduler); ``data``
    defaults to the scheduler plugin's, shared by every page (its rate lines go back to each session's start)."""

    def __init__(self, scheduler, data: DashboardData | None = None):
        self.scheduler = scheduler
        self.data = data or _shared_data(scheduler)
        self.title = Div(text="<h2>dask_monarch</h2>", name="monarch-title")
        self.summary = Div(text=NO_SESSION, name="monarch-summary", sizing_mode="stretch_width")
        self.session_source = ColumnDataSource({c: [] for c in SESSION_COLUMNS}, name="monarch-sessions-source")
        self.rank_source = ColumnDataSource({c: [] for c in RANK_COLUMNS}, name="monarch-ranks-source")
        self.rate_source = ColumnDataSource({c: [] for c in RATE_COLUMNS}, name="monarch-rates-source")
        count = NumberFormatter(format="0,0")
        self.sessions = DataTable(
            source=self.session_source, name="monarch-sessions", sizing_mode="stretch_width", height=2 * _ROW,
            index_position=None, autosize_mode="none",
            columns=[
                TableColumn(field="session", title="session", width=90),
                TableColumn(field="id", title="id", width=250),
                TableColumn(field="controller", title="controller (client)", width=330),
                TableColumn(field="mesh", title="mesh", width=140),
                TableColumn(field="shape", title="shape", width=70),
                TableColumn(field="ranks", title="ranks", width=50),
                TableColumn(field="age", title="age", width=70),
                TableColumn(field="state", title="state", width=140),
            ],
        )
        self.ranks = DataTable(
            source=self.rank_source, name="monarch-ranks", sizing_mode="stretch_width", height=2 * _ROW,
            index_position=None, autosize_mode="none",
            columns=[
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
                TableColumn(field="bytes_text", title="bytes held", width=80),
                TableColumn(field="rate", title="msgs/s", formatter=NumberFormatter(format="0,0.0"), width=70),
                TableColumn(field="state", title="state", width=70),
                TableColumn(field="last_error", title="last error", width=300),
            ],
        )
        for table in (self.sessions, self.ranks):
            # BokehJS redraws a table when its rows' indices change, not when only their values do (bokeh 3.9):
            # redraw it on every new data
            table.source.js_on_change("data", CustomJS(args={"view": table.view}, code="view.change.emit()"))
        self.rates = figure(
            title="messages received per second, per rank", x_axis_type="datetime", height=260,
            sizing_mode="stretch_width", name="monarch-rates", tools="", toolbar_location=None,
        )
        self.rates.multi_line(xs="xs", ys="ys", line_color="color", legend_field="label", line_width=2,
                              source=self.rate_source)
        self.rates.legend.location = "top_left"
        self.rates.yaxis.axis_label = "messages / s"
        self.tables = column(
            Div(text="<b>Sessions</b>"), self.sessions, Div(text="<b>Ranks</b>"), self.ranks, self.rates,
            sizing_mode="stretch_width", visible=False, name="monarch-tables",
        )
        self.root = column(self.title, self.summary, self.tables, sizing_mode="stretch_width", name="monarch-root")

    def update(self) -> None:
        try:
            view = self.data.update(*read_scheduler(self.scheduler), time.time())
        except Exception:
            logger.exception("dask_monarch dashboard: could not read the sessions")
            return
        self.show(view)

    def show(self, view: dict) -> None:
        """Put a ``DashboardData.update`` result on the page (only what changed is sent to the browser)."""
        if self.summary.text != view["summary"]:
            self.summary.text = view["summary"]
        if self.tables.visible != view["running"]:
            self.tables.visible = view["running"]
        for source, table, columns in ((self.session_source, self.sessions, view["sessions"]),
                                       (self.rank_source, self.ranks, view["ranks"])):
            if dict(source.data) != columns:
                source.data = columns
            height = _ROW * (1 + max(1, len(next(iter(columns.values()), [])))) + _SCROLLBAR
            if table.height != height:
                table.height = height
        if dict(self.rate_source.data) != view["rates"]:
            self.rate_source.data = view["rates"]


def monarch_doc(scheduler, extra: dict, doc) -> None:
    """Bokeh document function (``distributed.dashboard.core.BokehApplication`` passes ``scheduler`` and the
    dashboard's template variables ``extra``): the page inside the dashboard's own template and theme."""
    page = MonarchPage(scheduler)
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
