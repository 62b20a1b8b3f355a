"""The steps of a recording's program on one stream (spec §7 "Worker CallRecording"; ``worker/replay.py`` runs
them): each recorded message, prepared once when the definition completes.

Every step has ``run(stream, env, call)`` (a replay before any failure), ``failed(stream, env, error)`` (the
error its failure stores: a root error is reported once for the call), and ``skip(stream, env, call, err)``
(after the recording failed: ``CallFunction`` steps only store the error; collectives and borrow steps still
run, so that peers and other streams never wait for them). ``index`` is the operation's position in the
recording (the seq it was recorded with) where it has one, ``name`` what it runs.
"""

from __future__ import annotations

import traceback

import torch

from ..protocol import FunctionPath, PickledValue, Ref, resolve_function
from ..protocol.function import TEST_PANIC
from .errors import DependentError, FatalError, SeqError, ValueFailure
from .stream import _PLAIN, _leaves, _load_argument

__all__ = ["Call", "ReduceStep", "Formal", "Result", "Delete", "BorrowStep", "Failed"]

_MISSING = object()
_TENSOR = torch.Tensor


class Failed(Exception):
    """A step stored ``error`` (a ``SeqError``) in its result without raising: the recording has failed."""

    def __init__(self, error: SeqError):
        self.error = error


# ------------------------------------------------------------------------------------------------------- steps
class Call:
    """A prepared ``CallFunction``: ``run`` looks up the ref arguments, calls, and stores the result leaves."""

    __slots__ = ("msg", "index", "name", "fn", "error", "args", "slots", "nested", "kwargs", "nested_kwargs",
                 "single", "results", "mutates", "groups")

    def __init__(self, msg):
        self.msg = msg
        self.index = msg.seq
        self.name = repr(msg.function)
        self.results = msg.results
        self.mutates = msg.mutates

    def prepare(self, tw) -> None:
        """Resolve the function and bind the arguments once. A function or argument that cannot be loaded is a
        value error of every replay (as it would be of every eager call)."""
        msg = self.msg
        self.error = None
        try:
            if type(msg.function) is FunctionPath and msg.function.path == TEST_PANIC:
                self.error = FatalError(f"CallFunction {msg.seq}: {TEST_PANIC} asked the stream to fail")
                fn = None
            else:
                fn = resolve_function(msg.function)
                if type(msg.function) is not FunctionPath:  # by value: name it by what it is
                    self.name = getattr(fn, "__qualname__", None) or self.name
                fn = getattr(fn, "_op", fn) if isinstance(fn, torch._ops.OpOverload) else fn
        except Exception as e:
            fn = None
            self.error = ValueFailure(
                f"invalid remote function: failed to resolve function {msg.function!r}: {type(e).__name__}: {e}"
            )
        self.fn = fn
        meshes = tw.device_meshes
        # the process groups among the arguments, bound once: the controller split them before the definition
        self.groups = groups = tw.process_groups.for_call(
            msg.remote_process_groups, msg.stream.id, f"CallFunction {msg.seq}") if msg.remote_process_groups else {}
        args, slots, nested = [], [], []
        for pos, a in enumerate(msg.args_kwargs.args):
            t = type(a)
            if t is Ref:
                if a.id in groups:
                    args.append(groups[a.id])
                elif a.id in meshes:
                    args.append(meshes[a.id])
                else:
                    args.append(None)
                    slots.append((pos, a.id))
            elif t is PickledValue:
                try:
                    args.append(_load_argument(a))
                except Exception as e:
                    args.append(None)
                    self.error = self.error or e
            elif t in _PLAIN:
                args.append(a)
            else:
                args.append(None)
                nested.append((pos, a))
        self.args, self.slots, self.nested = args, tuple(slots), tuple(nested)
        kwargs = msg.args_kwargs.kwargs
        self.nested_kwargs = any(type(v) not in _PLAIN for v in kwargs.values())
        self.kwargs = kwargs
        results = self.results
        self.single = results[0].id if len(results) == 1 and results[0] is not None else None

    @property
    def fast(self) -> bool:
        """Whether this is the common case: an op that returns one tensor, whose arguments are refs and plain
        values. Such a step runs without checking its inputs (``runner``, ``worker/blocks.py``):
        ``Program.check_inputs`` looks at the recording's inputs once per replay, and the steps before it made the
        others (a failure would have stopped the fast path); ``failed`` finds out what went wrong."""
        if self.error is not None or self.nested or self.nested_kwargs or self.kwargs or self.single is None:
            return False
        schema = getattr(self.msg_op(), "_schema", None)
        return schema is not None and len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor"

    def runner(self):
        """What a replay calls for this step: ``run``, or for a ``fast`` step a function of exactly that call."""
        fn, args, single = self.fn, self.args, self.single
        if not self.fast:
            return self.run
        slots = self.slots
        if len(args) == 1 and len(slots) == 1:
            (_, r0), = slots

            def run1(stream, env, call):
                env[single] = fn(env[r0])

            return run1
        if len(args) == 2 and len(slots) == 1 and slots[0][0] == 0:
            r0, c1 = slots[0][1], args[1]

            def run2c(stream, env, call):
                env[single] = fn(env[r0], c1)

            return run2c
        if len(args) == 2 and len(slots) == 2:
            r0, r1 = slots[0][1], slots[1][1]

            def run2(stream, env, call):
                env[single] = fn(env[r0], env[r1])

            return run2

        def run_any(stream, env, call):
            a = args.copy()
            for pos, rid in slots:
                a[pos] = env[rid]
            env[single] = fn(*a)

        return run_any

    def msg_op(self):
        """The ``OpOverload`` this step calls, or None (its schema tells how many tensors it returns)."""
        try:
            op = resolve_function(self.msg.function)
        except Exception:
            return None
        return op if isinstance(op, torch._ops.OpOverload) else None

    def reads(self) -> tuple:
        """The ref ids this step reads at the top level of its arguments."""
        return tuple(rid for _, rid in self.slots)

    def _diagnose(self, env) -> BaseException | None:
        """Why this step's inputs cannot be read (the fast path does not check), or None."""
        for _, rid in self.slots:
            value = env.get(rid, _MISSING)
            if value is _MISSING:
                return ValueFailure(f"ref not found: r{rid}")
            if type(value) is SeqError:
                return DependentError(value)
        return None

    def run(self, stream, env, call) -> None:
        if self.error is not None:
            raise self.error
        args = self.args
        if self.slots or self.nested:
            args = args.copy()
            for pos, rid in self.slots:
                try:
                    value = env[rid]
                except KeyError:
                    raise ValueFailure(f"ref not found: r{rid}") from None
                if type(value) is SeqError:
                    raise DependentError(value)
                args[pos] = value
            for pos, obj in self.nested:
                args[pos] = stream._resolve(obj, True, self.groups)
        kwargs = self.kwargs
        if self.nested_kwargs:
            kwargs = {k: stream._resolve(v, True, self.groups) for k, v in kwargs.items()}
        out = self.fn(*args, **kwargs)
        if self.single is not None and type(out) is _TENSOR:
            env[self.single] = out
            return
        leaves = _leaves(out)
        if len(leaves) != len(self.results):
            raise ValueFailure(
                f"unexpected number of returns from op, expected {len(self.results)}, got {len(leaves)}"
                f" (function {self.msg.function!r})"
            )
        for ref, value in zip(self.results, leaves):
            if ref is not None:
                env[ref.id] = value

    def failed(self, stream, env, error: BaseException) -> SeqError:
        """The error this step's failure stores in its results and mutated refs (a root one is reported)."""
        if type(error) not in (DependentError, ValueFailure) and not isinstance(error, FatalError):
            error = self._diagnose(env) or error
        if type(error) is DependentError:
            err = error.root
        elif type(error) is ValueFailure:
            err = stream._root_error(self.index, str(error))
        elif isinstance(error, FatalError):
            raise error
        else:  # the function's own error, with its traceback (as an eager call reports it)
            err = stream._root_error(self.index, "".join(traceback.format_exception(error)))
        self.skip(stream, env, None, err)
        return err

    def skip(self, stream, env, call, err: SeqError) -> None:
        for ref in self.results:
            if ref is not None:
                env[ref.id] = err
        for ref in self.mutates:
            env[ref.id] = err


class ReduceStep:
    """A recorded ``Reduce``: runs like an eager one, also after a failure (an errored input takes part as
    zeros, so the peers never wait); an errored result fails the recording."""

    __slots__ = ("msg", "index", "name")

    def __init__(self, msg):
        self.msg = msg
        self.index = msg.seq
        self.name = f"Reduce {msg.reduction.value} over {sorted(msg.dims)}"

    def prepare(self, tw) -> None:
        pass

    def run(self, stream, env, call) -> None:
        stream.reduce(self.msg)
        result = env.get(self.msg.result.id)
        if type(result) is SeqError:
            raise Failed(result)

    def failed(self, stream, env, error) -> SeqError:
        if type(error) is Failed:
            return error.error
        raise error

    def skip(self, stream, env, call, err) -> None:
        stream.reduce(self.msg)


class Formal:
    """``RecordingFormal{result, argument_index}``: the formal takes the value or error of that actual."""

    __slots__ = ("msg", "index", "name")

    def __init__(self, msg):
        self.msg = msg
        self.index = None
        self.name = f"RecordingFormal {msg.argument_index}"

    def prepare(self, tw) -> None:
        pass

    def run(self, stream, env, call) -> None:
        i = self.msg.argument_index
        if i >= len(call.actuals):
            raise FatalError(
                f"CallRecording seq {call.seq}: recording_formal called with too few arguments (formal {i}, "
                f"{len(call.actuals)} actuals)"
            )
        actual = call.actuals[i]
        value = env.get(actual.id, _MISSING)
        if value is _MISSING:
            raise ValueFailure(f"ref not found: {actual} (actual {i} of the recording)")
        env[self.msg.result.id] = value
        if type(value) is SeqError:  # an errored input: a dependent error, not reported
            raise Failed(value)

    def failed(self, stream, env, error) -> SeqError:
        if type(error) is ValueFailure:
            return stream._root_error(None, str(error))
        if type(error) is Failed:
            return error.error
        raise error

    def skip(self, stream, env, call, err) -> None:
        try:
            self.run(stream, env, call)
        except ValueFailure:
            env[self.msg.result.id] = err
        except Failed:
            pass


class Result:
    """``RecordingResult{result, output_index}``: ``results[output_index]`` takes the value of ``result``."""

    __slots__ = ("msg", "index", "name")

    def __init__(self, msg):
        self.msg = msg
        self.index = None
        self.name = f"RecordingResult {msg.output_index}"

    def prepare(self, tw) -> None:
        pass

    def run(self, stream, env, call) -> None:
        target = self._target(call)
        if target.id in env:
            raise FatalError(f"CallRecording seq {call.seq}: Duplicate write to reference {target}")
        value = env.get(self.msg.result.id, _MISSING)
        if value is _MISSING:
            raise FatalError(
                f"CallRecording seq {call.seq}: RecordingResult {self.msg.output_index}: ref not found: "
                f"{self.msg.result}"
            )
        env[target.id] = value

    def _target(self, call) -> Ref:
        j = self.msg.output_index
        if j >= len(call.results):
            raise FatalError(
                f"CallRecording seq {call.seq}: recording_result called with too few results (result {j}, "
                f"{len(call.results)} result refs)"
            )
        return call.results[j]

    def failed(self, stream, env, error):
        raise error

    def skip(self, stream, env, call, err) -> None:
        self._target(call)  # after a failure the results take the error (``Program.end``)


class Delete:
    """A recorded ``DeleteRefs``: frees the refs at that point of every replay."""

    __slots__ = ("ids", "index", "name")

    def __init__(self, msg):
        self.ids = tuple(r.id for r in msg.refs)
        self.index = None
        self.name = "DeleteRefs"

    def prepare(self, tw) -> None:
        pass

    def run(self, stream, env, call) -> None:
        pop = env.pop
        for rid in self.ids:
            pop(rid, None)

    def failed(self, stream, env, error):
        raise error

    def skip(self, stream, env, call, err) -> None:
        self.run(stream, env, call)


class BorrowStep:
    """A recorded borrow step (``lend``, ``first_use``, ``last_use``, ``drop`` of ``worker/borrow.py``) on the
    borrow this call made for ``borrow_id``. Borrow steps run after a failure too (the other stream waits)."""

    __slots__ = ("kind", "borrow_id", "index", "name")

    def __init__(self, kind: str, borrow_id: int):
        self.kind = kind
        self.borrow_id = borrow_id
        self.index = None
        self.name = f"borrow {borrow_id} {kind}"

    def prepare(self, tw) -> None:
        pass

    def run(self, stream, env, call) -> None:
        borrow = call.borrows[self.borrow_id]
        getattr(borrow, self.kind)(stream)
        if self.kind == "first_use" and type(env.get(borrow.result.id)) is SeqError:
            raise Failed(env[borrow.result.id])  # the lender's value was an error: a dependent error

    def failed(self, stream, env, error):
        if type(error) is Failed:
            return error.error
        raise error

    def skip(self, stream, env, call, err) -> None:
        getattr(call.borrows[self.borrow_id], self.kind)(stream)
