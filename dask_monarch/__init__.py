"""dask_monarch: Meta's Monarch tensor engine on Dask.

One Python program, the controller, drives PyTorch on a mesh of Dask workers::

    import dask_monarch as dm

    with dm.attach(dims={"dp": 2}) as mesh:          # an embedded LocalCluster, or attach(client/address)
        x = dm.remote(make_data)(mesh)               # runs on every rank; x is a remote Tensor
        total = x.reduce("dp", "sum")                # collective over the "dp" dimension
        print(dm.inspect(total))                     # the value of rank 0, as a CPU torch.Tensor
"""

from .controller import (
    DeviceMesh,
    MonarchFuture,
    Tensor,
    attach,
    coalescing,
    fetch_shard,
    get_active_mesh,
    inspect,
    no_mesh,
    reduce,
    reduce_,
    remote,
)
from .exceptions import RemoteException, SessionError

__version__ = "0.1.0"

__all__ = [
    "DeviceMesh",
    "MonarchFuture",
    "RemoteException",
    "SessionError",
    "Tensor",
    "attach",
    "coalescing",
    "fetch_shard",
    "get_active_mesh",
    "inspect",
    "no_mesh",
    "reduce",
    "reduce_",
    "remote",
]
