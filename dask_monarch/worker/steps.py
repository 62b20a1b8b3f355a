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
from .activity import function_name
from .result_checks import mismatch
from torch.utils._pytree import tree_flatten

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
    """A prepared ``CallFunction``. Each argument is bound once to a spec: ``("ref", id)``, ``("const", value)``
    (plain values, loaded pickled values, meshes, containers without refs), ``("list", type, items)`` (a list or
    tuple of refs and constants) or ``("nested", obj)`` (anything else that holds refs: resolved at each call).
    ``run`` looks the refs up, calls, and stores the result leaves."""

    __slots__ = ("msg", "index", "name", "fn", "error", "args", "kwargs", "nested", "results", "mutates", "returns",
                 "groups", "overload", "returns_list", "env_reads")

    def __init__(self, msg):
        self.msg = msg
        self.index = msg.seq
        self.name = repr(msg.function)
        self.results = msg.results
        self.mutates = msg.mutates
        self.overload = None  # the OpOverload it calls, if it calls one
        self.returns_list = False
        self.env_reads = None  # the refs it reads from the ref table (None: all; a block keeps the others local)

    def prepare(self, tw) -> None:
        """Resolve the function and bind the arguments once. A function or argument that cannot be loaded is a
        value error of every replay (as it would be of every eager call)."""
        msg = self.msg
        self.error = None
        self.returns = None  # the op's return types, from its schema
        try:
            if type(msg.function) is FunctionPath and msg.function.path == TEST_PANIC:
                self.error = FatalError(f"CallFunction {msg.seq}: {TEST_PANIC} called: it asks the stream to fail")
                fn = None
            else:
                fn = resolve_function(msg.function)
                if type(msg.function) is not FunctionPath:  # by value: name it by what it is
                    self.name = getattr(fn, "__qualname__", None) or self.name
                if isinstance(fn, torch._ops.OpOverload):
                    self.returns = [str(r.type) for r in fn._schema.returns]
                    self.overload = fn
                    self.returns_list = self.returns == ["Tensor[]"]
                    fn = fn._op
        except Exception as e:
            fn = None
            self.error = ValueFailure(
                f"invalid remote function: failed to resolve function {msg.function!r}: {type(e).__name__}: {e}"
            )
        self.fn = fn
        # the process groups among the arguments, bound once: the controller split them before the definition
        self.groups = tw.process_groups.for_call(
            msg.remote_process_groups, msg.stream.id, f"CallFunction {msg.seq}") if msg.remote_process_groups else {}
        self.args = [self._bind(a, tw) for a in msg.args_kwargs.args]
        self.kwargs = {k: self._bind(v, tw) for k, v in msg.args_kwargs.kwargs.items()}
        self.nested = any(spec[0] == "nested" for spec in (*self.args, *self.kwargs.values()))

    def _bind(self, a, tw) -> tuple:
        t = type(a)
        if t is Ref:
            group = self.groups.get(a.id)
            if group is not None:
                return ("const", group)
            mesh = tw.device_meshes.get(a.id)
            return ("ref", a.id) if mesh is None else ("const", mesh)
        if t is PickledValue:
            try:
                return ("const", _load_argument(a))
            except Exception as e:
                self.error = self.error or e
                return ("const", None)
        if t in _PLAIN:
            return ("const", a)
        if t in (list, tuple) and all(type(x) is Ref or type(x) in _PLAIN for x in a):
            if not any(type(x) is Ref for x in a):
                return ("const", a)
            return ("list", t, [self._bind(x, tw) for x in a])
        if not any(type(x) is Ref or type(x) is PickledValue or hasattr(x, "__monarch_ref__")
                   for x in tree_flatten(a)[0]):
            return ("const", a)
        return ("nested", a)

    @property
    def fast(self) -> bool:
        """Whether this step runs from a generated block (``worker/blocks.py``): an op (an ``OpOverload``, no
        result check) whose schema returns as many values as the step has results (or one ``Tensor[]``, or
        nothing), with no nested arguments. Such a step does not check its inputs: ``Program.check_inputs`` looks
        at the recording's inputs once per replay, and the steps before it made the others (a failure would have
        stopped the run); ``failed`` finds out what went wrong."""
        returns = self.returns
        if self.error is not None or self.nested or returns is None or self.msg.declared is not None:
            return False
        if self.returns_list:
            return bool(self.results)
        if any("[]" in r for r in returns):
            return False
        return len(self.results) == max(1, len(returns)) and (returns or self.results[0] is None)

    def runner(self):
        """What a replay calls for this step when it is not ``fast``."""
        return self.run

    def reads(self) -> list:
        """The ref ids this step reads, outside nested containers."""
        out = []
        for spec in (*self.args, *self.kwargs.values()):
            if spec[0] == "ref":
                out.append(spec[1])
            elif spec[0] == "list":
                out.extend(item[1] for item in spec[2] if item[0] == "ref")
        return out

    def _diagnose(self, env) -> BaseException | None:
        """Why this step's inputs cannot be read (the fast path does not check), or None."""
        for rid in self.reads() if self.env_reads is None else self.env_reads:
            value = env.get(rid, _MISSING)
            if value is _MISSING:
                return ValueFailure(f"ref not found: r{rid}")
            if type(value) is SeqError:
                return DependentError(value)
        return None

    def _value(self, spec, stream, env):
        kind = spec[0]
        if kind == "ref":
            try:
                value = env[spec[1]]
            except KeyError:
                raise ValueFailure(f"ref not found: r{spec[1]}") from None
            if type(value) is SeqError:
                raise DependentError(value)
            return value
        if kind == "const":
            return spec[1]
        if kind == "list":
            return spec[1](self._value(item, stream, env) for item in spec[2])
        return stream._resolve(spec[1], True, self.groups)

    def run(self, stream, env, call) -> None:
        if self.error is not None:
            raise self.error
        args = [self._value(spec, stream, env) for spec in self.args]
        kwargs = {k: self._value(spec, stream, env) for k, spec in self.kwargs.items()}
        out = self.fn(*args, **kwargs)
        results = self.results
        declared = self.msg.declared
        if declared is not None:
            leaves = [out] if type(out) is _TENSOR else _leaves(out)
            text = mismatch(declared, leaves, self.msg.function) if len(leaves) == len(results) else None
            if text is not None:
                raise ValueFailure(text)
        if len(results) == 1 and type(out) is _TENSOR:
            if results[0] is not None:
                env[results[0].id] = out
            return
        leaves = _leaves(out)
        if len(leaves) != len(results):
            raise ValueFailure(
                f"unexpected number of returns from op, expected {len(results)}, got {len(leaves)}"
                f" (remote function {function_name(self.msg.function)})"
            )
        for ref, value in zip(results, leaves):
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
