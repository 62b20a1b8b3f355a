"""Replaying a recording on one stream (spec §7 "Worker CallRecording"; seed ``CallRecording``).

A ``Program`` is one stream's part of a recording, built once at ``DefineRecording`` as a list of prepared
steps: a ``CallFunction`` has its function resolved and its arguments bound to ref ids, so that a replay does
for each step only what the computation needs (look up the inputs, call, store the output). A replay runs the
steps in order on the stream's thread, with the stream's ref table:

* ``RecordingFormal{f, i}``: ``f`` takes the value (or error) of ``actuals[i]``; ``RecordingResult{r, j}``:
  ``results[j]`` takes that of ``r``. Too few actuals or results are fatal, with Monarch's texts.
* The first failure ends the computation: a root failure is reported once, as ``RemoteFunctionFailed`` under the
  ``CallRecording`` seq ("recording failed at operation <i> (<function>) ..."; ``controller_frame_index`` = i, the
  operation's position in the recording); an errored input (a dependent error) is not reported. The remaining
  ``CallFunction`` steps are skipped and their results and mutated refs take that error; collectives and borrow
  steps still run (with zeros for errored inputs), so that peers and other streams never wait for them.
* At the end every ref defined inside (formals, intermediates) is deleted; after a failure every result and
  every mutated actual or captured ref holds the error, and unmutated inputs stay valid.
"""

from __future__ import annotations

import torch

from ..protocol import FunctionPath, PickledValue, Ref, resolve_function
from ..protocol.function import TEST_PANIC
from .borrow import SessionOver
from .errors import DependentError, FatalError, SeqError, ValueFailure
from .stream import _PLAIN, _leaves, _load_argument

__all__ = ["Program", "Call", "ReduceStep", "Formal", "Result", "Delete", "BorrowStep", "replay"]

_MISSING = object()
_TENSOR = torch.Tensor


class _Failed(Exception):
    """A step stored ``error`` (a ``SeqError``) in its result without raising: the recording has failed."""

    def __init__(self, error: SeqError):
        self.error = error


# ------------------------------------------------------------------------------------------------------- steps
class Call:
    """A prepared ``CallFunction``: ``run`` looks up the ref arguments, calls, and stores the result leaves."""

    __slots__ = ("msg", "index", "name", "fn", "error", "args", "slots", "nested", "kwargs", "nested_kwargs",
                 "single", "results", "mutates")

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
        args, slots, nested = [], [], []
        for pos, a in enumerate(msg.args_kwargs.args):
            t = type(a)
            if t is Ref:
                if a.id in meshes:
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

    def runner(self):
        """What a replay calls for this step: ``run``, or for the common case (an op that returns one tensor,
        whose arguments are refs and plain values) a function of exactly that call. It does not check its inputs:
        ``Program.check_inputs`` looks at the recording's inputs once per replay, and the steps before it made the
        others (a failure would have stopped the fast path); ``failed`` finds out what went wrong."""
        fn, args, single = self.fn, self.args, self.single
        schema = getattr(self.msg_op(), "_schema", None)
        one_tensor = schema is not None and len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor"
        if self.error is not None or self.nested or self.nested_kwargs or self.kwargs or single is None \
                or not one_tensor:
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
                args[pos] = stream._resolve(obj, True)
        kwargs = self.kwargs
        if self.nested_kwargs:
            kwargs = {k: stream._resolve(v, True) for k, v in kwargs.items()}
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
        else:
            err = stream._root_error(self.index)
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
            raise _Failed(result)

    def failed(self, stream, env, error) -> SeqError:
        if type(error) is _Failed:
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
            raise _Failed(value)

    def failed(self, stream, env, error) -> SeqError:
        if type(error) is ValueFailure:
            return stream._root_error(None, str(error))
        if type(error) is _Failed:
            return error.error
        raise error

    def skip(self, stream, env, call, err) -> None:
        try:
            self.run(stream, env, call)
        except ValueFailure:
            env[self.msg.result.id] = err
        except _Failed:
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
            raise FatalError(f"CallRecording seq {call.seq}: RecordingResult {j}: ref not found: {self.msg.result}")
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
            raise _Failed(env[borrow.result.id])  # the lender's value was an error: a dependent error

    def failed(self, stream, env, error):
        if type(error) is _Failed:
            return error.error
        raise error

    def skip(self, stream, env, call, err) -> None:
        getattr(call.borrows[self.borrow_id], self.kind)(stream)


# ----------------------------------------------------------------------------------------------------- program
class Program:
    """One stream's part of a recording: its steps, and what a replay must clean up or mark afterwards."""

    def __init__(self, stream_id: int):
        self.stream_id = stream_id
        self.steps: list = []
        self.step_defines: list = []  # per step: the ref ids it defines
        self.defined: set = set()  # every ref a step defines: formals and intermediates, deleted after a replay
        self.formals: dict = {}  # formal ref id -> argument index
        self.results: list = []  # output indices this stream fills
        self.mutated: set = set()
        self.names: dict = {}  # operation index -> what it calls, for error reports
        self._live: set = set()
        self.mutated_formals: tuple = ()
        self.mutated_captures: tuple = ()
        self.graph = None  # the CUDA graph of this program, once captured (worker/graphs.py)
        self.graph_calls = 0

    def add(self, step, defines) -> None:
        """Append ``step``, which defines the refs ``defines``. A ref written twice (and not deleted in between)
        is fatal, as an eager duplicate write is."""
        self.step_defines.append(tuple(ref.id for ref in defines if ref is not None))
        for ref in defines:
            if ref is None:
                continue
            if ref.id in self._live and not (type(step) is ReduceStep and ref.id in _aliased(step.msg)):
                raise FatalError(f"DefineRecording: {step.name}: Duplicate write to reference {ref}")
            self._live.add(ref.id)
            self.defined.add(ref.id)
        kind = type(step)
        if kind is Call:
            self.mutated.update(r.id for r in step.mutates)
        elif kind is ReduceStep:
            if step.msg.in_place:
                self.mutated.add(step.msg.tensor.id)
            if step.msg.out is not None:
                self.mutated.add(step.msg.out.id)
        elif kind is Formal:
            self.formals[step.msg.result.id] = step.msg.argument_index
        elif kind is Result:
            self.results.append(step.msg.output_index)
        elif kind is Delete:
            self._live.difference_update(step.ids)
        elif kind is BorrowStep and step.kind == "last_use":
            pass  # the borrowed ref leaves the table at last use; it stays in ``defined`` (popped if still there)
        if step.index is not None:
            self.names[step.index] = step.name
        self.steps.append(step)

    def finish(self, tw) -> None:
        """Prepare every step, work out which refs a replay reads from outside (``check_inputs``) and which actuals
        and captured refs a failed replay marks."""
        for step in self.steps:
            step.prepare(tw)
        self.names = {step.index: step.name for step in self.steps if step.index is not None}
        self.runners = [step.runner() if type(step) is Call else step.run for step in self.steps]
        defined, captured = set(), {}
        for step, defines in zip(self.steps, self.step_defines):
            if type(step) is Call:
                for rid in step.reads():
                    if rid not in defined:
                        captured.setdefault(rid, step)
            defined.update(defines)
        self.captured = captured  # ref id -> the first step that reads it
        self.mutated_formals = tuple(sorted({self.formals[r] for r in self.mutated if r in self.formals}))
        self.mutated_captures = tuple(sorted(r for r in self.mutated if r not in self.defined))
        del self._live

    def check_inputs(self, env):
        """Before a replay: the first captured ref that is missing or errored, as ``(step, exception)``, or None
        (the fast steps do not check their inputs)."""
        for rid, step in self.captured.items():
            value = env.get(rid, _MISSING)
            if value is _MISSING:
                return step, ValueFailure(f"ref not found: r{rid} (captured by the recording)")
            if type(value) is SeqError:
                return step, DependentError(value)
        return None

    def end(self, env, call, error: SeqError | None) -> None:
        """After a replay: mark results and mutated inputs with ``error`` (if it failed), free what it defined."""
        if error is not None:
            for j in self.results:
                if j < len(call.results):
                    env[call.results[j].id] = error
            for i in self.mutated_formals:
                if i < len(call.actuals):
                    env[call.actuals[i].id] = error
            for rid in self.mutated_captures:
                env[rid] = error
        pop = env.pop
        for rid in self.defined:
            pop(rid, None)


def _aliased(msg) -> tuple:
    """The refs a ``Reduce`` result may share: its input and ``out``."""
    return (msg.tensor.id, msg.out.id if msg.out is not None else None)


# ------------------------------------------------------------------------------------------------------ replay
def replay(stream, call) -> None:
    """Run ``call`` (a ``ReplayCall``) on ``stream``: its program's steps in order (see the module docstring)."""
    program = call.recording.programs[stream.ref.id]
    steps = program.steps
    env = stream.env
    error = None
    stream.replaying = call
    i = 0
    try:
        try:
            bad = program.check_inputs(env)
            if bad is not None:  # a captured input is missing or errored: fail at the first step that reads it
                first, exception = bad
                for step in steps:  # the steps before it still run (formals, borrows, collectives)
                    if step is first:
                        raise exception
                    step.run(stream, env, call)
                    i += 1
            for run in program.runners:
                run(stream, env, call)
                i += 1
        except (FatalError, SessionOver):
            raise
        except BaseException as e:
            error = steps[i].failed(stream, env, e)
            for step in steps[i + 1:]:
                if stream.tw.failure is not None:
                    return
                step.skip(stream, env, call, error)
    finally:
        stream.replaying = None
        program.end(env, call, error)
