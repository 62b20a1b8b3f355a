"""Adding the ``/monarch`` page to a running scheduler's dashboard (spec/dask-notes.md §2, option 3: at runtime,
from ``SchedulerPlugin.start``, the only way on a cluster that dask_monarch did not start).

The page is a second Bokeh application next to the dashboard's own, built and started the way
``distributed.dashboard.scheduler.connect`` builds the first: ``BokehApplication`` ->
``http_application.add_application`` -> ``initialize`` -> ``start``. It serves ``/monarch`` and, under the name the
dashboard gives its individual plots, ``/individual-monarch``, which is added to the dashboard's "More..." menu.
These are internals of distributed: CI tests them (tests/test_dashboard.py, tests/test_dashboard_browser.py).
"""

from __future__ import annotations

import logging
import time
import weakref

__all__ = ["PAGE_PATHS", "SAMPLE_MS", "install_page", "read_scheduler", "start_sampling", "uninstall_page"]

logger = logging.getLogger("dask_monarch.dashboard")

PAGE_PATHS = ("/monarch", "/individual-monarch")
_MENU_ENTRY = {"url": "individual-monarch", "name": "Monarch"}
_installed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # scheduler -> its page's Bokeh app
#: how often the scheduler samples the page's data (milliseconds), page or no page: a rank's rate line starts at
#: its session's start, not when someone opened the page
SAMPLE_MS = 500


def read_scheduler(scheduler) -> tuple[dict, dict]:
    """``(sessions, metrics)`` for ``DashboardData.update``: the scheduler plugin's session table (the sessions
    that ended lately too, with ``ended`` and ``reason``) and each worker's ``metrics["monarch"]`` from its last
    heartbeat."""
    from ..scheduler.plugin import PLUGIN_NAME
    from ..worker.plugin import METRICS_KEY

    plugin = scheduler.plugins.get(PLUGIN_NAME)
    sessions = {**(getattr(plugin, "ended", None) or {}), **(getattr(plugin, "sessions", None) or {})}
    metrics = {address: (ws.metrics or {}).get(METRICS_KEY) for address, ws in list(scheduler.workers.items())}
    return sessions, metrics


def start_sampling(scheduler):
    """Keep the page's data (a ``DashboardData`` that every page of ``scheduler`` shares) up to date every
    ``SAMPLE_MS``; returns ``(data, periodic callback)``. Call it on the scheduler's event loop."""
    from tornado.ioloop import PeriodicCallback

    from .data import DashboardData

    data = DashboardData()

    def sample():
        try:
            data.update(*read_scheduler(scheduler), time.time())
        except Exception:
            logger.debug("dask_monarch dashboard: sampling failed", exc_info=True)

    sampler = PeriodicCallback(sample, SAMPLE_MS)
    sampler.start()
    return data, sampler


def _dashboard_app(scheduler):
    """The dashboard's own Bokeh application, or None (no dashboard, or no Bokeh)."""
    try:
        from bokeh.server.tornado import BokehTornado
    except ImportError:
        return None
    http_application = getattr(scheduler, "http_application", None)
    for app in getattr(http_application, "applications", ()):
        if isinstance(app, BokehTornado):
            return app
    return None


def install_page(scheduler) -> bool:
    """Serve the page on ``scheduler``'s dashboard, once per scheduler. Returns True if the page is served (now or
    already), False if the scheduler has no Bokeh dashboard. Call it on the scheduler's event loop."""
    if scheduler in _installed:
        return True
    dashboard = _dashboard_app(scheduler)
    if dashboard is None:
        return False
    from . import quiet_logs

    quiet_logs.install()  # a browser tab closed on the page prints no traceback (the scheduler may be the program's)
    from distributed.dashboard.core import BokehApplication
    from distributed.dashboard.scheduler import template_variables
    from tornado.ioloop import IOLoop

    from .page import monarch_doc

    variables = template_variables(scheduler)  # memoized per scheduler: the dict every page's menu is built from
    plots = variables.setdefault("plots", [])
    if not any(p.get("url") == _MENU_ENTRY["url"] for p in plots):
        plots.append(dict(_MENU_ENTRY))
        plots.sort(key=lambda p: p["name"])
    app = BokehApplication(
        {path: monarch_doc for path in PAGE_PATHS}, scheduler, prefix=dashboard.prefix,
        template_variables=variables,
    )
    scheduler.http_application.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    _installed[scheduler] = app
    logger.info("dask_monarch: dashboard page at %s", ", ".join(PAGE_PATHS))
    return True


def uninstall_page(scheduler) -> None:
    """Stop the page's Bokeh application (when the scheduler closes)."""
    app = _installed.pop(scheduler, None)
    if app is None:
        return
    try:
        app.stop()
    except Exception:
        pass
    applications = getattr(getattr(scheduler, "http_application", None), "applications", None)
    if applications is not None and app in applications:
        applications.remove(app)
