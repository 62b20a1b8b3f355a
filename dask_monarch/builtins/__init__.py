"""Remote functions for common torch and Python calls (Monarch's ``monarch.builtins``): ``log`` (a log record on
every rank's worker) and ``random`` (seeding and generator states). Call them under ``mesh.activate()``: each runs on
every rank of the active mesh, in order with the work sent there."""

from . import random  # noqa: F401 (dask_monarch.builtins.random, as Monarch's monarch.builtins.random)
from .log import log_remote, set_logging_level_remote

__all__ = ["log_remote", "set_logging_level_remote"]
