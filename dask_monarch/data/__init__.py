"""Dask collections into and out of the mesh, and pipes that feed each step (issue 15; DESIGN.md "Decisions").

* ``from_dask(collection, mesh, dim)``: a ``dask.array`` or ``dask.dataframe`` as a remote tensor sharded along
  ``dim``, taken where Dask holds it (``collections.py``).
* ``to_dask(t, dim)`` / ``to_dask_dataframe(t, dim, columns)``: a remote tensor's shards as a Dask collection
  whose chunks stay on the workers that hold them (``to_dask.py``).
* ``iter_from_dask(collection, mesh, dim, partitions=, ahead=)``: a ``from_dask`` per group of partitions, the next
  groups read ahead on the workers (``groups.py``).
* ``create_pipe(source, mesh)``: batches from a Dask collection or a generator function, one per ``recv``
  (``PipeRecv``), loaded ahead on the workers (``pipe.py``; the worker side is ``worker/pipe.py``).

``tasks.py`` holds what the Dask workers run for these.
"""

from .collections import from_dask
from .groups import iter_from_dask
from .pipe import Pipe, create_pipe
from .to_dask import to_dask, to_dask_dataframe

__all__ = ["Pipe", "create_pipe", "from_dask", "iter_from_dask", "to_dask", "to_dask_dataframe"]
