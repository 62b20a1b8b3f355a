"""Which stream a remote function runs on: ``current_stream()`` inside a function a stream's thread calls.

Each ``StreamWorker`` thread sets it when it starts (and Dask's own worker context, so ``distributed.get_worker()``
in a remote function is the Dask worker the rank runs in: its ``data`` holds what Dask computed there). The data
feeds use it (``worker/pipe.py``, ``dask_monarch/data``).
"""

from __future__ import annotations

import threading

__all__ = ["current_stream"]

_local = threading.local()


def current_stream():
    """The ``StreamWorker`` whose thread calls this, or None outside a stream's thread."""
    return getattr(_local, "stream", None)
