"""Actor calls on a stream: ``SendResultOfActorCall`` and ``CallActorMethod`` (spec §2 "Other variants", §3;
seed ``worker.rs``; DESIGN.md "Decisions": they call Dask actors living on the mesh's workers).

``mesh.spawn`` creates one Dask actor per rank (``client.submit(construct, cls, args, kwargs, actor=True,
workers=[address])``: ``construct`` returns the instance, which Dask keeps as the actor), whose key
is ``f"{base}-{rank}"``; the instance lives in the Dask worker's ``worker.state.actors``. A call reaches the
tensor worker as a message like any other; the dispatcher queues an ``ActorCallStep`` on the call's stream, and
the stream's thread, in the stream's order (after every message queued before it, before every message queued
after it), looks the instance up by key, resolves the arguments (refs -> this rank's local tensors, a mesh ->
the worker's ``DeviceMesh``, spec §8) and calls the method there, on the stream's thread and CUDA stream, not on
Dask's ``"actor"`` thread. Calls through the mesh of one actor never overlap (one lock per actor, whichever
stream calls). A method called directly through Dask's ``Actor`` proxy runs on Dask's actor thread instead,
outside the mesh's order, and may overlap a mesh call.

Errors follow spec §3: a method that raises is a root failure of the call's seq (``RemoteFunctionFailed`` once
per rank), stored in its results and mutated refs; a call whose input carries an error stores that error
(dependent: nothing reported). ``SendResultOfActorCall`` answers ``FetchResult`` either way.
"""

from __future__ import annotations

import asyncio
import inspect
import threading

from ..protocol import CallActorMethod, FetchResult, PickledValue, ResolvableFunction, WorkerError, resolve_function
from .errors import DependentError, FatalError, ValueFailure
from .stream import _leaves, _plain_tree, _to_cpu, store_results

__all__ = ["ActorCallStep", "INIT", "actor_key", "construct", "construct_later", "find_actor"]

#: the method of a constructor whose arguments hold mesh tensors: ``mesh.spawn`` sends it as an actor call, so that it
#: runs on each rank's stream with that rank's local tensors (``construct_later`` made the instance)
INIT = "__init__"

_LOCKS_GUARD = threading.Lock()


def construct(cls: ResolvableFunction, args: tuple, kwargs: dict):
    """``cls(*args, **kwargs)``, run by Dask as the actor task of ``mesh.spawn`` on one rank's worker; ``cls`` is
    resolved as a remote function is (spec §2 "Function paths": by path, or cloudpickled by value with its file
    names, so that a method's traceback names the user's file and line)."""
    return resolve_function(cls)(*args, **kwargs)


def construct_later(cls: ResolvableFunction):
    """``cls.__new__(cls)``: the actor task of ``mesh.spawn`` when the constructor's arguments hold mesh tensors; its
    ``__init__`` then comes as an actor call (``INIT``) on the mesh's stream, with each rank's tensors."""
    resolved = resolve_function(cls)
    return resolved.__new__(resolved)


def actor_key(broker_id: tuple, rank: int) -> str:
    """The Dask key of the actor of ``broker_id`` (``(base key, 0)``) on global rank ``rank``."""
    return f"{broker_id[0]}-{rank}"


def find_actor(tw, broker_id: tuple):
    """The actor instance of ``broker_id`` on this rank's Dask worker; ``ValueFailure`` naming the key if it is
    not there (never spawned here, or stopped: ``ActorMesh.stop``, the session's end)."""
    key = actor_key(broker_id, tw.rank)
    state = getattr(tw.worker, "state", None)
    actors = getattr(state, "actors", None)
    instance = actors.get(key) if actors is not None else None
    if instance is None:
        where = getattr(tw.worker, "address", "this worker")
        raise ValueFailure(
            f"actor {key} is not on the Dask worker {where} of rank {tw.rank} (it was stopped, or never spawned "
            "there: spawn actors with mesh.spawn)"
        )
    return key, instance


def _lock_of(tw, key: str) -> threading.Lock:
    locks = tw.__dict__.get("actor_locks")
    if locks is None:
        with _LOCKS_GUARD:
            locks = tw.__dict__.setdefault("actor_locks", {})
    lock = locks.get(key)
    if lock is None:
        with _LOCKS_GUARD:
            lock = locks.setdefault(key, threading.Lock())
    return lock


def _run_method(tw, key: str, instance, method: str, args, kwargs):
    """Call ``instance.method(*args, **kwargs)`` on this (the stream's) thread, with ``distributed.get_worker()``
    working inside as in a Dask actor method; a coroutine method runs on the Dask worker's event loop, and this
    thread waits for it."""
    if not method.isidentifier() or (method.startswith("__") and method != INIT):
        raise ValueFailure(f"actor {key}: {method!r} is not a method name an actor call may use")
    fn = getattr(instance, method, None)
    if fn is None or not callable(fn):
        raise ValueFailure(f"actor {key} ({type(instance).__qualname__}) has no method {method!r}")
    token = _worker_cvar = None
    try:
        from distributed.worker import _worker_cvar

        token = _worker_cvar.set(tw.worker)
    except Exception:  # not a Dask worker (an in-process test), or Dask moved it: get_worker() fails inside
        pass
    try:
        with _lock_of(tw, key):
            out = fn(*args, **kwargs)
            if inspect.isawaitable(out):
                loop = getattr(getattr(tw.worker, "loop", None), "asyncio_loop", None)
                if loop is None:
                    raise ValueFailure(f"actor {key}: {method} is a coroutine, and this worker has no event loop")
                out = asyncio.run_coroutine_threadsafe(_awaited(out), loop).result()
            return out
    finally:
        if token is not None:
            _worker_cvar.reset(token)


async def _awaited(awaitable):
    return await awaitable


class ActorCallStep:
    """An actor call queued on a stream (the ``params.stream`` of ``msg``); the stream's thread runs it in order
    (``run``, as it runs any queue item that is not a message)."""

    __slots__ = ("msg", "params")

    def __init__(self, msg):
        self.msg = msg
        self.params = msg.call if type(msg) is CallActorMethod else msg.params

    def run(self, stream) -> None:
        tw = stream.tw
        msg, params = self.msg, self.params
        results = msg.results if type(msg) is CallActorMethod else ()
        answer = type(msg) is not CallActorMethod
        try:
            args, kwargs = stream._resolve_args(params.args_kwargs, True)
            key, instance = find_actor(tw, params.broker_id)
            out = _run_method(tw, key, instance, params.method, args, kwargs)
            if answer:
                tw.report(self._answer(tw, out))
                return
            if not results:  # a broadcast: what the method returned is discarded
                return
            leaves = _leaves(out)
            if len(leaves) != len(results):
                raise ValueFailure(
                    f"unexpected number of returns from actor method {params.method}, expected {len(results)}, "
                    f"got {len(leaves)} (the controller's count comes from the endpoint's propagate)"
                )
            store_results(stream.env, results, leaves, f"CallActorMethod seq {params.seq}")
        except DependentError as e:
            stream._store_error(results, e.root)
            stream._store_error(params.mutates, e.root)
            if answer:
                tw.report(FetchResult(params.seq, error=e.root.error))
        except FatalError:
            raise
        except ValueFailure as e:
            self._fail(stream, results, answer, str(e))
        except BaseException:  # whatever the method raises is a value error (as CallFunction's)
            self._fail(stream, results, answer, None)

    def _fail(self, stream, results, answer: bool, text) -> None:
        params = self.params
        err = stream._root_error(params.seq, text)
        stream._store_error(results, err)
        stream._store_error(params.mutates, err)
        if answer:
            stream.tw.report(FetchResult(params.seq, error=err.error))

    def _answer(self, tw, out) -> FetchResult:
        """``FetchResult`` of a method's return value: tensors as CPU copies, other objects pickled on their own
        (one the controller cannot unpickle fails that call only), as ``SendValue``'s."""
        value = _to_cpu(out)
        try:
            if not _plain_tree(value):
                value = PickledValue.dumps(value)
        except Exception as e:
            text = (f"actor method {self.params.method} returned a {type(value).__name__}, which cannot be pickled: "
                    f"{type(e).__name__}: {e}")
            return FetchResult(self.params.seq, error=WorkerError(text, tw.actor_id))
        return FetchResult(self.params.seq, value=value)
