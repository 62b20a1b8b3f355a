"""``ClosingHeartbeat``: the worker's log filter for the heartbeat that a closing Dask worker cuts short itself.

``Worker.close`` (distributed 2026.8) sets the worker's status to ``closing``, removes its plugins (ours ends its
sessions here, which takes a while on a loaded machine), stops its periodic callbacks, and only then closes its
connection pool (``await self.rpc.close()``). A heartbeat that started before the callbacks stopped and still waits
for the scheduler's answer then has its connection closed under it, and ``Worker.heartbeat`` logs "Failed to
communicate with scheduler during heartbeat." at ERROR with a ``CommClosedError: ... Stream is closed``
traceback. On the embedded default the workers' logs are the program's stderr, so a normal exit ended with that
traceback (seen once in a suite run beside a CPU hog, 2026-12-05). Nothing is lost: the worker was closing. Such a
record, logged while a worker this filter watches is closing, goes to DEBUG under
``dask_monarch.worker``; the same message from a running worker (its scheduler really unreachable) keeps Dask's
ERROR line.
"""

from __future__ import annotations

import logging
import weakref

from distributed.core import Status

__all__ = ["ClosingHeartbeat", "install"]

logger = logging.getLogger("dask_monarch.worker")
_WORKER_LOGGER = "distributed.worker"
_MESSAGE = "Failed to communicate with scheduler during heartbeat."
_CLOSING = frozenset({Status.closing, Status.closing_gracefully})  # ``closed`` comes after the pool closed


class ClosingHeartbeat(logging.Filter):
    """Drops (to DEBUG) ``Worker.heartbeat``'s ERROR while a watched worker of this process is closing."""

    def __init__(self):
        super().__init__()
        self.workers: weakref.WeakSet = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != _MESSAGE:
            return True
        closing = [w for w in list(self.workers) if getattr(w, "status", None) in _CLOSING]
        if not closing:
            return True
        logger.debug("dask_monarch: a heartbeat cut short by the worker's own close (%s): %s",
                     closing[0].address, record.exc_info[1] if record.exc_info else record.getMessage())
        return False


_FILTER = ClosingHeartbeat()


def install(worker) -> None:
    """Watch ``worker`` (a ``distributed.Worker``) and add the filter to the ``distributed.worker`` logger, once per
    process. It stays after the plugin's teardown: the heartbeat is cut short after the plugins are removed."""
    _FILTER.workers.add(worker)
    target = logging.getLogger(_WORKER_LOGGER)
    if _FILTER not in target.filters:
        target.addFilter(_FILTER)
