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

import dataclasses
from collections import Counter

from torch.utils._pytree import tree_flatten

from ..protocol import Ref
from .borrow import SessionOver
from .errors import DependentError, FatalError, SeqError, ValueFailure
from .blocks import blockable, compile_block, failing_step
from .inductor import compile_regions
from .steps import BorrowStep, Call, Delete, Formal, ReduceStep, Result

__all__ = ["Program", "replay"]

_MISSING = object()


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
        self.backend = ""  # "inductor": blocks compiled by torch.compile at the second replay (worker/inductor.py)
        self.replays = 0

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

    def finish(self, tw, keep=frozenset()) -> None:
        """Prepare every step, work out which refs a replay reads from outside (``check_inputs``) and which actuals
        and captured refs a failed replay marks, and generate the blocks (``worker/blocks.py``). ``keep``: refs
        that must stay in the ref table (what borrows lend and take)."""
        for step in self.steps:
            step.prepare(tw)
        self.names = {step.index: step.name for step in self.steps if step.index is not None}
        self.runners, self.starts, local_only = _runners(self.steps, keep)
        self.env_defined = tuple(self.defined - local_only)  # what a successful replay leaves in the ref table
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

    def end(self, env, call, error: SeqError | None, everything: bool = False) -> None:
        """After a replay: mark results and mutated inputs with ``error`` (if it failed), free what it defined
        (``everything``: also what blocks keep as locals, after a replay that ran each step on its own)."""
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
        for rid in self.defined if error is not None or everything else self.env_defined:
            pop(rid, None)


def _runners(steps: list, keep) -> tuple[list, list, set]:
    """What a replay calls, in order, the step each starts at, and the refs that live only as locals of blocks: a
    generated block for each run of ``blockable`` steps (``worker/blocks.py``), else the step's runner."""
    mentions = [mentioned(step) for step in steps]
    total = Counter(rid for refs in mentions for rid in refs)
    runners, starts, local_only = [], [], set()
    i = 0
    while i < len(steps):
        j = i
        while j < len(steps) and blockable(steps[j]):
            j += 1
        if j > i:
            inside = Counter(rid for refs in mentions[i:j] for rid in refs)
            escaping = {rid for rid, n in inside.items() if total[rid] > n or rid in keep}
            block = compile_block(steps[i:j], i, escaping)
            local_only.update(rid for step in steps[i:j] if type(step) is Call
                              for rid in (r.id for r in step.results if r is not None) if rid not in escaping)
            runners.append(block)
            starts.append(i)
            i = j
            continue
        step = steps[i]
        runners.append(step.runner() if type(step) is Call else step.run)
        starts.append(i)
        i += 1
    return runners, starts, local_only


def mentioned(step) -> set:
    """Every ref id ``step`` names (reads, writes or deletes)."""
    kind = type(step)
    if kind is Delete:
        return set(step.ids)
    if kind is Call:
        msg = step.msg
        refs = set()
        for leaf in tree_flatten((msg.args_kwargs.args, msg.args_kwargs.kwargs))[0]:  # as ``stream._resolve``
            if type(leaf) is Ref:
                refs.add(leaf.id)
            elif getattr(leaf, "__monarch_ref__", None) is not None and not isinstance(leaf, type):
                refs.add(leaf.__monarch_ref__())
        refs.update(r.id for r in msg.results if r is not None)
        refs.update(r.id for r in msg.mutates)
        return refs
    msg = getattr(step, "msg", None) or getattr(getattr(step, "plan", None), "msg", None)
    return _refs(msg) if msg is not None else set()


def _refs(obj, out: set | None = None) -> set:
    out = set() if out is None else out
    t = type(obj)
    if t is Ref:
        out.add(obj.id)
    elif t in (list, tuple):
        for x in obj:
            _refs(x, out)
    elif t is dict:
        for x in obj.values():
            _refs(x, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            _refs(getattr(obj, field.name), out)
    return out


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
    if program.backend and program.replays == 1:  # after the first replay (the controller verified by then)
        compile_regions(program, stream, call.recording)
    program.replays += 1
    stream.replaying = call
    try:
        failure = _run(program, stream, env, call)
        if failure is not None:
            i, exception = failure
            error = steps[i].failed(stream, env, exception)
            for step in steps[i + 1:]:
                if stream.tw.failure is not None:
                    return
                step.skip(stream, env, call, error)
    finally:
        stream.replaying = None
        program.end(env, call, error)


def _run(program: Program, stream, env, call):
    """Run the program's steps until one fails: ``(its index, the exception)``, or None. Fatal errors (and the
    session's end) propagate."""
    steps = program.steps
    bad = program.check_inputs(env)
    if bad is not None:  # a captured input is missing or errored: fail at the first step that reads it
        first, exception = bad
        for i, step in enumerate(steps):  # the steps before it still run (formals, borrows, collectives)
            if step is first:
                return i, exception
            try:
                step.run(stream, env, call)
            except (FatalError, SessionOver):
                raise
            except BaseException as e:
                return i, e
    j = 0
    try:
        for run in program.runners:
            run(stream, env, call)
            j += 1
    except (FatalError, SessionOver):
        raise
    except BaseException as e:
        return failing_step(program.runners[j], program.starts[j], e), e
    return None
