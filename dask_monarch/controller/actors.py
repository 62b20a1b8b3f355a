"""Actors on a mesh: ``mesh.spawn(cls, ...)`` and their endpoints (Monarch's ``proc_mesh.spawn``, ``@endpoint``,
``.call()``, ``.call_one()``, ``.choose()``, ``.broadcast()``, ``.rref()``; spec §2 "Other variants", §3, §9
test_tensor_engine.py; DESIGN.md "Decisions": actors are Dask actors living on the mesh's workers).

``mesh.spawn(cls, *args, **kwargs)`` creates one Dask actor per rank of the mesh, on that rank's worker
(``client.submit(cls, *args, actor=True, workers=[address])``, key ``<base>-<rank>``), and returns an
``ActorMesh``. ``actors.method`` is an ``Endpoint``; every call of it is one message on the active stream, so the
method runs on each rank's stream thread in the stream's order with the tensor messages around it, and sees each
rank's local tensors where the call passed remote ones:

* ``call(*args, **kwargs)``: ``SendResultOfActorCall`` to every rank; a ``MonarchFuture`` of a ``ValueMesh`` of
  the ranks' results (tensors as CPU copies; Monarch's: ``.item(dp=1)``, ``(point, value)`` pairs in rank order);
* ``call_one(*args, **kwargs)``: the same on one rank, chosen by keywords that name mesh dimensions (``dp=1``; the
  others go to the method), or the only rank of a one-rank mesh; a future of that rank's result;
* ``choose(*args, **kwargs)``: ``call_one`` on the mesh's first rank;
* ``broadcast(*args, **kwargs)``: ``CallActorMethod`` on every rank, the result discarded, nothing awaited;
* ``rref(*args, **kwargs)``: ``CallActorMethod`` on every rank; the method's tensor results stay on the mesh as
  remote ``Tensor`` s, with shapes from the endpoint's ``propagate`` (as ``remote``'s: a function of the same
  arguments, minus ``self``, returning tensors of the output shapes; ``"inspect"``: no tensor results).

A method that writes a tensor it was given declares it, ``@endpoint(mutates=("buffer",))`` (parameter names or
positions, ``self`` not counted), so the controller's dependency graph (and the borrow checks) know the call
writes it and every live alias of its storage; ``propagate`` functions that write their fake arguments count too.
"""

from __future__ import annotations

import inspect
import itertools
import re
import time

import cloudpickle
import dask
from torch.utils._pytree import tree_flatten, tree_unflatten

import torch

from ..exceptions import SessionError
from ..protocol import ActorCallParams, ArgsKwargs, CallActorMethod, SendResultOfActorCall
from ..exceptions import RemoteException
from ..worker.actors import INIT, construct, construct_later
from .coalescing import refuse_wait
from .fetch import _rank_of, collect
from .local import propagating
from .mesh import DeviceMesh, frontend
from .remote import _mesh_of, _with_hint, function_of, remote_outputs, sendable
from .stream import check_access, get_active_stream
from .tensor import Tensor
from .value_mesh import ValueMesh

__all__ = ["ActorMesh", "Endpoint", "as_endpoint", "endpoint", "spawn"]

_counter = itertools.count()
_ATTR = "__monarch_endpoint__"


def endpoint(method=None, *, propagate=None, mutates=()):
    """Mark an actor method as an endpoint with options (Monarch's ``@endpoint``); ``@endpoint`` alone is allowed
    (every public method of a spawned class is callable through the mesh anyway).

    ``propagate``: for ``rref``, a function of the method's arguments (without ``self``) that returns fake
    tensors of the output shapes (``torch.empty(...)``), or ``"inspect"`` (no tensor results). ``mutates``: the
    parameters (names, or positions not counting ``self``) whose tensors the method writes. The method itself is
    returned unchanged (a Dask actor calls it as usual). Raises ``TypeError`` for bad options."""
    _check_options(propagate, mutates)

    def mark(fn):
        if not callable(fn):
            raise TypeError(f"endpoint: expected a method, got {type(fn).__name__}")
        setattr(fn, _ATTR, (propagate, tuple(mutates)))
        return fn

    return mark if method is None else mark(method)


def _check_options(propagate, mutates) -> None:
    if propagate is not None and propagate != "inspect" and not callable(propagate):
        raise TypeError(f"endpoint: propagate must be a callable, 'inspect' or None, got {propagate!r}")
    if isinstance(mutates, (str, int)) or not all(isinstance(m, (str, int)) and not isinstance(m, bool)
                                                   for m in mutates):
        raise TypeError(f"endpoint: mutates must be a tuple of parameter names or positions, got {mutates!r}")


def as_endpoint(ep, *, propagate=None, mutates=None) -> "Endpoint":
    """``ep`` (an ``Endpoint``, e.g. ``actors.forward``) with other options (Monarch's ``as_endpoint``):
    ``as_endpoint(actors.forward, propagate=lambda x: torch.empty(3, 4)).rref(y)``."""
    if not isinstance(ep, Endpoint):
        raise TypeError(f"as_endpoint: expected an actor mesh's endpoint (actors.method), got {type(ep).__name__}")
    _check_options(propagate, () if mutates is None else mutates)
    return Endpoint(ep._actors, ep._method, ep._propagate if propagate is None else propagate,
                    ep._mutates if mutates is None else tuple(mutates))


def _letters(name: str) -> str:
    return re.sub(r"[^A-Za-z]", "", name) or "actor"


def spawn(mesh: DeviceMesh, cls, *args, **kwargs) -> "ActorMesh":
    """One Dask actor ``cls(*args, **kwargs)`` per rank of ``mesh``, each on its rank's worker; see
    ``DeviceMesh.spawn``. ``spawn("name", cls, *args)`` (Monarch's ``proc_mesh.spawn``) names the actors."""
    name = None
    if isinstance(cls, str) and args and isinstance(args[0], type):
        name, cls, args = cls, args[0], args[1:]
    if not isinstance(cls, type):
        raise TypeError(f"spawn: expected a class, got {type(cls).__name__}")
    later = any(isinstance(leaf, (Tensor, DeviceMesh)) for leaf in tree_flatten((args, kwargs))[0])
    session = mesh._session
    session.check_ok()
    if session.recording() is not None:
        raise RuntimeError("spawn inside a compiled function: actors cannot be recorded")
    base = f"monarch-{session.tag}-actor-{_letters(name or cls.__name__)}-{next(_counter)}"
    client = session.client
    # the class travels as remote() functions do (by path, or by value keeping its file names for tracebacks),
    # and the constructor's arguments as a tuple and a dict, so no keyword of the class clashes with submit's own;
    # arguments that hold mesh tensors go with the constructor's call on the mesh's stream instead (_construct_on)
    cls_function = _picklable_parts(cls, () if later else args, {} if later else kwargs)
    futures = {}
    try:
        for rank in mesh._rank_list:
            task = (construct_later, cls_function) if later else (construct, cls_function, args, kwargs)
            futures[rank] = client.submit(*task, key=f"{base}-{rank}", workers=[session.workers[rank]],
                                          allow_other_workers=False, actor=True, pure=False)
            session.actor_futures.append(futures[rank])
        _wait_constructed(session, cls, futures)
        proxies = [futures[rank].result() for rank in mesh._rank_list]
        # each Dask Actor proxy holds a future of its own key: the actor lives until that one is released too
        held = list(futures.values()) + [p._future for p in proxies if getattr(p, "_future", None) is not None]
        session.actor_futures.extend(held[len(futures):])
        actors = ActorMesh(mesh, cls, base, held, proxies)
        if later:
            _construct_on(actors, args, kwargs)
    except BaseException:
        for fut in futures.values():
            fut.release()
        raise
    return actors


def _construct_on(actors: "ActorMesh", args: tuple, kwargs: dict) -> None:
    """Run the constructor of every rank's (still uninitialized) actor on the active stream, with each rank's local
    tensors for the mesh tensors among ``args``/``kwargs`` (and the worker's ``DeviceMesh`` for a mesh), and wait
    for it as ``_wait_constructed`` does. Raises ``RuntimeError`` naming the rank whose constructor raised."""
    cls = actors.cls
    future = Endpoint(actors, INIT, None, ())._ask(actors.mesh._rank_list, args, kwargs, one=False)
    try:
        future.result(timeout=float(dask.config.get("monarch.spawn-timeout", 300)))
    except RemoteException as e:
        raise RuntimeError(f"spawn: {cls.__qualname__}(...) failed on rank {e.rank} ({e.worker}):\n{e.backtrace}") from e


def _picklable_parts(cls, args: tuple, kwargs: dict):
    """``function_of(cls)``, after checking that it and the constructor's arguments pickle: ``TypeError`` naming
    the class or the argument that does not (instead of Dask's ``Could not serialize object of type LLGExpr``
    and its logged traceback at submit)."""
    try:
        cls_function = function_of(cls)
    except Exception as e:
        raise TypeError(f"spawn: the class {cls.__qualname__} cannot be pickled to reach the workers: "
                        f"{type(e).__name__}: {e}") from e
    try:
        cloudpickle.dumps((args, kwargs))
    except Exception:
        named = [(f"argument {i}", v) for i, v in enumerate(args)] + [(f"keyword {k!r}", v) for k, v in kwargs.items()]
        for where, value in named:
            try:
                cloudpickle.dumps(value)
            except Exception as e:
                raise TypeError(f"spawn: {cls.__qualname__}'s constructor {where} (a {type(value).__name__}) cannot "
                                f"be pickled to reach the workers: {type(e).__name__}: {e}") from e
        raise
    return cls_function


def _wait_constructed(session, cls, futures: dict) -> None:
    """Wait for every rank's constructor, at most Dask config ``monarch.spawn-timeout`` seconds (default 300),
    checking the mesh's liveness meanwhile. Raises the constructor's error naming the rank, ``SessionError``, or
    ``TimeoutError`` naming the ranks whose constructors did not finish."""
    timeout = float(dask.config.get("monarch.spawn-timeout", 300))
    start = time.monotonic()
    checked = start
    pause = 0.002
    while True:
        for rank, fut in futures.items():
            if fut.status == "error":
                raise RuntimeError(
                    f"spawn: {cls.__qualname__}(...) failed on rank {rank} ({session.workers[rank]}): "
                    f"{fut.exception()!r}"
                ) from fut.exception()
            if fut.status in ("cancelled", "lost"):
                raise SessionError(f"spawn: the actor of rank {rank} ({session.workers[rank]}) was {fut.status}")
        if all(fut.done() for fut in futures.values()):
            return
        now = time.monotonic()
        if now - checked >= session.liveness_interval:
            checked = now
            session.check_alive()
        if now - start >= timeout:
            late = [f"rank {r} ({session.workers[r]})" for r, f in futures.items() if not f.done()]
            raise TimeoutError(f"spawn: {cls.__qualname__}(...) did not finish within {timeout:g} s (Dask config "
                               f"monarch.spawn-timeout) on {', '.join(late)}")
        time.sleep(pause)
        pause = min(0.05, 2 * pause)


class Actor:
    """The base class of actor classes (Monarch's ``monarch.actor.Actor``), so that Monarch's actors run
    unchanged; here optional: ``mesh.spawn`` takes any class, and each rank's object is a Dask actor on its
    worker. Its methods marked ``@endpoint`` (or not) are called through the ``ActorMesh`` that ``spawn``
    returns."""


class ActorMesh:
    """The actors of one ``mesh.spawn``: ``actors.method`` is an ``Endpoint`` for every public method of the class;
    ``actors.actors`` are the Dask ``Actor`` proxies (rank order), ``actors.mesh`` the mesh, ``stop()`` frees
    them (the session's end does too)."""

    def __init__(self, mesh: DeviceMesh, cls, base: str, futures: list, proxies: list):
        self.mesh = mesh
        self.cls = cls
        self._base = base
        self._futures = futures
        self._stopped = False
        self._root = self  # the ActorMesh of the spawn (``slice`` makes views of it)
        #: the Dask ``Actor`` proxies, one per rank in the mesh's rank order. Calling one directly runs the method
        #: on Dask's actor thread, outside the mesh's order, without mesh tensors (``worker/actors.py``)
        self.actors = proxies

    def __getattr__(self, name: str) -> "Endpoint":
        if name.startswith("_"):
            raise AttributeError(name)
        return self.endpoint_of(name)

    def endpoint_of(self, name: str) -> "Endpoint":
        """The ``Endpoint`` of method ``name``: ``actors.name`` unless the name is one of ``ActorMesh``'s own
        (``mesh``, ``cls``, ``actors``, ``slice``, ``stop``, ``endpoint_of``). ``AttributeError`` if the class has no such
        method."""
        attr = getattr(self.cls, name, None)
        if attr is None or not callable(attr):
            raise AttributeError(f"{self.cls.__qualname__} has no method {name!r} to call through the mesh")
        propagate, mutates = getattr(attr, _ATTR, (None, ()))
        return Endpoint(self, name, propagate, mutates)

    def slice(self, **selection) -> "ActorMesh":
        """The actors of the ranks that ``selection`` keeps, as ``DeviceMesh.slice`` selects them (Monarch's
        ``ActorMesh.slice``: ``actors.slice(gpu=0)``, ``actors.slice(gpu=slice(0, 4))``): calls through it run on
        those ranks only (``call`` gives a ``ValueMesh`` over the slice's dims; on one rank, ``call_one()`` needs no
        coordinates), in order with every other call. ``stop()`` of a slice stops every actor of the spawn. Raises
        ``KeyError`` for an unknown dimension, ``IndexError`` for an out-of-range coordinate."""
        root = self._root
        mesh = self.mesh.slice(**selection)
        proxy_of = dict(zip(root.mesh._rank_list, root.actors))
        proxies = [proxy_of[r] for r in mesh._rank_list]
        view = ActorMesh(mesh, self.cls, self._base, [], proxies)
        view._root = root
        return view

    def stop(self, timeout: float = 60.0) -> None:
        """Wait up to ``timeout`` seconds until every rank has run the calls sent so far, then release the Dask
        actors (Dask deletes each instance on its worker, soon after). A later call raises ``RuntimeError``."""
        root = self._root  # a slice's stop is the spawn's
        session = root.mesh._session
        root._stopped = True
        futures, root._futures = root._futures, []
        try:
            if futures and session.failure is None and not session.closed:
                session.sync(f"stopping the actors {root._base}").result(timeout=timeout)
        finally:
            for fut in futures:
                fut.release()

    def __repr__(self) -> str:
        return f"ActorMesh({self.cls.__qualname__} on {self.mesh!r})"


class Endpoint:
    """Method ``method`` of the actors of an ``ActorMesh``, with its ``propagate`` and ``mutates`` options (see the
    module's docstring for ``call``, ``call_one``, ``choose``, ``broadcast`` and ``rref``)."""

    def __init__(self, actors: ActorMesh, method: str, propagate, mutates: tuple):
        self._actors = actors
        self._method = method
        self._propagate = propagate
        self._mutates = mutates

    def __repr__(self) -> str:
        return f"Endpoint({self._actors.cls.__qualname__}.{self._method})"

    @property
    def _what(self) -> str:
        return f"{self._actors.cls.__qualname__}.{self._method} (actor)"

    def call(self, *args, **kwargs):
        """Run the method on every rank; a ``MonarchFuture`` whose ``result(timeout=None)`` (or ``get()``) is a
        ``ValueMesh`` of every rank's return value (tensors as CPU copies): ``.item(dp=1)``, ``.values()`` in the
        mesh's rank order, ``(point, value)`` pairs when iterated (Monarch's). It raises ``RemoteException`` if the
        method raised on a rank (or an input depends on a failure), ``SessionError`` if the session failed."""
        return self._ask(self._actors.mesh._rank_list, args, kwargs, one=False)

    def call_one(self, *args, **kwargs):
        """Run the method on one rank: keywords naming mesh dimensions select it (``dp=1``; give every dimension),
        the other keywords go to the method; without coordinates the mesh must have one rank. A ``MonarchFuture``
        of that rank's return value. Raises ``ValueError``/``KeyError``/``IndexError`` for bad coordinates."""
        mesh = self._actors.mesh
        coords = {k: kwargs.pop(k) for k in list(kwargs) if k in mesh.names}
        if not coords and len(mesh._rank_list) != 1:
            passed = f"; {sorted(kwargs)} are not dimensions of the mesh (they go to the method)" if kwargs else ""
            raise ValueError(
                f"call_one on actors of {len(mesh._rank_list)} ranks: give a coordinate for every dimension "
                f"of {list(mesh.names)} (e.g. {mesh.names[0]}=0), or use call() or choose(){passed}"
            )
        try:
            rank = _rank_of(mesh, coords)
        except (IndexError, KeyError, ValueError) as e:
            text = str(e.args[0]) if e.args else str(e)
            raise type(e)(f"call_one: {text.removeprefix('fetch_shard: ')}") from None
        return self._ask((rank,), args, kwargs, one=True)

    def choose(self, *args, **kwargs):
        """``call_one`` on the mesh's first rank (Monarch's ``choose`` picks one actor)."""
        return self._ask((self._actors.mesh._rank_list[0],), args, kwargs, one=True)

    def broadcast(self, *args, **kwargs) -> None:
        """Run the method on every rank and discard what it returns; nothing waits (a failure is raised by what
        depends on it, or at ``mesh.exit()``)."""
        self._send(args, kwargs, lambda params: CallActorMethod([], params), outputs=False)

    def rref(self, *args, **kwargs):
        """Run the method on every rank and keep its results on the mesh: what ``propagate`` returned, with every
        tensor a remote ``Tensor`` (on the active stream). ``TypeError`` if the endpoint has no ``propagate``."""
        if self._propagate is None:
            raise TypeError(
                f"rref of {self._what[:-8]} needs the shapes of its results: declare them with "
                "@dask_monarch.endpoint(propagate=...) on the method, or as_endpoint(actors.method, propagate=...)"
            )
        return self._send(args, kwargs, None, outputs=True)

    # ----------------------------------------------------------------------------------------------- sending
    def _ask(self, ranks: tuple, args, kwargs, one: bool):
        refuse_wait(f"{self._what}.call")  # before sending: a refused call leaves nothing in the coalescing block
        seq, session, refs = self._send(args, kwargs, SendResultOfActorCall, outputs=False, ranks=ranks)
        mesh = self._actors.mesh
        what = self._what

        def value():
            values = collect(session, seq, ranks, refs, what)
            return values[0] if one else ValueMesh(mesh.names, mesh.processes.sizes, values)

        return session.sync(f"{what} (seq {seq}) on {len(ranks)} rank(s)", on_done=value, kind="fetch")

    def _send(self, args, kwargs, make, outputs: bool, ranks=None):
        actors = self._actors
        if actors._root._stopped:
            raise RuntimeError(f"{self._what}: the actors were stopped (ActorMesh.stop())")
        leaves, spec = tree_flatten((args, kwargs))
        mesh = _mesh_of(leaves, actors.mesh)
        session = actors.mesh._session
        targets = actors.mesh._rank_list if ranks is None else ranks
        if mesh._session is not session or not set(targets) <= set(mesh._rank_list):
            raise TypeError(f"WRONG_MESH: {self._what} runs on {actors.mesh!r}, but its tensors are on {mesh!r}")
        if session.recording() is not None:
            raise RuntimeError(f"{self._what} inside a compiled function: actor calls cannot be recorded")
        inputs, sent_args, sent_kwargs = sendable(leaves, spec, args, kwargs, self._what)
        declared = self._declared_writes(args, kwargs)
        stream = get_active_stream()
        with session.lock:
            session.check_ok()
            stream_ref = stream.ref_for(session)
            out, mutated = (self._shapes(session, args, kwargs, inputs) if outputs else (None, []))
            written = list({id(t): t for t in declared + [inputs[i] for i in mutated]}.values())
            check_access(stream, inputs, written)
            mutates = session.aliases_of(written)
            results, values, new, out_spec = [], [], [], None
            if outputs:
                results, values, new, out_spec = remote_outputs(out, inputs, session, mesh, stream, self._what)
            seq = session.new_seq()
            params = ActorCallParams(seq, (actors._base, 0), [t.ref for t in inputs], [t.ref for t in mutates],
                                     stream_ref, self._method, ArgsKwargs(tuple(sent_args), dict(sent_kwargs)))
            message = CallActorMethod(results, params) if outputs else make(params)
            session.record(seq, defs=new + mutates, uses=inputs, what=self._what)
            session.send(message, targets)
        if outputs:
            return tree_unflatten(values, out_spec)
        return seq, session, [t.ref.id for t in inputs]

    def _shapes(self, session, args, kwargs, inputs):
        """``(outputs, indices of inputs whose fakes were written)`` of ``propagate`` run on fake tensors."""
        if self._propagate == "inspect":
            return None, []
        leaves, spec = tree_flatten((args, kwargs))
        fakes = [x._fake if isinstance(x, Tensor) else x for x in leaves]
        fake_args, fake_kwargs = tree_unflatten(fakes, spec)
        try:
            with propagating(), torch.no_grad():  # results of actors take no part in the controller's autograd
                out, mutated, _ = session.propagator.run(None, self._propagate, fake_args, fake_kwargs,
                                                         [t._fake for t in inputs])
        except Exception as e:
            raise _with_hint(e, f"propagate of {self._what} failed on fake tensors: {e}") from e
        return out, mutated

    def _declared_writes(self, args, kwargs) -> list:
        """The remote tensors among the arguments that ``mutates`` names (parameter names or positions)."""
        if not self._mutates:
            return []
        fn = getattr(self._actors.cls, self._method)
        try:
            bound = inspect.signature(fn).bind(None, *args, **kwargs)  # None for self
        except TypeError as e:
            raise TypeError(f"{self._what}: {e}") from None
        names = list(bound.signature.parameters)[1:]
        found = []
        for m in self._mutates:
            name = names[m] if isinstance(m, int) and m < len(names) else m
            if name not in names:
                raise TypeError(f"{self._what}: mutates names {m!r}, which is not a parameter of the method {names}")
            found.extend(x for x in tree_flatten(bound.arguments.get(name))[0] if isinstance(x, Tensor))
        return found


frontend.spawn = spawn
