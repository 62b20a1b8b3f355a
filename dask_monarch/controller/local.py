"""``propagating()``: inside it, torch runs locally on the controller, under ``mesh.activate()`` too (spec §1
"Dispatch").

The controller runs torch itself in three places: ops on fake tensors to learn output shapes (``propagation.py``),
pickling the local values among a message's arguments (``transport.py``), and building meta tensors for remote
tensors' metadata. Under ``mesh.activate()`` the mesh's ``TorchDispatchMode`` (``dispatch.py``) would send those
to the mesh; it lets them through while ``is_propagating()``. This module sits below the session and the frontend,
so both can say so without importing each other.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging

__all__ = ["propagating", "is_propagating"]

_propagating: contextvars.ContextVar = contextvars.ContextVar("dask_monarch_propagating", default=False)

#: whether this context runs torch locally (``propagating()``)
is_propagating = _propagating.get


class _QuietMetaFailures(logging.Filter):
    """Drops torch's log line for an op that fails on fake tensors ("failed while attempting to run meta for ...",
    with its traceback) while this context propagates: the error itself reaches the caller, as torch raises it
    locally, and the log line (about 40 lines on stderr) would come on top of it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_propagating.get() and record.msg.startswith("failed while attempting to run meta"))


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_QuietMetaFailures())


@contextlib.contextmanager
def propagating():
    """Inside, ``MeshDispatchMode`` runs operations locally (on the controller's fake tensors)."""
    token = _propagating.set(True)
    try:
        yield
    finally:
        _propagating.reset(token)
