"""Monarch's module path ``monarch.actor``, for the names a tensor-engine program takes from it: ``from
dask_monarch.actor import Actor, endpoint, as_endpoint`` (the same objects as ``dask_monarch.Actor`` ...;
``controller/actors.py``), ``ValueMesh`` and ``Point`` (what ``call`` answers; ``controller/value_mesh.py``),
``Future`` (``MonarchFuture``: ``get``/``result``). Monarch's process meshes (``this_host``, ``proc_mesh``) are
``dask_monarch.attach`` here ([coming from Monarch](coming-from-monarch.md))."""

from .controller import Actor, ActorMesh, Endpoint, MonarchFuture, ValueMesh, as_endpoint, endpoint
from .controller.value_mesh import Point

Future = MonarchFuture

__all__ = ["Actor", "ActorMesh", "Endpoint", "Future", "Point", "ValueMesh", "as_endpoint", "endpoint"]
