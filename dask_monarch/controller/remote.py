"""``remote(fn, propagate=...)``: call a function on every rank of a mesh (spec §1 "remote").

The function is named by path when the workers can import it (torch ops, importable functions) and
cloudpickled otherwise. Output shapes come from running ``propagate`` (default: the function itself) on fake
tensors on the controller; inputs whose fake version changes are mutated, and every live alias of their
storage is sent in ``mutates``. Each call is one ``CallFunction``.
"""

from __future__ import annotations

import functools
import io
import marshal
import sys
import threading
import types
from collections import ChainMap

import cloudpickle
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..protocol import ArgsKwargs, CallFunction, Cloudpickle, FunctionPath, PickledValue, Ref, StreamRef
from ..protocol.function import resolve_path
from .local import propagating
from .mesh import DeviceMesh, frontend, get_active_mesh
from .process_group import RemoteProcessGroup
from .propagation import FRESH, INPUT, OF_INPUT, TENSOR, Plan, call_key
from .session import DEFAULT_STREAM
from .storage import Storage
from .stream import check_access, get_active_stream
from .tensor import Tensor

__all__ = ["remote", "Remote", "call_on_mesh", "function_of", "pack_leaves", "written_tensors"]

#: argument leaves that travel as they are in the batch; any other leaf is pickled at the call (``PickledValue``)
_WIRE_SAFE = frozenset((
    int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout,
    torch.memory_format, Ref, StreamRef,
))


def _is_none(x) -> bool:
    return x is None


def _is_test_module(module: str) -> bool:
    base = module.rsplit(".", 1)[-1]
    return base.startswith("test_") or base.endswith("_test") or base == "conftest"


def _importable_path(fn) -> str | None:
    """``"module.qualname"`` if the workers can import ``fn`` by that name (spec §1: not ``__main__``, not a
    pytest module, not a local function), else None."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname or _is_test_module(module):
        return None
    mod = sys.modules.get(module)
    obj = mod
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is fn or getattr(obj, "_remote_impl", None) is fn:  # a function decorated with @remote
        return f"{module}.{qualname}"
    name = getattr(fn, "__name__", None)
    if name and getattr(mod, name, None) is fn:  # builtins such as torch.zeros (qualname _VariableFunctionsClass.zeros)
        return f"{module}.{name}"
    return None


_BY_VALUE_LOCK = threading.Lock()


def _code_reduce(code: types.CodeType):
    """A code object, with its file name (cloudpickle writes ``"<dynamic-code>"``, so remote tracebacks named no
    file): ``marshal`` keeps every field, nested functions' code included. Controller and workers run the same
    Python version, as code travelling by value needs anyway."""
    return marshal.loads, (marshal.dumps(code),)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, keeping the source file of functions sent by value (``_code_reduce``)."""

    dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)


def dumps_by_value(fn) -> bytes:
    """``cloudpickle.dumps(fn)``, with ``fn``'s (and the functions it uses') file names kept, so that a traceback
    on a worker names the user's file and line."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=5).dump(fn)
    return buffer.getvalue()


def function_of(fn):
    """The ``ResolvableFunction`` for ``fn``: an ``OpOverload`` or dotted string -> ``FunctionPath``; an importable
    function -> its path; anything else (lambdas, closures, ``__main__``, functions of pytest modules, which the
    workers usually cannot import) -> ``Cloudpickle``, by value."""
    if isinstance(fn, str):
        if "." not in fn:
            raise ValueError(f"remote function paths must be fully qualified, got {fn!r}")
        return FunctionPath(fn)
    if isinstance(fn, torch._ops.OpOverload):
        return FunctionPath(f"torch.ops.{fn.namespace}.{fn._schema.name.split('::')[-1]}.{fn._overloadname}")
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return FunctionPath(f"torch.ops.{fn._qualified_op_name.replace('::', '.')}")
    if not callable(fn):
        raise TypeError(f"remote() needs a callable or a dotted path, got {type(fn).__name__}")
    path = _importable_path(fn)
    if path is not None:
        return FunctionPath(path)
    module_name = getattr(fn, "__module__", None) or ""
    module = sys.modules.get(module_name)
    if module is not None and _is_test_module(module_name):
        with _BY_VALUE_LOCK:  # cloudpickle's registry is process-wide: controllers in other threads share it
            cloudpickle.register_pickle_by_value(module)
            try:
                return Cloudpickle(dumps_by_value(fn))
            finally:
                cloudpickle.unregister_pickle_by_value(module)
    return Cloudpickle(dumps_by_value(fn))


def pack_leaves(leaves: list, where: str) -> list | None:
    """The argument leaves to send, with every leaf that is not a remote tensor, a mesh or a plain value pickled
    now (``PickledValue``): an unpicklable argument raises ``TypeError`` naming ``where`` at the call, and one the
    workers cannot unpickle fails only that call there. None if every leaf travels as it is."""
    packed = None
    for i, x in enumerate(leaves):
        if type(x) in _WIRE_SAFE or isinstance(x, (Tensor, DeviceMesh, RemoteProcessGroup)):
            continue
        if packed is None:
            packed = list(leaves)
        with propagating():  # pickling a local value (a local tensor, say) is local work, not mesh ops
            packed[i] = PickledValue.of(x, where)
    return packed


def _worker_view(x):
    return x.seen_from() if isinstance(x, (DeviceMesh, RemoteProcessGroup)) else x


def _as_views(out, args, kwargs):
    """``out`` with every leaf that is one of the (fake) input tensors replaced by a view of it. A remote
    function's result is a new ref on the workers even when it returns an argument (or its ``propagate`` does,
    ``propagate=lambda x: x`` meaning "the shape of x"; spec §9 tensor_engine): the result carries the call's
    failure and aliases the input, instead of being the input itself (what an in-place *op* returns)."""
    inputs = {id(x) for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)}
    if not inputs:
        return out
    return tree_map(lambda v: v.view(v.shape) if isinstance(v, torch.Tensor) and id(v) in inputs else v, out)


class Remote:
    """A function bound for remote execution; call it with tensors of a mesh (or under ``mesh.activate()``).

    Returns the function's result with every tensor leaf replaced by a remote ``Tensor`` (other leaves are the
    values ``propagate`` returned). Raises ``TypeError`` for a local ``torch.Tensor`` argument (LOCAL_TENSOR) or
    tensors of different meshes (WRONG_MESH), and ``ValueError`` without a mesh.
    """

    def __init__(self, fn, propagate=None):
        self._fn = fn
        self._propagate = propagate
        #: what a worker calls when it resolves this object's path (spec §2: ``_remote_impl``)
        self._remote_impl = fn
        self._function = None
        self._shapes_of = self._shapes  # one bound method: part of every call's cache key
        self.__name__ = getattr(fn, "__name__", str(fn))
        functools.update_wrapper(self, fn, updated=()) if callable(fn) else None

    @property
    def function(self):
        if self._function is None:
            with propagating():  # pickling fn (and the tensors it holds) is local work, not mesh ops
                self._function = function_of(self._fn)
        return self._function

    def _shapes(self, *args, **kwargs):
        if self._propagate == "inspect":
            return None
        if callable(self._propagate):
            return _as_views(self._propagate(*args, **kwargs), args, kwargs)
        fn = resolve_path(self._fn) if isinstance(self._fn, str) else self._fn
        # the function itself, which on the workers gets their DeviceMesh (mesh.dims["dp"].rank): here it gets
        # that mesh as the first rank sees it (Monarch learns shapes by running it on shard 0)
        args, kwargs = tree_map(_worker_view, (args, kwargs))
        return _as_views(fn(*args, **kwargs), args, kwargs)

    def __call__(self, *args, **kwargs):
        return call_on_mesh(self.function, self.__name__, self._shapes_of, args, kwargs)

    def __repr__(self) -> str:
        return f"remote({self._fn!r})"


def call_on_mesh(function, name: str, shapes, args: tuple, kwargs: dict, mesh=None, op=None):
    """Send one ``CallFunction`` of ``function`` with ``args``/``kwargs`` to a mesh and return its result with
    every tensor output a remote ``Tensor`` (spec §1 ``remote``, "Dispatch").

    ``shapes(*fake_args, **fake_kwargs)`` runs on the controller's fake tensors to learn output shapes, strides,
    aliasing and mutation: an input whose fake version changes is mutated (all live aliases of its storage go into
    ``mutates``); an output that *is* an input's fake (an in-place op) is that input ``Tensor`` itself, not a new
    ref. ``op`` is the ``OpOverload`` called, if any: the inputs its schema writes (``Tensor(a!)``: in-place and
    ``out=`` ops) are mutated besides (inside ``__torch_dispatch__`` the fakes' versions do not move). A second
    call with the same input metadata makes its outputs from the first one's ``Plan`` (``propagation.py``),
    without running ``shapes`` (for a torch op whose outputs view no input, also with its inputs at other storage
    offsets). The mesh is the remote tensors' mesh, else ``mesh``, else the active mesh; the
    stream is the active stream (``controller/stream.py``: its checks run before anything is sent).
    """
    # a torch op's FunctionPath follows from the op: the key leaves it out (its hash is a Python call)
    key, inputs = call_key(None if op is not None else function, shapes, args, kwargs, Tensor, DeviceMesh)
    if key is not None and inputs:
        mesh = inputs[0].mesh
        for x in inputs:
            if x.mesh is not mesh:
                mesh = None  # _mesh_of checks them, and says what is wrong
                break
        if mesh is not None:
            for x in inputs:
                if x._dropped_at is not None:
                    x.check_usable()  # TypeError DROPPED
            propagator = mesh._session.propagator
            plan = propagator.plan(key)
            if plan is None and op is not None:  # the same op on inputs at other offsets (x[rows] each step)
                plan = propagator.plan_at_other_offsets(key)
            if plan is not None:
                groups = _groups_in(args, kwargs) if plan.groups else ()
                if all(g.mesh._session is mesh._session for g in groups):  # else _mesh_of says what is wrong
                    return _issue(plan, function, name, args, kwargs, inputs, mesh, groups)
    return _call(function, name, shapes, args, kwargs, mesh, op, key)


def _groups_in(args: tuple, kwargs: dict) -> list:
    """The ``RemoteProcessGroup`` arguments of a call."""
    return [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, RemoteProcessGroup)]


def _issue(plan: Plan, function, name: str, args: tuple, kwargs: dict, inputs: list, mesh, groups=()):
    """Send the ``CallFunction`` of a call whose outputs ``plan`` describes, with the process groups ``groups``
    among its arguments (each split on the call's stream first); returns its result."""
    session = mesh._session
    stream = get_active_stream()
    with session.lock:
        if session.failure is not None or session.closed:
            session.check_ok()  # raises
        stream_ref = DEFAULT_STREAM if stream.default else stream.ref_for(session)
        if torch.get_default_dtype() is not session.default_dtype:
            session.follow_default_dtype(stream_ref)
        written = [inputs[i] for i in plan.written] if plan.written else ()
        check_access(stream, inputs, written)
        mutates = session.aliases_of(written) if written else ()
        results, values, new = [], [], []
        for step in plan.steps:
            kind = step[0]
            if kind == TENSOR:
                _, meta, requires_grad, where, which = step
                if where == FRESH:
                    storage = Storage(which)
                else:
                    storage = (inputs[which] if where == OF_INPUT else values[which])._storage
                t = Tensor.viewing(session.new_ref(), storage, meta, requires_grad, mesh, stream)
                results.append(t.ref)
                values.append(t)
                new.append(t)
            else:
                results.append(None)
                values.append(inputs[step[1]] if kind == INPUT else step[1])
        for group in groups:  # its communicator on this stream is built on its ranks before the call
            group.ensure_split(stream_ref)
        seq = session.new_seq()
        message = CallFunction(  # empty fields as the () singleton: fewer objects for the worker's GC to track
            seq, results, tuple([t.ref for t in mutates]) if mutates else (), function,
            ArgsKwargs(tuple(args), dict(kwargs)), stream_ref, tuple([g.ref for g in groups]) if groups else (),
        )
        session.record(seq, defs=new + mutates if mutates else new, uses=inputs, what=name)
        session.send(message, mesh._rank_list)
    return values[0] if plan.spec is None else tree_unflatten(values, plan.spec)


def _call(function, name: str, shapes, args, kwargs, mesh, op, key):
    """``call_on_mesh`` without a plan: check the arguments, run ``shapes`` on fakes, record a plan if the call can
    be cached (``key``), and send the call."""
    leaves, spec = tree_flatten((args, kwargs))
    mesh = _mesh_of(leaves, mesh)
    session = mesh._session
    packed = pack_leaves(leaves, name)
    sent_args, sent_kwargs = (args, kwargs) if packed is None else tree_unflatten(packed, spec)
    inputs = []
    fake_leaves = []
    groups = [x for x in leaves if isinstance(x, RemoteProcessGroup)]
    for x in leaves:
        if isinstance(x, Tensor):
            x.check_usable()
            inputs.append(x)
            fake_leaves.append(x._fake)
        elif isinstance(x, torch.Tensor):
            fake_leaves.append(session.fake_mode.from_tensor(x))  # a local value (checked by _mesh_of), sent by value
        else:
            if isinstance(x, DeviceMesh):
                x.define_remotely()
            fake_leaves.append(x)
    fake_args, fake_kwargs = tree_unflatten(fake_leaves, spec)
    writes = written_tensors(op, args, kwargs) if op is not None else ()
    written_inputs = [i for i, t in enumerate(inputs) if any(t is w for w in writes)]
    stream = get_active_stream()
    with session.lock:
        session.check_ok()
        stream_ref = stream.ref_for(session)
        try:
            with propagating():
                out, mutated, plan = session.propagator.run(key, shapes, fake_args, fake_kwargs,
                                                            [t._fake for t in inputs], written_inputs, op is not None)
        except Exception as e:
            if op is not None:  # a torch op: its own error, as torch gives it locally (a shape mismatch, a dtype)
                raise
            raise _with_hint(
                e,
                f"computing the output shapes of {name} on fake tensors failed ({e}); pass propagate= to remote() "
                "with a function that returns outputs of the right shapes",
            ) from e
        if plan is not None:
            plan.groups = bool(groups)
            return _issue(plan, function, name, tuple(sent_args), sent_kwargs, inputs, mesh, groups)
        written = list({id(t): t for t in [inputs[i] for i in mutated] + list(writes)}.values())
        check_access(stream, inputs, written)
        mutates = session.aliases_of(written)
        results, values, new, out_spec = remote_outputs(out, inputs, session, mesh, stream, name)
        session.follow_default_dtype(stream_ref)
        for group in groups:  # its communicator on this stream is built on its ranks before the call
            group.ensure_split(stream_ref)
        seq = session.new_seq()
        message = CallFunction(
            seq, results, tuple(t.ref for t in mutates), function, ArgsKwargs(tuple(sent_args), dict(sent_kwargs)),
            stream_ref, tuple(g.ref for g in groups) if groups else (),
        )
        session.record(seq, defs=new + mutates, uses=inputs, what=name)
        session.send(message, mesh._rank_list)
    return tree_unflatten(values, out_spec)


def remote_outputs(out, inputs: list, session, mesh, stream, name: str) -> tuple:
    """``(result refs, values, new Tensors, spec)`` for the fake outputs ``out`` of a call with remote inputs
    ``inputs``: each fake output becomes a new remote ``Tensor`` (its ref in ``results``), an output that is an
    input's fake is that input itself (in place: no ref), other leaves stay as they are. ``TypeError`` for a real
    tensor among them (``propagate`` must return fakes)."""
    by_fake = {id(t._fake): t for t in inputs}
    out_leaves, out_spec = tree_flatten(out, is_leaf=_is_none)
    results, values, new = [], [], []
    for leaf in out_leaves:
        same = by_fake.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
        if same is not None:  # the call returned its input (in place): no new ref
            results.append(None)
            values.append(same)
        elif isinstance(leaf, FakeTensor):
            t = Tensor(session.new_ref(), leaf, mesh, stream)
            results.append(t.ref)
            values.append(t)
            new.append(t)
        elif isinstance(leaf, torch.Tensor):
            raise TypeError(f"propagate for {name} returned a real tensor; it must return fake tensors")
        else:
            results.append(None)
            values.append(leaf)
    return results, values, new, out_spec


def written_tensors(func, args, kwargs) -> list:
    """The remote tensors that ``func`` (an ``OpOverload``) writes, from its schema's alias annotations
    (``Tensor(a!)``): in-place and ``out=`` ops. Under ``__torch_dispatch__`` the fake tensors' version counters do
    not move, so the propagation cannot see these writes."""
    written = _writes.get(func)
    if written is None:
        written = _writes[func] = tuple(
            (i, a.name, a.kwarg_only) for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
    found = []
    for i, name, kwarg_only in written:
        value = args[i] if i < len(args) and not kwarg_only else kwargs.get(name)
        found.extend(x for x in tree_flatten(value)[0] if isinstance(x, Tensor))
    return found


_writes: dict = {}  # OpOverload -> (position, name, kwarg_only) of the arguments it writes


def _with_hint(error: Exception, text: str) -> Exception:
    try:
        return type(error)(text)
    except Exception:
        return RuntimeError(text)


def _wrong_session(what: str, mesh, other) -> TypeError:
    return TypeError(
        f"WRONG_MESH: {what} belongs to another session ({other._session.tag}) than the mesh it runs on "
        f"({mesh!r}); a session's tensors and meshes can only be used in that session"
    )


#: how to move an ``nn.Module`` made outside ``mesh.activate()`` onto the mesh, keeping its values: under
#: ``activate()`` an operation on local tensors alone runs on the mesh, their values sent with it (``dispatch.py``)
_MOVE_MODULE = ("with mesh.activate(): model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, "
                "assign=True)")


def _local_tensor(local: torch.Tensor) -> TypeError:
    """The LOCAL_TENSOR error for ``local`` mixed with remote tensors; a module's parameter (``nn.Parameter``,
    say of an ``nn.Linear`` made before ``activate()``, whose shape alone would not tell) is named as one."""
    what = f"shape {tuple(local.shape)}, dtype {local.dtype}"
    if isinstance(local, torch.nn.Parameter):
        return TypeError(
            f"LOCAL_TENSOR: a local nn.Parameter ({what}) is mixed with remote tensors: module parameters created "
            "outside mesh.activate() are local tensors. Create the module under `with mesh.activate():` (its "
            f"parameters are then made on every rank), or move its values onto the mesh: `{_MOVE_MODULE}`"
        )
    return TypeError(
        f"LOCAL_TENSOR: a local torch.Tensor is mixed with remote tensors ({what}); create it on the mesh (under "
        "mesh.activate()) instead"
    )


def _mesh_of(leaves, default: DeviceMesh | None = None) -> DeviceMesh:
    """The mesh a call runs on: its tensor arguments' mesh, else the active mesh, else a mesh argument. Every
    tensor and mesh argument must belong to that mesh's session (their refs mean nothing in another). Spec §1's
    client checks: ``TypeError`` WRONG_MESH for tensors of two meshes or another session, LOCAL_TENSOR for a local
    tensor (other than a 0-d scalar) mixed with remote ones."""
    mesh = None
    local = None
    for x in leaves:
        if isinstance(x, Tensor):
            if mesh is None:
                mesh = x.mesh
            elif x.mesh._session is not mesh._session:
                raise _wrong_session(f"tensor {x.ref}", mesh, x.mesh)
            elif x.mesh is not mesh and x.mesh._rank_list != mesh._rank_list:
                raise TypeError(
                    f"WRONG_MESH: tensors of different meshes in one call: {mesh!r} and {x.mesh!r}"
                )
        elif isinstance(x, torch.Tensor) and x.dim() > 0 and local is None:
            local = x
    if local is not None and mesh is not None:
        raise _local_tensor(local)
    if mesh is None:
        mesh = default or get_active_mesh()
    if mesh is None:
        for x in leaves:
            if isinstance(x, (DeviceMesh, RemoteProcessGroup)):
                mesh = x if isinstance(x, DeviceMesh) else x.mesh
                break
        else:
            raise ValueError("no mesh: pass a remote tensor or a DeviceMesh, or call inside `with mesh.activate():`")
    for x in leaves:
        if isinstance(x, DeviceMesh) and x._session is not mesh._session:
            raise _wrong_session(f"mesh argument {x!r}", mesh, x)
        if isinstance(x, RemoteProcessGroup) and x.mesh._session is not mesh._session:
            raise _wrong_session(f"process group argument {x!r}", mesh, x.mesh)
    return mesh


def remote(fn=None, *, propagate=None):
    """Make ``fn`` callable on a mesh (Monarch's ``remote``). Usable as ``remote(fn)``, ``remote("pkg.mod.fn")``,
    ``remote(torch.ops.aten.add.Tensor)`` or as a decorator ``@remote(propagate=...)``.

    ``propagate``: None runs ``fn`` itself on fake tensors to learn output shapes, with each ``DeviceMesh``
    argument as the workers get it, seen from the mesh's first rank (``mesh.dims["dp"].rank`` is 0); a callable
    is run instead, with the same arguments (meshes as the controller's ``DeviceMesh``: ``mesh.size("dp")``), and
    must return fake tensors of the output shapes, e.g. with ``torch.empty``; ``"inspect"`` means no tensor
    outputs (the function returns nothing, or values the controller does not need).
    """
    if fn is None:
        return lambda f: remote(f, propagate=propagate)
    if isinstance(fn, str):
        function_of(fn)  # a path without a dot fails now, not at the first call
    elif not callable(fn):
        raise TypeError(f"remote() needs a callable or a dotted path, got {type(fn).__name__}")
    return Remote(fn, propagate)


frontend.remote = remote
