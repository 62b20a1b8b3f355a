"""A call's outputs learned on the mesh's first rank (Monarch's "cached" propagation; spec §1 ``remote``:
"``None``/``"cached"``: the first call runs the function on shard 0 to learn output shapes and aliasing").

``remote(f)(x)`` without ``propagate=`` first runs ``f`` on the controller's fake tensors. Where that raises (``f``
reads values: ``.item()``, ``bool(t)``, a data-dependent shape; calls what fake tensors cannot run; or cannot be
imported on the controller), or for ``propagate="cached"``, the controller sends one ``SendValue`` of
``worker.cached_propagation.describe_outputs`` to the mesh's first rank, which runs ``f`` there on copies of its
arguments and answers what it returned: each tensor's size, strides, offset, dtype and device and whose storage it
views, the other values, and the arguments it wrote. That answer becomes the call's ``Plan`` (``propagation.py``),
kept for calls with the same argument metadata, so only the first such call waits; the call itself then goes to
every rank as usual, declaring the outputs rank 0 returned (what the workers check results against).

A function that returns Python values works so: the call returns the values rank 0 returned at the learning call
(Monarch's rule), for every later call with the same argument metadata too. ``call()`` / ``call_on_shard_and_fetch``
fetch each rank's own values instead.

Where both fail, the error says what the function raised and quotes the user's line: the type and message of the
fake run when the function raised on the shapes of its arguments (a plain bug, ``x.view(3, 5)`` of 4 elements),
or rank 0's ``RemoteException`` (its traceback names the user's file and line) when fake tensors could not run it.
"""

from __future__ import annotations

from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.utils._pytree import tree_flatten

from ..exceptions import RemoteException
from ..protocol import ArgsKwargs, FunctionPath, SendValue
from .coalescing import compiling, is_coalescing
from .fetch import collect
from .mesh import frontend
from .propagation import FRESH, OF_INPUT, OF_OUTPUT, TENSOR, VALUE, Plan
from .remote import LearnOnMesh, _with_hint, user_line
from .stream import check_access, get_active_stream

__all__ = ["learn_outputs"]

DESCRIBE = FunctionPath("dask_monarch.worker.cached_propagation.describe_outputs")
_WHERE = {"fresh": FRESH, "input": OF_INPUT, "output": OF_OUTPUT}
#: what fake tensors cannot run (values, data-dependent shapes, operators without a fake kernel), as opposed to a
#: function that raises on the shapes of its arguments
_NOT_ON_FAKES = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedFakeTensorException,
                 UnsupportedOperatorException, NotImplementedError, ImportError, AttributeError, LearnOnMesh)


def _reason(failure: Exception) -> str:
    """Why fake tensors could not run the function, in the user's terms."""
    if isinstance(failure, LearnOnMesh):
        return str(failure)
    if isinstance(failure, DataDependentOutputException):
        if "_local_scalar_dense" in str(failure):
            return "on fake tensors it reads a tensor's value: .item(), int(t), bool(t), an if on a tensor"
        return f"on fake tensors: {failure.func}'s result depends on the values"
    if isinstance(failure, DynamicOutputShapeException):
        return f"on fake tensors: the shape of {failure.func}'s output depends on the values"
    return f"on fake tensors it raised {type(failure).__name__}: {failure}"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text


def learn_outputs(function, name: str, key, args: tuple, kwargs: dict, inputs: list, mesh, groups: list,
                  failure: Exception) -> Plan:
    """The ``Plan`` of a call of ``function`` (``name``) with ``args``/``kwargs`` (as sent: local values pickled) and
    remote tensor arguments ``inputs`` on ``mesh``, learned by running it once on the mesh's first rank, and kept
    for ``key`` (the call's cache key; None: not kept). ``failure`` is what the fake run raised. Waits for the
    answer (bounded as every fetch: the mesh's liveness). Raises ``TypeError`` for process groups among the arguments
    and ``RuntimeError`` inside ``coalescing()``/a compiled function (no wait there), each chained to ``failure``;
    where the function raises on rank 0 too, the error described in the module's docstring."""
    rank = mesh._rank_list[0]
    if groups:
        raise TypeError(f"{name}: its outputs could not be learned on fake tensors ({_reason(failure)}), and a call "
                        "with process groups cannot run on rank 0 alone to learn them (its collectives would wait "
                        "for the other ranks); pass propagate= to remote()") from failure
    block = (f"compiled function {compiling()}" if compiling() is not None
             else "dask_monarch.coalescing()" if is_coalescing() else None)
    if block is not None:
        raise RuntimeError(f"{name}: its outputs could not be learned on fake tensors ({_reason(failure)}), and inside "
                           f"{block} the controller cannot wait for rank {rank} to run it once to learn them; call it "
                           "once before (its outputs are then kept for these argument shapes) or pass propagate= to "
                           "remote()") from failure
    session = mesh._session
    stream = get_active_stream()
    with session.lock:
        session.check_ok()
        stream_ref = stream.ref_for(session)
        check_access(stream, inputs, [])
        session.follow_default_dtype(stream_ref)
        seq = session.new_seq()
        what = f"learning the outputs of {name}"
        session.record(seq, defs=[], uses=inputs, what=what)
        session.send(SendValue(seq, None, [], DESCRIBE, ArgsKwargs((function, args, kwargs, list(inputs)), {}),
                               stream_ref), [rank])
        refs = [t.ref.id for t in inputs]
        future = session.sync(f"{what} (seq {seq}) on rank {rank}", kind="fetch",
                              on_done=lambda: collect(session, seq, (rank,), refs, what)[0])
    try:
        skeleton, described, written = future.result()
    except RemoteException as e:
        if e.seq != seq:  # an input depends on a failure: that one
            raise
        raise _both_failed(name, rank, failure, e) from e
    plan = _plan(skeleton, described, written)
    session.propagator.learned(key, plan)
    return plan


def _both_failed(name: str, rank: int, failure: Exception, remote: RemoteException) -> Exception:
    """The error of a call whose function raised on fake tensors (``failure``) and on rank ``rank`` (``remote``)."""
    if isinstance(failure, _NOT_ON_FAKES):
        return RemoteException(remote.seq, remote.rank, remote.worker, remote.backtrace,
                               f"{name}, run once on rank {rank} to learn its outputs ({_reason(failure)})")
    return _with_hint(failure, f"{name}: the function raised on the shapes of its arguments: "
                               f"{type(failure).__name__}: {failure}{user_line(failure)}\n"
                               f"(run once on rank {rank} of the mesh to learn its outputs, it raised there too: "
                               f"{_last_line(remote.backtrace)})")


def _plan(skeleton, described: list, written: list) -> Plan:
    """The ``Plan`` of ``describe_outputs``' answer (``worker/cached_propagation.py``)."""
    steps = []
    for entry in described:
        if entry[0] == "tensor":
            _, size, stride, offset, dtype, device, requires_grad, where, which = entry
            steps.append((TENSOR, (tuple(size), tuple(stride), offset, dtype, device), requires_grad, _WHERE[where],
                          which))
        else:
            steps.append((VALUE, entry[1]))
    spec = tree_flatten(skeleton, is_leaf=lambda x: x is None)[1]
    single = spec.is_leaf() and len(steps) == 1
    return Plan(tuple(steps), None if single else spec, tuple(written))


frontend.learn_outputs = learn_outputs
