"""``Tensor``: the controller's handle to a tensor that lives on every rank of a mesh (Monarch's ``Tensor``).

It is a ``torch.Tensor`` subclass (a wrapper without storage) that knows its ``Ref``, its mesh and stream, and a
fake tensor (``torch._subclasses.FakeTensor``) with the shape, dtype, strides and aliasing every rank's tensor
has. Every torch operation on it runs on its mesh (``__torch_dispatch__``; spec §1 "Dispatch"), autograd included,
which runs on the controller and sends each backward op to the mesh. It pickles as its ``Ref``, so passing it to a
remote function sends the reference, and when the handle is garbage-collected the ref is freed on the workers
(``DeleteRefs``). ``drop()`` frees it at once; a dropped tensor cannot be used again (``DROPPED``).
"""

from __future__ import annotations

import threading
import traceback

import torch

from ..protocol import Ref

__all__ = ["Tensor"]


class Tensor(torch.Tensor):
    """A remote tensor: ``ref`` on ``mesh``'s ranks, on ``stream`` (a ``dask_monarch.Stream``). ``shape``/``dtype``/``device``/``stride()``
    come from the controller's fake tensor ``_fake``. Fetch its value with ``dask_monarch.fetch_shard`` or
    ``inspect``; ``bool(t)`` and ``t.item()`` raise ``TypeError`` (the value is not on the controller)."""

    # ops reach __torch_dispatch__ directly; autograd still runs above it on the controller
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, ref: Ref, fake: torch.Tensor, mesh, stream):
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            fake.size(),
            strides=fake.stride(),
            storage_offset=fake.storage_offset(),
            device=fake.device,
            dtype=fake.dtype,
            layout=fake.layout,
            requires_grad=fake.requires_grad,
        )
        t.ref = ref
        t._fake = fake
        t.mesh = mesh
        t.stream = stream
        t._dropped_at = None
        mesh._session.track(t)
        return t

    def __init__(self, ref: Ref, fake: torch.Tensor, mesh, stream):
        pass

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from .dispatch import run_op

        return run_op(func, args, kwargs or {})

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
        from ..protocol import ArgsKwargs, CallFunction, DeleteRefs
        from .dispatch import op_path, propagating
        from .stream import check_access

        if not isinstance(value, Tensor):
            raise TypeError(
                f"LOCAL_TENSOR: cannot set .data of remote tensor {self.ref!r} to a local {type(value).__name__}"
            )
        if value.mesh._session is not self.mesh._session or value.mesh._rank_list != self.mesh._rank_list:
            raise TypeError(f"WRONG_MESH: cannot set .data of {self.ref!r} ({self.mesh!r}) to a tensor of {value.mesh!r}")
        self.check_usable()
        value.check_usable()
        session = self.mesh._session
        alias = torch.ops.aten.alias.default
        with session.lock:
            session.check_ok()
            check_access(self.stream, [value, self], [self])
            with propagating(), session.fake_mode:
                fake = alias(value._fake)  # shares value's fake storage: the two are aliases from now on
            ranks = self.mesh._rank_list
            # the ref keeps its id (messages already queued pickle it when they are sent), so it is freed and
            # written again, in that order, on every rank
            session.send(DeleteRefs([self.ref]), ranks)
            seq = session.new_seq()
            session.record(seq, defs=[self], uses=[value], what=".data assignment")
            session.send(
                CallFunction(seq, [self.ref], (), op_path(alias), ArgsKwargs((value,), {}),
                             self.stream.ref_for(session), ()),
                ranks,
            )
            torch.Tensor.data.__set__(self, value)  # shape, strides, dtype and device, as torch does
            old_fake, self._fake = self._fake, fake
            session.retrack(self, old_fake)

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
        from .reduce import reduce_one

        return reduce_one(self, dims, reduction, scatter, mesh, False, out)

    def reduce_(self, dims, reduction: str = "sum", scatter: bool = False, mesh=None) -> "Tensor":
        """In-place ``reduce``: this tensor holds the result afterwards, and is returned (spec §1)."""
        from .reduce import reduce_one

        return reduce_one(self, dims, reduction, scatter, mesh, True, None)

    # ---------------------------------------------------------------------------------------------- movement
    def to_mesh(self, mesh, stream=None) -> "Tensor":
        """A copy of this tensor on ``mesh`` (on ``stream``, default this tensor's): ``dask_monarch.to_mesh``;
        see there (spec §1 "to_mesh")."""
        from .to_mesh import send

        return send(self, self.mesh, mesh, stream)

    def slice_mesh(self, **selection):
        """This tensor restricted to ``self.mesh.slice(**selection)``, as the source of a ``.to_mesh(...)``
        (Monarch's ``MeshSliceTensor``; spec §1 "to_mesh")."""
        from .to_mesh import MeshSliceTensor

        self.check_usable()
        return MeshSliceTensor(self, self.mesh.slice(**selection))

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
                alias.mesh._session.drop_ref(alias.ref.id, alias.mesh._rank_list)

    def check_usable(self) -> None:
        """``TypeError`` ("DROPPED", with where) if this tensor was dropped."""
        if self._dropped_at is not None:
            raise TypeError(f"DROPPED: tensor {self.ref!r} was dropped; it is dropped at:\n{self._dropped_at}")

    # ---------------------------------------------------------------------------------------------- plumbing
    def __monarch_ref__(self) -> int:
        return self.ref.id

    def __reduce_ex__(self, protocol):
        return (Ref, (self.ref.id,))

    def __del__(self):
        try:
            if self._dropped_at is None:
                mesh = self.mesh
                mesh._session.drop_ref(self.ref.id, mesh._rank_list)
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


def _operator(base):
    def operator(self, other):
        _raised.error = None
        result = base(self, other)
        if result is NotImplemented:
            error, _raised.error = getattr(_raised, "error", None), None
            if error is not None:
                raise error
        return result

    operator.__name__ = operator.__qualname__ = base.__name__
    return operator


for _name in (
    "add and div eq floordiv ge gt le lshift lt matmul mod mul ne or pow rshift sub truediv xor "
    "iadd iand idiv ifloordiv ilshift imod imul ior ipow irshift isub itruediv ixor "
    "radd rand rdiv rfloordiv rlshift rmatmul rmod rmul ror rpow rrshift rsub rtruediv rxor"
).split():
    if hasattr(torch.Tensor, f"__{_name}__"):
        setattr(Tensor, f"__{_name}__", _operator(getattr(torch.Tensor, f"__{_name}__")))
