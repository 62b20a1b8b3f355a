"""``ForgottenGathers``: the scheduler's log filter for gathers of dask_monarch's own task copies that their
controller released meanwhile.

A session's batches and fetches also travel as pinned ``monarch-<session>-...`` Dask tasks, whose results the
controller gathers through the scheduler (``controller/answers.py``). When a program closes its ``Client`` (or
ends) while such a gather is in flight, the client's release of the key reaches the scheduler first, and
``Scheduler.gather`` logs ``Couldn't gather keys: {'monarch-...-fetch-0-1': 'forgotten'}`` at ERROR: on the
embedded default that line lands in the program's own stderr after a normal exit. Nothing is lost (the session's
answers come by its answer channels, and the controller had let the key go), so such a record, whose every key is
a ``monarch-`` task in state ``forgotten``, is logged at DEBUG under ``dask_monarch.scheduler`` instead. Any other
key, or any other state, keeps Dask's ERROR line.
"""

from __future__ import annotations

import logging

__all__ = ["ForgottenGathers", "install"]

logger = logging.getLogger("dask_monarch.scheduler")
_SCHEDULER_LOGGER = "distributed.scheduler"
_MESSAGE = "Couldn't gather keys: %s"


class ForgottenGathers(logging.Filter):
    """Drops (to DEBUG) ``Scheduler.gather``'s ERROR about ``monarch-`` keys that are all ``forgotten``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != _MESSAGE or not record.args:
            return True
        states = record.args[0] if isinstance(record.args, tuple) else record.args
        if not isinstance(states, dict) or not states:
            return True
        if all(isinstance(k, str) and k.startswith("monarch-") and v == "forgotten" for k, v in states.items()):
            logger.debug("dask_monarch: a gather of task copies released by their controller: %s", states)
            return False
        return True


_FILTER = ForgottenGathers()


def install() -> None:
    """Add the filter to the ``distributed.scheduler`` logger, once per process (it stays: it only concerns
    ``monarch-`` keys, and several schedulers may share a process)."""
    target = logging.getLogger(_SCHEDULER_LOGGER)
    if _FILTER not in target.filters:
        target.addFilter(_FILTER)

