"""Controller side of dask_monarch: session transport, meshes, remote functions, reductions, fetches.

Importing it imports every frontend module, each of which registers what ``DeviceMesh`` and ``Tensor`` call in it
(``mesh.Frontend``).
"""

from .attach import attach
from .actors import Actor, ActorMesh, Endpoint, as_endpoint, endpoint
from . import dispatch  # noqa: F401 (torch ops on remote tensors: registers with mesh.Frontend)
from .coalescing import coalescing
from .compile import compile
from .fetch import call_on_shard_and_fetch, fetch_shard, inspect, show
from . import cached_propagation  # noqa: F401 (remote learns outputs on the mesh: registers with mesh.Frontend)
from .gradients import grad_function, grad_generator, gradient_execution_order
from .mesh import DeviceMesh, get_active_mesh, no_mesh, spawn_tensor_engine
from .process_group import RemoteProcessGroup
from .reduce import reduce, reduce_
from .remote import remote
from .report import report
from .session import MonarchFuture, Session
from .stream import Borrow, Stream, get_active_stream, main_stream
from .value_mesh import ValueMesh
from .tensor import Tensor
from .to_mesh import MeshSliceTensor, slice_mesh, to_mesh

__all__ = [
    "Actor",
    "ActorMesh",
    "Endpoint",
    "as_endpoint",
    "endpoint",
    "Borrow",
    "DeviceMesh",
    "MeshSliceTensor",
    "MonarchFuture",
    "RemoteProcessGroup",
    "Session",
    "Stream",
    "Tensor",
    "ValueMesh",
    "attach",
    "call_on_shard_and_fetch",
    "coalescing",
    "compile",
    "fetch_shard",
    "get_active_mesh",
    "get_active_stream",
    "grad_function",
    "grad_generator",
    "gradient_execution_order",
    "inspect",
    "main_stream",
    "no_mesh",
    "spawn_tensor_engine",
    "reduce",
    "reduce_",
    "remote",
    "report",
    "show",
    "slice_mesh",
    "to_mesh",
]
