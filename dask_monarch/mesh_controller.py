"""Monarch's module path ``monarch.mesh_controller``: ``from dask_monarch.mesh_controller import
spawn_tensor_engine, RemoteException`` (the same objects as ``dask_monarch.spawn_tensor_engine`` and
``dask_monarch.RemoteException``; a dask_monarch mesh already is a tensor engine, ``controller/actors.py``)."""

from .controller import spawn_tensor_engine
from .exceptions import RemoteException

__all__ = ["RemoteException", "spawn_tensor_engine"]
