"""The worker's filter for the heartbeat that a closing Dask worker cuts short itself (worker/log_filter.py): on a
real in-process ``Scheduler`` and ``Worker``, ``Worker.heartbeat``'s "Failed to communicate with scheduler during
heartbeat." keeps its ERROR while the worker runs and goes to DEBUG under ``dask_monarch.worker`` while it is
closing (here logged from a plugin's teardown, which ``Worker.close`` runs after setting ``closing``, as the cut-short
heartbeat comes later in the same close); other records are untouched."""

from __future__ import annotations

import asyncio
import logging

from distributed import Scheduler, Worker
from distributed.diagnostics.plugin import WorkerPlugin

from dask_monarch.worker import log_filter


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def _heartbeat_failure() -> None:
    try:
        raise OSError("in <TCP (closed) ConnectionPool.heartbeat_worker>: Stream is closed")
    except OSError:
        logging.getLogger("distributed.worker").exception("Failed to communicate with scheduler during heartbeat.")


class _LogsAtTeardown(WorkerPlugin):
    name = "logs-at-teardown"

    def teardown(self, worker):
        self.status = worker.status.name
        _heartbeat_failure()
        logging.getLogger("distributed.worker").error("another error")


def test_a_heartbeat_failure_is_an_error_while_running_and_debug_while_the_worker_closes():
    seen = _Records()
    loggers = [logging.getLogger(name) for name in ("distributed.worker", "dask_monarch.worker")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(seen)
        lg.setLevel(logging.DEBUG)

    async def main():
        async with Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as s:
            worker = Worker(s.address, host="127.0.0.1", nthreads=1, dashboard=False)
            await worker
            log_filter.install(worker)
            _heartbeat_failure()  # running: Dask's ERROR stays
            logging.getLogger("distributed.worker").error("another error")
            running = [(r.name, r.levelno) for r in seen.records if "heartbeat" in r.getMessage()]
            plugin = _LogsAtTeardown()
            await worker.plugin_add(plugin)
            seen.records.clear()
            await worker.close()  # closing: DEBUG under dask_monarch.worker
            assert plugin.status == "closing"
            return running, [(r.name, r.levelno, r.getMessage()) for r in seen.records
                             if "heartbeat" in r.getMessage() or r.getMessage() == "another error"]

    try:
        running, closed = asyncio.run(main())
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(seen)
            lg.setLevel(level)
    assert running == [("distributed.worker", logging.ERROR)]
    assert [(name, level) for name, level, _ in closed] == [("dask_monarch.worker", logging.DEBUG),
                                                             ("distributed.worker", logging.ERROR)]
    assert "cut short by the worker's own close" in closed[0][2] and "Stream is closed" in closed[0][2]
    assert closed[1][2] == "another error"
