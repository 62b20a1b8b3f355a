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

    def defines(self) -> list:
        return [r for r in self.results if r is not None]

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

    def defines(self) -> list:
        return [self.msg.result]

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

    def defines(self) -> list:
        return [self.msg.result]

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

    def failed(self, stream, env, error) -> SeqError:
        if type(error) is ValueFailure:
            return stream._root_error(None, str(error))
        raise error

    def skip(self, stream, env, call, err) -> None:
        try:
            self.run(stream, env, call)
        except ValueFailure:
            env[self.msg.result.id] = err


class Result:
    """``RecordingResult{result, output_index}``: ``results[output_index]`` takes the value of ``result``."""

    __slots__ = ("msg", "index", "name")

    def __init__(self, msg):
        self.msg = msg
        self.index = None
        self.name = f"RecordingResult {msg.output_index}"

    def defines(self) -> list:
        return []

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

    def defines(self) -> list:
        return []

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

    def defines(self) -> list:
        return []

    def prepare(self, tw) -> None:
        pass

    def run(self, stream, env, call) -> None:
        getattr(call.borrows[self.borrow_id], self.kind)(stream)

    def failed(self, stream, env, error):
        raise error

    def skip(self, stream, env, call, err) -> None:
        self.run(stream, env, call)


# ----------------------------------------------------------------------------------------------------- program
class Program:
    """One stream's part of a recording: its steps, and what a replay must clean up or mark afterwards."""

    def __init__(self, stream_id: int):
        self.stream_id = stream_id
        self.steps: list = []
        self.defined: set = set()  # every ref a step defines: formals and intermediates, deleted after a replay
        self.formals: dict = {}  # formal ref id -> argument index
        self.results: list = []  # output indices this stream fills
        self.mutated: set = set()
        self.names: dict = {}  # operation index -> what it calls, for error reports
        self._live: set = set()
        self.mutated_formals: tuple = ()
        self.mutated_captures: tuple = ()

    def add(self, step, defines) -> None:
        """Append ``step``, which defines the refs ``defines``. A ref written twice (and not deleted in between)
        is fatal, as an eager duplicate write is."""
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
        """Prepare every step and work out which actuals and captured refs a failed replay marks."""
        for step in self.steps:
            step.prepare(tw)
        self.mutated_formals = tuple(sorted({self.formals[r] for r in self.mutated if r in self.formals}))
        self.mutated_captures = tuple(sorted(r for r in self.mutated if r not in self.defined))
        del self._live

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
            for step in steps:
                step.run(stream, env, call)
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
