"""The dask_monarch page on the Dask scheduler's dashboard (``/monarch``): live sessions, one row per rank, messages
per second. ``install_page`` adds it at runtime (the scheduler plugin does, when it starts: at the first attach, or at the
scheduler's start with ``--preload dask_monarch``) and ``start_sampling`` keeps its data from then on; ``data`` is
its data source, ``page`` its Bokeh document."""

from .install import PAGE_PATHS, install_page, start_sampling, uninstall_page

__all__ = ["PAGE_PATHS", "install_page", "start_sampling", "uninstall_page"]
