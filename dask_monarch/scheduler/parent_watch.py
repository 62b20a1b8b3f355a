"""A Dask preload (``--preload dask_monarch.scheduler.parent_watch``) that closes the embedded cluster's scheduler
when the controller that started it is gone.

The embedded default (``dask_monarch.cluster``) runs its scheduler in a ``python -m dask spec`` child of the
controller, in a session of its own (a Ctrl-C at the terminal reaches only the controller, which then ends the mesh
and closes the cluster). If the controller dies without closing it (SIGKILL, a crash of the interpreter), nothing
else would: this preload notices that the scheduler's parent changed (the child was re-parented) within
``INTERVAL`` seconds and closes the scheduler, whose workers then exit as they do when they lose their scheduler.
Dask's preload protocol: ``dask_setup(scheduler)`` runs as the scheduler starts (docs.dask.org, "Customize
initialization").
"""

from __future__ import annotations

import asyncio
import logging
import os

__all__ = ["INTERVAL", "dask_setup"]

logger = logging.getLogger("dask_monarch.scheduler")

#: seconds between two looks at the scheduler's parent process
INTERVAL = 1.0


def dask_setup(scheduler) -> None:
    """Watch ``scheduler``'s parent process; close the scheduler once that process has exited."""
    from tornado.ioloop import PeriodicCallback

    parent = os.getppid()

    def check():
        if os.getppid() != parent:
            logger.warning("dask_monarch: the controller (pid %d) that started this scheduler has exited; closing "
                           "the scheduler", parent)
            watch.stop()
            closing.add(asyncio.ensure_future(scheduler.close(reason="controller-exited")))

    closing: set = set()  # a reference to the close task until the process ends (asyncio keeps only weak ones)

    watch = PeriodicCallback(check, INTERVAL * 1000)
    watch.start()
