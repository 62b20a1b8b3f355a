"""``OpaqueRef``: an arbitrary Python object that lives on each rank, named from the controller (Monarch's
``monarch.common.opaque_ref.OpaqueRef``, importable as ``dask_monarch.OpaqueRef``).

A remote function makes one on the workers and returns it; the controller gets a handle it can pass to later
remote functions, which receive the ``OpaqueRef`` again and read ``ref.value``, the object of *their* rank::

    def make_model_worker(n):                       # runs on every rank
        return dm.OpaqueRef(torch.nn.Linear(n, n))

    def step_worker(model, x):                      # model.value is this rank's nn.Linear
        return model.value(x)

    make_model = dm.remote(make_model_worker, propagate=lambda n: dm.OpaqueRef(None))
    step = dm.remote(step_worker, propagate=lambda model, x: torch.empty_like(x))
    with mesh.activate():
        model = make_model(4)                       # the controller's handle
        y = step(model, torch.rand(2, 4))

How: a ref is its key, a 0-d int64 tensor, and it is a ``torch.utils._pytree`` node with that key as its only
leaf, so it travels through ``remote`` as any tensor result does: ``propagate`` returns ``OpaqueRef(None)`` (made
on fake tensors, its key is a fake one), the call's result is a remote ``Tensor`` holding every rank's key, and
passing the handle to a call sends the key's ref, resolved on each rank to that rank's key. The object itself
stays on its rank, in its session's table (``worker/opaque.py``), held until the controller drops its handle
(the key's ``DeleteRefs`` goes before the next message sent after the handle died, so that what follows runs
without the object, as in Monarch; a message not yet sent that uses the ref keeps the handle alive until it is)
or the session ends, whichever comes first.

``ref.value`` (get and set) works inside remote functions and, for refs made there, inside ``propagate``
functions; elsewhere on the controller it raises ``RuntimeError`` (the object is not there). A function that takes
an ``OpaqueRef`` needs ``propagate=``: its outputs cannot be learned by running it on the controller (no object
there) nor once more on a rank (that would call into the object twice).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import register_pytree_node
from torch.utils.weak import WeakTensorKeyDictionary

from .controller.local import is_propagating
from .controller.tensor import Tensor
from .worker.opaque import session_table

__all__ = ["OpaqueRef"]

_keys = itertools.count(1)
#: the objects of refs made inside ``propagate`` functions on the controller (their keys are fake tensors)
_propagation_values = WeakTensorKeyDictionary()
_lock = threading.Lock()


def _table(what: str, key) -> WeakTensorKeyDictionary:
    """Where the object of ``key`` lives here: the calling stream's session table on a worker, the propagation
    table for a fake key (or a new ref) inside ``propagate`` on the controller; ``RuntimeError`` elsewhere."""
    table = session_table(create=what != "read")
    if table is not None:
        return table
    if (key is None and is_propagating()) or isinstance(key, FakeTensor):
        return _propagation_values
    raise RuntimeError(
        f"OpaqueRef: cannot {what} an OpaqueRef's object here: it lives on the workers, in the stream that runs a "
        "remote function (this is the controller, or another thread). Make OpaqueRef(obj) inside a remote function "
        "(returning it gives the controller a handle), and read or set ref.value inside the remote functions you "
        "pass the handle to"
    )


class OpaqueRef:
    """A Python object living on each rank of a mesh, referenced from the controller (see the module docstring).

    ``OpaqueRef(value)`` inside a remote function (or a ``propagate`` function) keeps ``value`` for this rank and
    session; ``ref.value`` reads or replaces it there. ``RuntimeError`` when made or read on the controller outside
    those. Subclasses (``OpaqueObject``) travel the same way; a worker receives a plain ``OpaqueRef``.
    """

    def __init__(self, value: Any = None):
        table = _table("create", None)
        self._key = torch.tensor(next(_keys), dtype=torch.int64)  # inside propagate: a fake key (its fake mode)
        with _lock:
            table[self._key] = value

    @classmethod
    def _create(cls, key) -> "OpaqueRef":
        """An instance of ``cls`` for ``key`` (a key tensor, a remote ``Tensor`` or a ``Ref``), without a new object."""
        ref = cls.__new__(cls)
        ref._key = key
        if isinstance(key, Tensor):  # the controller's handle: its DeleteRefs goes before the next message
            key._urgent_drop = True
        return ref

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        register_pytree_node(cls, _flatten, _unflatten)

    def __reduce_ex__(self, protocol):
        # what a worker needs is the key: a subclass (OpaqueObject) arrives as a plain OpaqueRef, and a remote Tensor
        # key pickles as its Ref, resolved to the rank's key tensor there
        return (_plain, (self._key,))

    @property
    def value(self) -> Any:
        """The object on this rank (inside remote functions). ``RuntimeError`` on the controller, or if this rank has
        no object for the key (its session ended)."""
        table = _table("read", self._key)
        with _lock:
            try:
                return table[self._key]
            except KeyError:
                pass
        if table is _propagation_values:
            raise RuntimeError(
                "OpaqueRef: the object of an OpaqueRef made on the workers was read on the controller's fake tensors (a "
                "propagate function, or a remote function run there to learn its outputs); it is not on the controller: "
                "give propagate= a function that computes the output shapes without it"
            )
        raise RuntimeError(f"OpaqueRef: no object for {self!r} on this rank (its session ended, or it was made in "
                           "another session)")

    @value.setter
    def value(self, value: Any) -> None:
        table = _table("set", self._key)
        with _lock:
            table[self._key] = value

    def __repr__(self) -> str:
        key = self._key
        ref = getattr(key, "ref", None)
        if ref is not None:
            return f"{type(self).__name__}({ref!r})"
        if isinstance(key, torch.Tensor) and not isinstance(key, FakeTensor):
            return f"{type(self).__name__}(key {int(key)})"
        return f"{type(self).__name__}({key!r})"


def _plain(key) -> OpaqueRef:
    return OpaqueRef._create(key)


def _flatten(ref: OpaqueRef):
    return [ref._key], type(ref)


def _unflatten(leaves, cls) -> OpaqueRef:
    return cls._create(leaves[0])


register_pytree_node(OpaqueRef, _flatten, _unflatten, serialized_type_name="dask_monarch.OpaqueRef")


def __getattr__(name: str):
    # ``_key_table`` (Monarch's ``opaque_ref._key_table``): in a remote function, the objects that this rank keeps
    # for the calling session's refs, a ``WeakTensorKeyDictionary`` keyed by the refs' keys; empty elsewhere
    if name == "_key_table":
        table = session_table(create=False)
        return WeakTensorKeyDictionary() if table is None else table
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
