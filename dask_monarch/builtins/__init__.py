"""Remote functions for common torch and Python calls (Monarch's ``monarch.builtins``): ``log`` (a log record on
every rank's worker), ``random`` (seeding and generator states), ``misc`` (the default dtype) and ``cuda`` (CUDA
memory and devices). Call them under ``mesh.activate()``: each runs on
every rank of the active mesh, in order with the work sent there."""

from . import cuda, misc, random  # noqa: F401 (as Monarch's monarch.builtins.cuda, .misc and .random)
from .log import log_remote, set_logging_level_remote

__all__ = ["log_remote", "set_logging_level_remote"]
