"""Scheduler side of dask_monarch: rendezvous store and session table (``MonarchSchedulerPlugin``)."""

from .plugin import PLUGIN_NAME, MonarchSchedulerPlugin

__all__ = ["MonarchSchedulerPlugin", "PLUGIN_NAME"]
