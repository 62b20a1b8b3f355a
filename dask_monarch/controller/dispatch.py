"""Torch operations on the mesh (spec §1 "Dispatch").

* Every operation on a remote ``Tensor`` reaches ``Tensor.__torch_dispatch__`` and runs on its tensors' mesh.
* Under ``mesh.activate()`` a ``TorchDispatchMode`` makes every other torch operation remote too, factories
  included (``torch.randn``, ``torch.zeros``, ``torch.arange``, ``nn.Linear``'s parameters), except profiler
  bookkeeping and ``aten._local_scalar_dense`` / ``aten.set_.source_Storage_storage_offset`` on local tensors,
  and ``aten.detach`` of a local tensor (our decision, not Monarch's: it is how ``.numpy()``, ``np.asarray`` and
  ``state_dict()`` read a local tensor, and made remote it left ``.numpy()`` reading memory never written).
  ``no_mesh.activate()`` runs torch locally again.

Each operation is one ``CallFunction`` of the op's ``torch.ops`` path, with output shapes, strides and aliasing
from the op run on fake tensors on the controller (``remote.call_on_mesh``).

``Tensor``'s ``+``, ``-``, ``*`` and ``/`` with a remote tensor or a Python int or float send their op from the
operator itself (``operator_call``) where torch's dispatcher would hand our handler that very op and add nothing
of its own: no autograd to record, no other mode or transform, no profiler, and a cached plan. torch's way into a
Python mode costs more than the rest of the op (issue 27; BENCHMARKS.md "Per-op controller time").
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad
import torch.autograd.profiler
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..protocol import ArgsKwargs, CallFunction, DeleteRefs, FunctionPath
from .dynamo_skip import set_code_exec_strategy, skip_dynamo
from .issue import call_cached
from .local import is_propagating, propagating
from .mesh import frontend, get_active_mesh
from .remote import call_on_mesh
from .stream import check_access
from .tensor import OPERATORS, Tensor, note_type_error, value_not_here

__all__ = ["MeshDispatchMode", "assign_data", "operator_call", "run_op", "skip_dynamo"]

_aten = torch.ops.aten
#: operations that stay local on local tensors even under an active mesh (spec §1)
_LOCAL_OPS = frozenset((_aten._local_scalar_dense.default, _aten.set_.source_Storage_storage_offset,
                        _aten.detach.default))
_LOCAL_NAMESPACES = frozenset(("profiler",))
#: per ``OpOverload``: (``FunctionPath``, name, whether it runs on the controller when no remote tensor is among its
#: arguments under an active mesh)
_ops: dict = {}


def _op(func) -> tuple:
    entry = _ops.get(func)
    if entry is None:
        name = func._schema.name.split("::")[-1]
        path = FunctionPath(f"torch.ops.{func.namespace}.{name}.{func._overloadname}")
        local = func.namespace in _LOCAL_NAMESPACES or func in _LOCAL_OPS
        entry = _ops[func] = (path, str(func), local)
    return entry


def op_path(func) -> FunctionPath:
    """``FunctionPath("torch.ops.<namespace>.<op>.<overload>")`` of an ``OpOverload`` (cached)."""
    return _op(func)[0]


def run_op(func, args, kwargs, mesh=None, entry=None):
    """Run ``func(*args, **kwargs)`` on the mesh of its remote tensors (else ``mesh``, else the active mesh);
    ``entry`` is ``func``'s ``_ops`` entry if the caller has it."""
    if func is _LOCAL_SCALAR:
        raise value_not_here()
    path, name, _ = entry or _ops.get(func) or _op(func)
    try:
        return call_on_mesh(path, name, func, args, kwargs, mesh, func)
    except TypeError as e:
        note_type_error(e)  # for the Python operators, where torch would hide it (tensor.py)
        raise


_LOCAL_SCALAR = _aten._local_scalar_dense.default




class MeshDispatchMode(TorchDispatchMode):
    """Entered by ``mesh.activate()``: torch operations on local tensors and factories run on the active mesh.
    Dynamo skips ``__torch_dispatch__`` and everything it calls (``skip_dynamo``; torch's default is a
    ``torch._disable_dynamo`` wrapper around it): a ``torch.compile``d function called under ``activate()`` runs its
    ops here eagerly."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # torch: wrap __torch_dispatch__ in torch._disable_dynamo
        return set_code_exec_strategy is None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mesh = get_active_mesh()
        if mesh is None or is_propagating():
            return func(*args, **kwargs)
        entry = _ops.get(func) or _op(func)
        if entry[2]:  # profiler bookkeeping, and local reads of local tensors
            if func.namespace in _LOCAL_NAMESPACES or not _has_remote(args):
                return func(*args, **kwargs)
        return run_op(func, args, kwargs, mesh, entry)


_grad_enabled = torch.is_grad_enabled
_function_modes = torch._C._is_torch_function_mode_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_dispatch_mode_at = torch._C._get_dispatch_stack_at
_transforms = torch._C._functorch.peek_interpreter_stack
_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_jit_tracing = torch._C._get_tracing_state
_PYTHON_KEY = torch._C.DispatchKey.Python
_forward_ad = torch.autograd.forward_ad
_profiler = torch.autograd.profiler


def operator_call(op, tensor: Tensor, other):
    """``op(tensor, other)`` (``aten.add.Tensor``, ``sub.Tensor``, ``mul.Tensor`` or ``div.Tensor``: what torch's
    dispatcher hands ``__torch_dispatch__`` for ``tensor + other`` and the like, ``other`` a remote ``Tensor`` or a
    Python int or float), sent to the mesh without going through torch, if torch would add nothing to it:
    ``tensor`` is exactly a ``Tensor``, no input needs autograd (or grad mode is off), no torch function mode,
    no dispatch mode but ``MeshDispatchMode``, no functorch transform or forward-AD level, no profiler or JIT
    tracer, torch dispatch not disabled, not propagating, and the call's plan is cached (``issue.call_cached``). (Autocast has
    no rule for these ops.) Returns the result, or None where torch's way must run (nothing sent then). Raises
    what the cached call raises (``TypeError`` DROPPED, WRONG_STREAM)."""
    kind = type(other)
    if kind is Tensor:
        if (tensor.requires_grad or other.requires_grad) and _grad_enabled():
            return None
    elif kind is int or kind is float:
        if tensor.requires_grad and _grad_enabled():
            return None
    else:
        return None
    if (type(tensor) is not Tensor or _function_modes() or is_propagating() or _profiler._is_profiler_enabled
            or _forward_ad._current_level >= 0 or _transforms() is not None or _excluded(_PYTHON_KEY)
            or _jit_tracing() is not None):
        return None
    modes = _dispatch_modes()
    if modes and (modes > 1 or type(_dispatch_mode_at(0)) is not MeshDispatchMode):
        return None
    path, name, _ = _ops.get(op) or _op(op)
    return call_cached(op, path, name, (tensor, other))


# the mode's handler, and a remote tensor's op (its Python operator, its handler) called from a frame Dynamo runs
for _fn in (MeshDispatchMode.__torch_dispatch__, Tensor.__torch_dispatch__.__func__, run_op, *OPERATORS):
    skip_dynamo(_fn)


def _has_remote(args) -> bool:
    return any(isinstance(x, Tensor) for x in tree_flatten(args)[0])


def assign_data(tensor: Tensor, value) -> None:
    """``tensor.data = value``, which ``nn.Module.to()``/``.double()``/``.cuda()`` do to every parameter: the handle
    keeps its ref, which on every rank now holds an alias of ``value`` (``DeleteRefs`` of the old value, then
    ``CallFunction(aten.alias)`` into the same ref). Raises ``TypeError`` (LOCAL_TENSOR, WRONG_MESH,
    WRONG_STREAM, DROPPED, BORROWED) for a value the handle cannot take."""
    if not isinstance(value, Tensor):
        raise TypeError(
            f"LOCAL_TENSOR: cannot set .data of remote tensor {tensor.ref!r} to a local {type(value).__name__}"
        )
    if value.mesh._session is not tensor.mesh._session or value.mesh._rank_list != tensor.mesh._rank_list:
        raise TypeError(f"WRONG_MESH: cannot set .data of {tensor.ref!r} ({tensor.mesh!r}) to a tensor of {value.mesh!r}")
    tensor.check_usable()
    value.check_usable()
    session = tensor.mesh._session
    alias = torch.ops.aten.alias.default
    with session.lock:
        session.check_ok()
        check_access(tensor.stream, [value, tensor], [tensor])
        with propagating(), session.fake_mode:
            fake = alias(value._fake)  # shares value's fake storage: the two are aliases from now on
        ranks = tensor.mesh._rank_list
        # the ref keeps its id (messages already queued pickle it when they are sent), so it is freed and
        # written again, in that order, on every rank
        session.send(DeleteRefs([tensor.ref]), ranks)
        seq = session.new_seq()
        session.record(seq, defs=[tensor], uses=[value], what=".data assignment")
        session.send(
            CallFunction(seq, [tensor.ref], (), op_path(alias), ArgsKwargs((value,), {}),
                         tensor.stream.ref_for(session), ()),
            ranks,
        )
        torch.Tensor.data.__set__(tensor, value)  # shape, strides, dtype and device, as torch does
        old_storage = tensor._storage
        tensor._fake = fake
        session.retrack(tensor, old_storage)


frontend.dispatch_mode = MeshDispatchMode
frontend.run_op = run_op
frontend.operator_call = operator_call
frontend.assign_data = assign_data
