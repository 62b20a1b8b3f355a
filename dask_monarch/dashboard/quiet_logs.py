"""A browser tab closed on a dashboard page logs nothing the program shows (issue 25 item 6).

The embedded cluster's scheduler, and so the dashboard's Tornado and Bokeh servers, live in the controller's
process, whose stderr is the program's output. A tab closed or reloaded while its websocket opens or while the
page sends it an update makes Tornado and Bokeh log the connection's end as errors with tracebacks (Tornado's
``WebSocketHandler.selected_subprotocol`` asserts that the connection is still there; a write finds the stream
closed: ``WebSocketClosedError``, ``StreamClosedError``; Bokeh says "Failed sending message as connection was
closed"). Dask's logging config prints ``tornado.application`` and ``bokeh`` errors on stderr.

``install()`` adds a ``logging.Filter`` to the loggers those records come from: a record about a closed websocket
(one of those exceptions raised in Tornado's websocket code or Bokeh's server, or Bokeh's message) is logged at
DEBUG instead, so it shows only where that logger is set to DEBUG. Every other record is left as it is.
"""

from __future__ import annotations

import logging
import threading
import traceback

__all__ = ["ClosedWebsocketToDebug", "install", "LOGGERS"]

#: the loggers the records come from (a filter on a logger sees only the records made there, not its children's)
LOGGERS = ("tornado.application", "tornado.general", "asyncio", "bokeh.server.views.ws", "bokeh.server.connection",
           "bokeh.server.session", "bokeh.server.protocol_handler", "bokeh.server.tornado")
_MESSAGES = ("Failed sending message as connection was closed",)
#: where the code whose exceptions are about a closed websocket lives (path parts of its source files)
_CODE = ("tornado/websocket.py", "tornado/iostream.py", "bokeh/server/")
_installed = False
_lock = threading.Lock()


def _closed_exception(exc: BaseException) -> bool:
    from tornado.iostream import StreamClosedError
    from tornado.websocket import WebSocketClosedError

    if not isinstance(exc, (AssertionError, WebSocketClosedError, StreamClosedError)):
        return False
    files = [frame.f_code.co_filename.replace("\\", "/") for frame, _ in traceback.walk_tb(exc.__traceback__)]
    return any(part in name for name in files for part in _CODE)


class ClosedWebsocketToDebug(logging.Filter):
    """Logs a record about a closed websocket (see the module's docstring) at DEBUG: it passes on, as a DEBUG
    record, only if its logger is enabled for DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        about_closed = _closed_exception(exc) if exc is not None else (
            isinstance(record.msg, str) and record.msg.startswith(_MESSAGES))
        if not about_closed:
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def install() -> None:
    """Add the filter to ``LOGGERS``, once per process (the scheduler's: ``install_page`` calls it)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        quiet = ClosedWebsocketToDebug()
        for name in LOGGERS:
            logging.getLogger(name).addFilter(quiet)
