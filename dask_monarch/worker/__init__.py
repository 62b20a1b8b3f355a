"""Worker side of dask_monarch: the ``WorkerPlugin``, the tensor-worker state machine and its streams."""

from .plugin import MonarchWorkerPlugin, deliver_batch, sync_batch
from .tensor_worker import SessionParams, TensorWorker

__all__ = ["MonarchWorkerPlugin", "SessionParams", "TensorWorker", "deliver_batch", "sync_batch"]
