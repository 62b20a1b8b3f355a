"""The dask_monarch page on the Dask scheduler's dashboard (``/monarch``): live sessions, one row per rank, messages
per second. ``install_page`` adds it at runtime (the scheduler plugin does, when a controller attaches); ``data``
is its data source, ``page`` its Bokeh document."""

from .install import PAGE_PATHS, install_page, uninstall_page

__all__ = ["PAGE_PATHS", "install_page", "uninstall_page"]
