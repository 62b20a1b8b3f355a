"""``OpaqueObject`` and ``opaque_method``: a Python object built on every rank, whose methods the controller calls
(Monarch's ``monarch.opaque_object``; also ``dask_monarch.OpaqueObject``, ``dask_monarch.opaque_method``).

Subclass ``OpaqueObject`` on the controller and declare the methods the workers' object has, each body computing
the shapes of what the method returns (it runs on fake tensors, as a ``propagate`` function)::

    class Stats(dm.OpaqueObject):                  # the controller's side
        @dm.opaque_method
        def update(self, x):                       # shapes only: what Stats.update returns on the workers
            return torch.empty(x.shape[1:])

    with mesh.activate():
        s = Stats("mypkg.stats.RunningStats", 0.9)   # RunningStats(0.9) built on every rank
        mean = s.update(torch.rand(8, 4))            # each rank's RunningStats.update(its x): a remote Tensor
        n = s.call_method_on_shard_and_fetch("count").result()   # rank 0's value

The constructor is named by a dotted path (``"torch.nn.Linear"``) or given as a callable (sent as ``remote``
sends functions: by path when the workers can import it, else cloudpickled). The object is an ``OpaqueRef``
(``opaque_ref.py``): it lives until the controller drops its handle or the session ends.
"""

from __future__ import annotations

import functools

from .controller import call_on_shard_and_fetch, remote
from .controller.functions import function_of
from .opaque_ref import OpaqueRef
from .protocol import resolve_function

__all__ = ["OpaqueObject", "opaque_method"]


def construct_object(constructor, *args, **kwargs) -> OpaqueRef:
    """On each rank: ``constructor(*args, **kwargs)`` (a ``ResolvableFunction``) kept as an ``OpaqueRef``."""
    return OpaqueRef(resolve_function(constructor)(*args, **kwargs))


def invoke_method(obj: OpaqueRef, method_name: str, *args, **kwargs):
    """On each rank: ``obj.value.method_name(*args, **kwargs)``."""
    method = getattr(obj.value, method_name, None)
    if method is None or not callable(method):
        raise AttributeError(f"the object of {obj!r} ({type(obj.value).__qualname__}) has no method {method_name!r}")
    return method(*args, **kwargs)


def _fresh_ref(*args, **kwargs) -> OpaqueRef:
    return OpaqueRef(None)


_construct = remote(construct_object, propagate=_fresh_ref)
_invoke = remote(invoke_method)


def _shapes_of_method(propagation, obj, method_name, *args, **kwargs):
    return propagation(obj, *args, **kwargs)


@functools.lru_cache(maxsize=256)
def _method_call(propagation):
    """The ``remote`` of ``invoke_method`` whose shapes ``propagation(obj, *args, **kwargs)`` gives: one per
    propagation function, so that repeated calls reuse their cached plan."""
    return remote(invoke_method, propagate=functools.partial(_shapes_of_method, propagation))


class OpaqueObject(OpaqueRef):
    """An object built on every rank of the active mesh by ``constructor(*args, **kwargs)``, held from the controller
    (Monarch's ``OpaqueObject``; see the module docstring).

    ``constructor``: a dotted path or a callable; or an existing ``OpaqueRef``, whose object this one then names.
    Raises ``TypeError`` for another constructor, ``ValueError`` without an active mesh. A constructor that raises
    fails the construction on that rank: the first call that uses the object raises its ``RemoteException``.
    Controller-side attributes (``obj.name = ...``) stay on the controller.
    """

    def __init__(self, constructor, *args, **kwargs):
        if isinstance(constructor, OpaqueRef):
            self._key = constructor._key
            return
        if not (isinstance(constructor, str) or callable(constructor)):
            raise TypeError(f"{type(self).__name__}: the constructor must be a dotted path or a callable, got "
                            f"{type(constructor).__name__}")
        self._key = _construct(function_of(constructor), *args, **kwargs)._key

    def call_method(self, method_name: str, propagation, *args, **kwargs):
        """``method_name(*args, **kwargs)`` of every rank's object, as a remote function: returns what
        ``propagation(self, *args, **kwargs)`` returns (run on fake tensors) with each tensor a remote ``Tensor``.
        ``TypeError`` if ``propagation`` is not callable or ``method_name`` not a string."""
        if not isinstance(method_name, str):
            raise TypeError(f"call_method: method_name must be a str, got {type(method_name).__name__}")
        if not callable(propagation):
            raise TypeError(f"call_method({method_name!r}): propagation must be a function of (self, *args, **kwargs) "
                            f"returning tensors of the outputs' shapes (or None), got {type(propagation).__name__}")
        return _method_call(propagation)(self, method_name, *args, **kwargs)

    def call_method_on_shard_and_fetch(self, method_name: str, *args, **kwargs):
        """``method_name(*args, **kwargs)`` of the mesh's first rank's object, fetched: a ``MonarchFuture`` of its
        value (tensors as CPU copies), as ``call_on_shard_and_fetch``."""
        return call_on_shard_and_fetch(_invoke, self, method_name, *args, **kwargs)


def opaque_method(fn):
    """Declare a method of an ``OpaqueObject`` subclass: calling it calls the workers' method of the same name;
    ``fn``'s body, run on fake tensors, gives the shapes of what it returns (Monarch's ``opaque_method``)."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        return self.call_method(name, fn, *args, **kwargs)

    return call
