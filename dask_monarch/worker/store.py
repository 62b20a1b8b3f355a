"""``SchedulerStore``: a ``torch.distributed.Store`` whose keys live in the Dask scheduler (DESIGN.md "Comms";
spec/dask-notes.md §7B).

Each method is one RPC to the ``monarch_kv_*`` handlers that ``MonarchSchedulerPlugin`` installs, over the
worker's existing scheduler connection: no extra port, no ``MASTER_ADDR``. Never call it on the worker's event
loop thread (it blocks on that loop); the tensor worker calls it from its own threads.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from distributed.utils import sync

__all__ = ["SchedulerStore"]


def _bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class SchedulerStore(dist.Store):
    """Store over ``worker``'s scheduler connection. ``timeout`` (seconds) bounds ``get`` and ``wait``; a key
    that does not appear in time raises ``TimeoutError`` naming it."""

    def __init__(self, worker, timeout: float):
        super().__init__()
        self._worker = worker
        self._timeout = float(timeout)

    def _call(self, op: str, **kwargs):
        return sync(self._worker.loop, getattr(self._worker.scheduler, op), **kwargs)

    def set(self, key, value) -> None:
        self._call("monarch_kv_set", key=key, value=_bytes(value))

    def get(self, key) -> bytes:
        return self._call("monarch_kv_get", key=key, timeout=self._timeout)

    def add(self, key, amount) -> int:
        return self._call("monarch_kv_add", key=key, amount=int(amount))

    def compare_set(self, key, expected, desired) -> bytes:
        return self._call("monarch_kv_compare_set", key=key, expected=_bytes(expected), desired=_bytes(desired))

    def wait(self, keys, timeout=None) -> None:
        seconds = self._timeout if timeout is None else _seconds(timeout)
        self._call("monarch_kv_wait", keys=list(keys), timeout=seconds)

    def check(self, keys) -> bool:
        return self._call("monarch_kv_check", keys=list(keys))

    def delete_key(self, key) -> bool:
        return self._call("monarch_kv_delete", key=key)

    def num_keys(self) -> int:
        return self._call("monarch_kv_num_keys")

    def set_timeout(self, timeout) -> None:
        self._timeout = _seconds(timeout)


def _seconds(timeout) -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)
