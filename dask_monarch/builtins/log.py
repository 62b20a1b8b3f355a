"""Logging on the ranks (Monarch's ``monarch.builtins.log``): ``log_remote`` and ``set_logging_level_remote``.

Both use the logger ``dask_monarch.builtins.log`` of each rank's worker process. Its records go where that
process's logging sends them (a worker's stderr); to see them on the controller, have Dask forward them:
``mesh.client.forward_logging("dask_monarch.builtins.log")`` (Dask's ``Client.forward_logging``), after which each
record is logged again in the controller by the logger of the same name, with its worker in ``record.worker``.
"""

from __future__ import annotations

import logging

from ..controller import remote

__all__ = ["log_remote", "logger", "set_logging_level_remote"]

#: the logger the ranks log to (one per worker process)
logger = logging.getLogger(__name__)


@remote(propagate="inspect")
def log_remote(*args, level: int = logging.WARNING, **kwargs) -> None:
    """On every rank, ``logger.log(level, *args, **kwargs)`` with ``logger`` this module's: a message and its
    ``%``-arguments, as ``logging`` takes them (``log_remote("step %d", 3, level=logging.INFO)``). ``level``
    defaults to ``WARNING``. A bad level raises ``TypeError`` on the workers (``logging``'s), failing that call."""
    logger.log(level, *args, **kwargs)


@remote(propagate="inspect")
def set_logging_level_remote(level: int) -> None:
    """Set the level of the ranks' logger ``dask_monarch.builtins.log`` (``logging.DEBUG`` ... ``CRITICAL``, or a
    level name): ``log_remote`` calls below it log nothing. The level stays set in each worker process after the
    session."""
    logger.setLevel(level)
