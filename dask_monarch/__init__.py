"""dask_monarch: Meta's Monarch tensor engine on Dask.

One Python program, the controller, drives PyTorch on a mesh of Dask workers::

    import dask_monarch as dm

    with dm.attach(dims={"dp": 2}) as mesh:          # an embedded LocalCluster, or attach(client/address)
        x = dm.remote(make_data)(mesh)               # runs on every rank; x is a remote Tensor
        total = x.reduce("dp", "sum")                # collective over the "dp" dimension
        print(dm.inspect(total))                     # the value of rank 0, as a CPU torch.Tensor
"""

from .controller import (
    Actor,
    ActorMesh,
    Endpoint,
    as_endpoint,
    endpoint,
    Borrow,
    DeviceMesh,
    MeshSliceTensor,
    MonarchFuture,
    RemoteProcessGroup,
    Stream,
    Tensor,
    ValueMesh,
    attach,
    call_on_shard_and_fetch,
    coalescing,
    compile,
    fetch_shard,
    get_active_mesh,
    get_active_stream,
    grad_function,
    grad_generator,
    gradient_execution_order,
    inspect,
    main_stream,
    no_mesh,
    reduce,
    reduce_,
    remote,
    report,
    show,
    slice_mesh,
    spawn_tensor_engine,
    to_mesh,
)
from .data import Pipe, create_pipe, from_dask, iter_from_dask, to_dask, to_dask_dataframe
from .exceptions import RemoteException, SessionError
from .opaque_ref import OpaqueRef
from .opaque_object import OpaqueObject, opaque_method
from .opaque_module import OpaqueModule
from . import gradient_generator  # noqa: F401 (Monarch's module path: dask_monarch.gradient_generator)
from . import builtins, random  # noqa: F401 (Monarch's monarch.builtins and monarch.random)
from . import cached_remote_function  # noqa: F401 (Monarch's monarch.cached_remote_function.remote_autograd_function)
from . import actor, mesh_controller  # noqa: F401 (Monarch's monarch.actor and monarch.mesh_controller)


def dask_setup(server) -> None:
    """Dask's preload hook: ``dask scheduler --preload dask_monarch`` (or Dask config
    ``distributed.scheduler.preload: [dask_monarch]``) adds dask_monarch's scheduler plugin when the scheduler
    starts, so its ``/monarch`` dashboard page exists from then on (saying that no session runs yet) instead of
    from the first ``attach``. On a worker (``dask worker --preload dask_monarch``) the import itself is the point:
    dask_monarch and torch are loaded as the worker starts, so that the first ``attach`` does not wait for every
    worker's import (``attach`` still installs the worker plugin); on a nanny it does nothing."""
    from distributed import Scheduler

    if isinstance(server, Scheduler):
        from .scheduler import MonarchSchedulerPlugin

        server.add_plugin(MonarchSchedulerPlugin(), idempotent=True)

__version__ = "0.1.0"

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
    "OpaqueModule",
    "OpaqueObject",
    "OpaqueRef",
    "Pipe",
    "RemoteException",
    "RemoteProcessGroup",
    "SessionError",
    "Stream",
    "Tensor",
    "ValueMesh",
    "attach",
    "call_on_shard_and_fetch",
    "coalescing",
    "compile",
    "create_pipe",
    "fetch_shard",
    "from_dask",
    "get_active_mesh",
    "get_active_stream",
    "grad_function",
    "grad_generator",
    "gradient_execution_order",
    "inspect",
    "iter_from_dask",
    "main_stream",
    "no_mesh",
    "opaque_method",
    "reduce",
    "reduce_",
    "remote",
    "report",
    "show",
    "slice_mesh",
    "spawn_tensor_engine",
    "to_mesh",
    "to_dask",
    "to_dask_dataframe",
]
