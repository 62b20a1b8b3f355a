"""``Tensor``: the controller's handle to a tensor that lives on every rank of a mesh (Monarch's ``Tensor``).

It is a ``torch.Tensor`` subclass (a wrapper without storage) that knows its ``Ref``, its mesh and stream, the
``Storage`` it views (its aliases share one), and, made when first needed, a fake tensor
(``torch._subclasses.FakeTensor``) with the shape, dtype, strides and aliasing every rank's tensor has. Every torch operation on it runs on its mesh (``__torch_dispatch__``; spec §1 "Dispatch"), autograd included,
which runs on the controller and sends each backward op to the mesh. It pickles as its ``Ref``, so passing it to a
remote function sends the reference, and when the handle is garbage-collected the ref is freed on the workers
(``DeleteRefs``). ``drop()`` frees it at once; a dropped tensor cannot be used again (``DROPPED``).
"""

from __future__ import annotations

import threading
import traceback

import torch

from ..protocol import Ref
from .mesh import frontend, get_active_mesh
from .propagation import fake_view
from .storage import Storage, storage_of
from .dynamo_skip import skip_dynamo

__all__ = ["Tensor", "value_not_here"]


_make_wrapper = torch.Tensor._make_wrapper_subclass
_STRIDED = torch.strided


def value_not_here(what: str = "") -> TypeError:
    """The ``TypeError`` of reading a remote tensor's value on the controller (``what``: the call, e.g.
    ``"tolist()"``, put first), saying why under ``mesh.activate()`` (Monarch's ``_ActiveMesh`` runs every op on a
    local tensor but ``_local_scalar_dense`` on the mesh, so a fetched value indexed there is remote again)."""
    hint = "" if get_active_mesh() is None else (
        "; under mesh.activate() a torch op on a local tensor (a fetched value too: inspect(t)[0], "
        "inspect(t).sum()) runs on the mesh and gives a remote tensor, as in Monarch: read a fetched value "
        "under dask_monarch.no_mesh.activate() or after the block")
    return TypeError(
        f"{what + ': ' if what else ''}the value of a remote dask_monarch.Tensor is not on the controller (bool(), "
        "item(), int(), tolist(), numpy() and control flow on it need it); fetch it with dask_monarch.inspect(t) or "
        "fetch_shard(t).result()" + hint
    )


def _make(cls, size, stride, offset, dtype, device, requires_grad, layout):
    return torch.Tensor._make_wrapper_subclass(cls, size, strides=stride, storage_offset=offset, device=device,
                                               dtype=dtype, layout=layout, requires_grad=requires_grad)


class Tensor(torch.Tensor):
    """A remote tensor: ``ref`` on ``mesh``'s ranks, on ``stream`` (a ``dask_monarch.Stream``). ``shape``/``dtype``/``device``/``stride()``
    are every rank's; ``_storage`` is the ``Storage`` it views (``storage.py``) and ``_fake`` its fake tensor on
    the controller, made when first needed. Fetch its value with ``dask_monarch.fetch_shard`` or ``inspect``;
    ``bool(t)``, ``t.item()``, ``t.tolist()`` and ``t.numpy()`` raise ``TypeError`` (the value is not on the
    controller)."""

    # ops reach __torch_dispatch__ directly; autograd still runs above it on the controller
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, ref: Ref, fake: torch.Tensor, mesh, stream):
        """The remote tensor ``ref`` with the metadata and storage of fake tensor ``fake``."""
        meta = (tuple(fake.shape), fake.stride(), fake.storage_offset(), fake.dtype, fake.device)
        t = _make(cls, *meta, fake.requires_grad, fake.layout)
        t.ref = ref
        t._storage = storage_of(fake)
        t._meta = meta  # (size, stride, storage offset, dtype, device), as the cache keys of calls use it
        t._fake_tensor = fake
        t.mesh = mesh
        t.stream = stream
        t._dropped_at = None
        mesh._session.track(t)
        return t

    def __init__(self, ref: Ref, fake: torch.Tensor, mesh, stream):
        pass

    @classmethod
    def viewing(cls, ref: Ref, storage: Storage, meta: tuple, requires_grad: bool, mesh, stream) -> "Tensor":
        """The remote tensor ``ref`` viewing ``storage`` with ``meta`` = ``(size, stride, storage offset, dtype,
        device)``, without a fake tensor yet (the fast path of a call whose shapes are cached)."""
        size, stride, offset, dtype, device = meta
        t = _make_wrapper(cls, size, strides=stride, storage_offset=offset, device=device, dtype=dtype,
                          layout=_STRIDED, requires_grad=requires_grad)  # _make, inline: the per-op path
        t.ref = ref
        t._storage = storage
        t._meta = meta
        t._fake_tensor = None
        t.mesh = mesh
        t.stream = stream
        t._dropped_at = None
        session = mesh._session
        if session.recorder is None:
            storage.add(t)  # Session.track, inline: no compiled function records
        else:
            session.track(t)
        return t

    @property
    def _fake(self):
        """The fake tensor (of the session's ``FakeTensorMode``) with this tensor's metadata, on its storage's meta
        storage (made now if this tensor has none yet)."""
        fake = self._fake_tensor
        if fake is None:
            size, stride, offset, dtype, device = self._meta
            fake = self._fake_tensor = fake_view(self.mesh._session.fake_mode, self._storage.meta(), offset, size,
                                                 stride, dtype, device)
        return fake

    @_fake.setter
    def _fake(self, fake) -> None:
        self._fake_tensor = fake
        self._storage = storage_of(fake)
        self._meta = (tuple(fake.shape), fake.stride(), fake.storage_offset(), fake.dtype, fake.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return frontend.run_op(func, args, kwargs or {})

    # ------------------------------------------------------------------------------------------------- .data
    @property
    def data(self):
        """A remote alias of this tensor outside autograd (``torch.Tensor.data``)."""
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value) -> None:
        """``t.data = value``, which ``nn.Module.to()``/``.double()``/``.cuda()`` do to every parameter: this handle
        keeps its ref, which on every rank now holds an alias of ``value`` (``DeleteRefs`` of the old value, then
        ``CallFunction(aten.alias)`` into the same ref). Raises ``TypeError`` (LOCAL_TENSOR, WRONG_MESH,
        WRONG_STREAM, DROPPED, BORROWED) for a value this handle cannot take."""
        frontend.assign_data(self, value)

    def __deepcopy__(self, memo):
        """``copy.deepcopy``: a remote copy of this tensor on the same mesh and stream (``clone()`` on every
        rank), as ``nn.Module`` deep copies do to parameters (``nn.TransformerEncoder`` copies its layer); a
        parameter's copy is a parameter that requires grad like it."""
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            copy = self.clone()
        copy.requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):
            copy._is_param = True
        memo[id(self)] = copy
        return copy

    # ---------------------------------------------------------------------------------------------- reductions
    def reduce(self, dims, reduction: str = "sum", scatter: bool = False, mesh=None, out: "Tensor | None" = None):
        """``dask_monarch.reduce`` of this tensor; see there (spec §1 ``t.reduce``)."""
        return frontend.reduce_one(self, dims, reduction, scatter, mesh, False, out)

    def reduce_(self, dims, reduction: str = "sum", scatter: bool = False, mesh=None) -> "Tensor":
        """In-place ``reduce``: this tensor holds the result afterwards, and is returned (spec §1)."""
        return frontend.reduce_one(self, dims, reduction, scatter, mesh, True, None)

    # ---------------------------------------------------------------------------------------------- movement
    def to_mesh(self, mesh, stream=None) -> "Tensor":
        """A copy of this tensor on ``mesh`` (on ``stream``, default this tensor's): ``dask_monarch.to_mesh``;
        see there (spec §1 "to_mesh")."""
        return frontend.to_mesh(self, self.mesh, mesh, stream)

    def slice_mesh(self, **selection):
        """This tensor restricted to ``self.mesh.slice(**selection)``, as the source of a ``.to_mesh(...)``
        (Monarch's ``MeshSliceTensor``; spec §1 "to_mesh")."""
        self.check_usable()
        return frontend.slice_mesh(self, self.mesh.slice(**selection))

    # ------------------------------------------------------------------------------------------------ lifetime
    @property
    def dropped(self) -> bool:
        return self._dropped_at is not None

    def drop(self) -> None:
        """Free this tensor and every alias of its storage on the workers now (Monarch's ``drop``). Using any of
        them afterwards raises ``TypeError`` ("DROPPED") naming where it was dropped. For a borrowed tensor that
        is its last use: the borrow ends (``Borrow.drop``), whose ``BorrowLastUse`` must precede the deletes."""
        session = self.mesh._session
        borrow = session.borrow_by_alias(self)
        if borrow is not None:
            borrow.drop()
            return
        where = "".join(traceback.format_stack(limit=8)[:-1])
        for alias in session.aliases_of([self]):
            if alias._dropped_at is None:
                alias._dropped_at = where
                alias.mesh._session.drop_ref(alias.ref.id, alias.mesh._rank_list, "_urgent_drop" in alias.__dict__)

    def check_usable(self) -> None:
        """``TypeError`` ("DROPPED", with where) if this tensor was dropped."""
        if self._dropped_at is not None:
            raise TypeError(f"DROPPED: tensor {self.ref!r} was dropped; it is dropped at:\n{self._dropped_at}")

    # ---------------------------------------------------------------------------------------------- plumbing
    def __monarch_ref__(self) -> int:
        return self.ref.id

    def tolist(self):
        """Raises ``TypeError`` (``value_not_here``): the values are on the ranks (torch's own message for a tensor
        subclass said only that subclasses are not supported)."""
        raise value_not_here("tolist()")

    def numpy(self, *, force: bool = False):
        """Raises ``TypeError`` (``value_not_here``), for ``np.asarray(t)`` too."""
        raise value_not_here("numpy()")

    def __reduce_ex__(self, protocol):
        return (Ref, (self.ref.id,))

    @skip_dynamo  # the collector may run it inside a torch.compile'd function (dynamo_skip.py)
    def __del__(self):
        try:
            if self._dropped_at is None:
                mesh = self.mesh
                mesh._session.drop_ref(self.ref.id, mesh._rank_list, "_urgent_drop" in self.__dict__)
        except Exception:
            pass

    def __repr__(self, *, tensor_contents=None) -> str:
        return (
            f"dask_monarch.Tensor({self.ref!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}, mesh={self.mesh.names}{', dropped' if self.dropped else ''})"
        )


# torch turns a TypeError raised inside a Python operator (``+``, ``+=``, ``==``, ...) into NotImplemented, so the
# client checks (WRONG_STREAM, DROPPED, MUTATING_BORROW, ...) became "unsupported operand type(s)", and ``x += 1``
# on a tensor that must not be written fell back to ``x = x + 1``. ``run_op`` notes the TypeError it raises; the
# operators below raise it instead of answering NotImplemented.
_raised = threading.local()


def note_type_error(error: TypeError) -> None:
    """Called by ``dispatch.run_op`` with the ``TypeError`` a remote operation raises."""
    _raised.error = error


def _operator(base, op=None):
    def operator(self, other):
        if op is not None:  # + - * /: straight to the mesh where torch would add nothing (dispatch.operator_call)
            result = frontend.operator_call(op, self, other)
            if result is not None:
                return result
        _raised.error = None
        result = base(self, other)
        if result is NotImplemented:
            error, _raised.error = getattr(_raised, "error", None), None
            if error is not None:
                raise error
        return result

    operator.__name__ = operator.__qualname__ = base.__name__
    OPERATORS.append(operator)
    return operator


_aten = torch.ops.aten
#: operators whose op torch's dispatcher hands ``__torch_dispatch__`` as ``op(self, other)`` for a remote or
#: Python-number ``other`` (``1 + x`` and ``0.5 * x`` included): they may skip the dispatcher
_DIRECT = {"add": _aten.add.Tensor, "radd": _aten.add.Tensor, "sub": _aten.sub.Tensor, "mul": _aten.mul.Tensor,
           "rmul": _aten.mul.Tensor, "truediv": _aten.div.Tensor}
#: the Python operators defined below (``dispatch.py`` marks them, as the dispatch itself, for Dynamo to skip)
OPERATORS: list = []


for _name in (
    "add and div eq floordiv ge gt le lshift lt matmul mod mul ne or pow rshift sub truediv xor "
    "iadd iand idiv ifloordiv ilshift imod imul ior ipow irshift isub itruediv ixor "
    "radd rand rdiv rfloordiv rlshift rmatmul rmod rmul ror rpow rrshift rsub rtruediv rxor"
).split():
    if hasattr(torch.Tensor, f"__{_name}__"):
        setattr(Tensor, f"__{_name}__", _operator(getattr(torch.Tensor, f"__{_name}__"), _DIRECT.get(_name)))
