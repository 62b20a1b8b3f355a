"""``remote(fn, propagate=...)``: call a function on every rank of a mesh (spec §1 "remote").

The function is named by path when the workers can import it (torch ops, importable functions) and
cloudpickled otherwise. Output shapes come from running ``propagate`` (default: the function itself) on fake
tensors on the controller; inputs whose fake version changes are mutated, and every live alias of their
storage is sent in ``mutates``. Where the function itself cannot run on fake tensors (it reads values: ``.item()``,
data-dependent shapes; or the controller cannot import it), its outputs are learned by running it once on the
mesh's first rank, as Monarch learns them (``cached_propagation.py``). Each call is one ``CallFunction``.
``remote(f).call(*args)`` and ``call_on_shard_and_fetch`` fetch the function's values instead (``fetch.py``).
"""

from __future__ import annotations

import functools
import os
import sys
import traceback

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..protocol import ArgsKwargs, CallFunction, PickledValue, Ref, StreamRef
from ..protocol.function import resolve_path
from .issue import MISS, cached, issue
from .functions import dumps_by_value, function_of  # noqa: F401 (dumps_by_value: imported from here too)
from .local import propagating
from .mesh import DeviceMesh, frontend, get_active_mesh
from .process_group import RemoteProcessGroup
from .propagation import call_key
from .stream import check_access, get_active_stream
from .tensor import Tensor

__all__ = ["remote", "Remote", "LearnOnMesh", "call_on_mesh", "function_of", "pack_leaves", "propagate_failed",
           "sendable", "user_line", "written_tensors"]

#: argument leaves that travel as they are in the batch; any other leaf is pickled at the call (``PickledValue``)
_WIRE_SAFE = frozenset((
    int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout,
    torch.memory_format, Ref, StreamRef,
))


def _is_none(x) -> bool:
    return x is None


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


def sendable(leaves: list, spec, args: tuple, kwargs: dict, where: str) -> tuple:
    """``(remote tensor arguments, args, kwargs as sent)`` of a call whose flattened arguments are ``leaves``
    (``spec``): each remote tensor checked (``TypeError`` DROPPED), each mesh defined on the workers, the other
    values pickled now (``pack_leaves``, naming ``where``)."""
    inputs = []
    for x in leaves:
        if isinstance(x, Tensor):
            x.check_usable()
            inputs.append(x)
        elif isinstance(x, DeviceMesh):
            x.define_remotely()
    packed = pack_leaves(leaves, where)
    sent_args, sent_kwargs = (args, kwargs) if packed is None else tree_unflatten(packed, spec)
    return inputs, sent_args, sent_kwargs


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
        if self._propagate == "cached":
            raise LearnOnMesh("propagate='cached'")
        if callable(self._propagate):
            return _as_views(self._propagate(*args, **kwargs), args, kwargs)
        fn = resolve_path(self._fn) if isinstance(self._fn, str) else self._fn
        # the function itself, which on the workers gets their DeviceMesh (mesh.dims["dp"].rank): here it gets
        # that mesh as the first rank sees it (Monarch learns shapes by running it on shard 0)
        args, kwargs = tree_map(_worker_view, (args, kwargs))
        return _as_views(fn(*args, **kwargs), args, kwargs)

    def __call__(self, *args, **kwargs):
        learn = self._propagate is None or self._propagate == "cached"
        return call_on_mesh(self.function, self.__name__, self._shapes_of, args, kwargs, learn=learn, check=True)

    def call(self, *args, **kwargs):
        """Run the function on every rank of the mesh and fetch what each returns (Monarch's ``Remote.call``): a
        ``MonarchFuture`` whose ``result()`` / ``get()`` is a ``ValueMesh`` of the ranks' values (tensors as CPU
        copies), ``.item(dp=1)``, iterated as ``(point, value)`` in rank order (``fetch.py``)."""
        return frontend.fetch_call(self, args, kwargs, None, True)

    def call_one(self, *args, **kwargs):
        """``call`` on a mesh of one rank (a sliced one): a future of that rank's value (Monarch's ``call_one``).
        ``ValueError`` on a mesh of more ranks."""
        return frontend.fetch_call(self, args, kwargs, None, False)

    def call_on_shard_and_fetch(self, *args, shard: dict | None = None, **kwargs):
        """Run the function on one rank (``shard``: dim -> coordinate; default the mesh's first rank) and fetch its
        value: a ``MonarchFuture`` (Monarch's ``call_on_shard_and_fetch``; ``fetch.py``)."""
        return frontend.fetch_call(self, args, kwargs, {} if shard is None else shard, False)

    def writes(self, args: tuple, kwargs: dict) -> list:
        """The remote tensors among the arguments that ``propagate`` (a callable) writes, run on fake tensors; [] for
        no ``propagate`` (Monarch's fetch propagation assumes no writes then). A ``propagate`` that raises raises
        here, with its source line."""
        if not callable(self._propagate):
            return []
        leaves, spec = tree_flatten((args, kwargs))
        inputs = [x for x in leaves if isinstance(x, Tensor)]
        if not inputs:
            return []
        session = inputs[0].mesh._session
        fake_args, fake_kwargs = tree_unflatten(_fakes(leaves, session), spec)
        with session.lock, propagating(), torch.no_grad():
            try:
                _, mutated, _ = session.propagator.run(None, self._propagate, fake_args, fake_kwargs,
                                                       [t._fake for t in inputs])
            except Exception as e:
                raise propagate_failed(e, self.__name__) from e
        return [inputs[i] for i in mutated]

    def __repr__(self) -> str:
        return f"remote({self._fn!r})"


def call_on_mesh(function, name: str, shapes, args: tuple, kwargs: dict, mesh=None, op=None, learn=False, check=False):
    """Send one ``CallFunction`` of ``function`` with ``args``/``kwargs`` to a mesh and return its result with
    every tensor output a remote ``Tensor`` (spec §1 ``remote``, "Dispatch").

    ``shapes(*fake_args, **fake_kwargs)`` runs on the controller's fake tensors to learn output shapes, strides,
    aliasing and mutation: an input whose fake version changes is mutated (all live aliases of its storage go into
    ``mutates``); an output that *is* an input's fake (an in-place op) is that input ``Tensor`` itself, not a new
    ref. ``op`` is the ``OpOverload`` called, if any: the inputs its schema writes (``Tensor(a!)``: in-place and
    ``out=`` ops) are mutated besides (inside ``__torch_dispatch__`` the fakes' versions do not move). A second
    call with the same input metadata makes its outputs from the first one's ``Plan`` (``propagation.py``),
    without running ``shapes`` (for a torch op whose outputs view no input, also with its inputs at other storage
    offsets). ``learn``: ``shapes`` runs the function itself, so where it raises the outputs are learned on the
    mesh's first rank instead (``cached_propagation.py``). ``check``: each rank checks that every tensor output
    has the propagated dtype and shape (``CallFunction.declared``), else that call fails with a ``RemoteException``
    naming the output, declared against returned. The mesh is the remote tensors' mesh, else ``mesh``, else
    the active mesh; the stream is the active stream (``controller/stream.py``: its checks run before anything is
    sent).
    """
    # a torch op's FunctionPath follows from the op: the key leaves it out (its hash is a Python call)
    key, inputs = call_key(None if op is not None else function, shapes, args, kwargs, Tensor, DeviceMesh)
    if key is not None and inputs:
        result = cached(key, inputs, function, name, args, kwargs, op, check)
        if result is not MISS:
            return result
    return _call(function, name, shapes, args, kwargs, mesh, op, key, learn, check)


def _fakes(leaves: list, session) -> list:
    """``leaves`` with each remote tensor as its fake and each local one as a fake of the session's mode."""
    fakes = []
    for x in leaves:
        if isinstance(x, Tensor):
            fakes.append(x._fake)
        elif isinstance(x, torch.Tensor):
            fakes.append(session.fake_mode.from_tensor(x))  # a local value (checked by _mesh_of), sent by value
        else:
            fakes.append(x)
    return fakes


def _on_values(name: str, failure: Exception) -> str:
    """Why torch op ``name`` cannot run on the mesh: its result (``torch.equal``) or its output's shape
    (``torch.nonzero``) depends on values the controller does not have."""
    what = "result" if isinstance(failure, DataDependentOutputException) else "output's shape"
    return (f"{name}: its {what} depends on the tensors' values, which are on the mesh, not on the controller: "
            "fetch them (dask_monarch.inspect(t), fetch_shard(t).result()) and run it locally, outside "
            "mesh.activate() or under dask_monarch.no_mesh.activate()")


def _call(function, name: str, shapes, args, kwargs, mesh, op, key, learn: bool, check: bool = False):
    """``call_on_mesh`` without a plan: check the arguments, run ``shapes`` on fakes (or, where that raises and
    ``learn``, learn the outputs on the mesh's first rank), record a plan if the call can be cached (``key``), and
    send the call."""
    leaves, spec = tree_flatten((args, kwargs))
    mesh = _mesh_of(leaves, mesh)
    session = mesh._session
    inputs, sent_args, sent_kwargs = sendable(leaves, spec, args, kwargs, name)
    groups = [x for x in leaves if isinstance(x, RemoteProcessGroup)]
    fake_args, fake_kwargs = tree_unflatten(_fakes(leaves, session), spec)
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
                if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)):
                    raise TypeError(_on_values(name, e)) from e
                raise
            if not learn:
                raise propagate_failed(e, name) from e
            failure = e
        else:
            failure = None
    if failure is not None:  # learned on the mesh's first rank: a wait, outside the session's lock
        plan = frontend.learn_outputs(function, name, key, tuple(sent_args), sent_kwargs, inputs, mesh, groups,
                                      failure)
    with session.lock:
        if plan is not None:
            plan.groups = bool(groups)
            return issue(plan, function, name, tuple(sent_args), sent_kwargs, inputs, mesh, groups, check)
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
            _declared(results, values) if check else None,
        )
        session.record(seq, defs=new + mutates, uses=inputs, what=name)
        session.send(message, mesh._rank_list)
    return tree_unflatten(values, out_spec)


def _declared(results: list, values: list) -> tuple:
    """``CallFunction.declared`` for a call's result refs and values: ``(dtype, shape)`` of each new tensor."""
    return tuple(None if ref is None else (v.dtype, tuple(v.shape)) for ref, v in zip(results, values))


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


class LearnOnMesh(Exception):
    """Raised by a ``Remote``'s shapes for ``propagate="cached"``: learn the outputs on the mesh, not on fakes."""


_NOT_USERS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__name__.split(".")[0]]))


def user_line(error: BaseException) -> str:
    """``File "...", line N, in f`` and the source line of the innermost frame of ``error``'s traceback that is
    neither torch's nor dask_monarch's (the user's line that raised), indented on two lines; "" if none."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if not frame.filename.startswith(_NOT_USERS):
            source = f"\n    {frame.line}" if frame.line else ""
            return f'\n  File "{frame.filename}", line {frame.lineno}, in {frame.name}{source}'
    return ""


def propagate_failed(error: Exception, name: str) -> Exception:
    """The error of a ``propagate`` function that raised on fake tensors: of the same type, saying so, with the line
    that raised (the caller chains it to ``error``)."""
    return _with_hint(error, f"{name}: its propagate function raised on the shapes of the arguments: "
                             f"{type(error).__name__}: {error}{user_line(error)}\npropagate= must return tensors of "
                             "the outputs' shapes and dtypes (e.g. torch.empty(...)), or None for no tensor outputs")


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
    argument as the workers get it, seen from the mesh's first rank (``mesh.dims["dp"].rank`` is 0); where that
    raises (``fn`` reads values, ``.item()``, a data-dependent shape, or the controller cannot import it) the outputs
    are learned by running ``fn`` once on the mesh's first rank (Monarch's way, ``cached_propagation.py``), cached
    per argument metadata. ``"cached"`` always learns them on the first rank. A callable is run instead, with the
    same arguments (meshes as the controller's ``DeviceMesh``: ``mesh.size("dp")``), and must return fake tensors
    of the output shapes, e.g. with ``torch.empty``; ``"inspect"`` means no tensor outputs (the function returns
    nothing, or values the controller does not need). Raises ``TypeError`` for an ``fn`` that is neither callable
    nor a path, ``ValueError`` for another ``propagate`` value, ``NotImplementedError`` for ``"mocked"`` (as
    Monarch).
    """
    if fn is None:
        return lambda f: remote(f, propagate=propagate)
    if isinstance(fn, str):
        function_of(fn)  # a path without a dot fails now, not at the first call
    elif not callable(fn):
        raise TypeError(f"remote() needs a callable or a dotted path, got {type(fn).__name__}")
    if propagate == "mocked":
        raise NotImplementedError("remote(propagate='mocked') is not implemented (nor is it in Monarch); use None, "
                                  "'cached', 'inspect' or a function")
    if isinstance(propagate, str) and propagate not in ("cached", "inspect"):
        raise ValueError(f"remote(): propagate must be None, 'cached', 'inspect' or a function, got {propagate!r}")
    if propagate is not None and not isinstance(propagate, str) and not callable(propagate):
        raise ValueError(f"remote(): propagate must be None, 'cached', 'inspect' or a function, got "
                         f"{type(propagate).__name__}")
    return Remote(fn, propagate)


frontend.remote = remote
