"""What the gloo abort tests (``test_faults.py``) and the program they run as a subprocess share: two ranks of one
gloo process group in this process, and this interpreter's state dict read without taking a reference."""

from __future__ import annotations

import ctypes
import datetime
import threading

import torch.distributed as dist


def interpreter_state_dict() -> tuple[int, list[str]]:
    """``(reference count, sorted keys)`` of this interpreter's state dict (``PyInterpreterState_GetDict``, a
    borrowed reference; pybind11 >= 3 keeps its internals there), read without holding a reference."""
    api = ctypes.PyDLL(None)
    api.PyInterpreterState_Get.restype = ctypes.c_void_p
    api.PyInterpreterState_GetDict.restype = ctypes.c_void_p
    api.PyInterpreterState_GetDict.argtypes = [ctypes.c_void_p]
    address = api.PyInterpreterState_GetDict(api.PyInterpreterState_Get())
    count = ctypes.c_ssize_t.from_address(address).value
    return count, sorted(ctypes.cast(address, ctypes.py_object).value)


def two_gloo_ranks(timeout_s: float = 60.0) -> list:
    """``[rank 0's group, rank 1's group]`` (``ProcessGroupGloo``, world 2, each built on its own thread over a
    ``HashStore``, a device on 127.0.0.1, op timeout ``timeout_s`` seconds);
    ``RuntimeError`` naming the ranks not built within ``timeout_s``."""
    store = dist.HashStore()
    groups = [None, None]

    def build(rank):
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, opts)

    builders = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for b in builders:
        b.start()
    for b in builders:
        b.join(timeout_s)
    missing = [rank for rank, group in enumerate(groups) if group is None]
    if missing:
        raise RuntimeError(f"gloo ranks {missing} were not built within {timeout_s} s")
    return groups
