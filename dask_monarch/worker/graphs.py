"""Replaying a recording as a CUDA graph (``compile(fn, cuda_graph=True)``; DESIGN.md "Decisions": beyond
Monarch).

On a GPU worker, a recording defined with ``cuda_graph`` runs its first call as a plain replay (a warm-up: the
kernels load, the allocator settles), then captures the stream's program as a ``torch.cuda.CUDAGraph`` on the
stream's CUDA stream, and from then on each call is: copy the actuals into the graph's input buffers, launch the
graph, copy the outputs out into the result refs (and mutated inputs back). The tensors the recording captured
are read and written where they are (their addresses are in the graph); if one of them was replaced by another
tensor since, the graph is captured again. NCCL collectives (``Reduce``) are captured with the rest.

What a CUDA graph cannot hold fails the call, naming the operation: a host synchronization (``.item()``, a
boolean mask, ...), an operation whose result is not on the GPU, a borrow, or two arguments sharing memory.
"""

from __future__ import annotations

import torch

from .errors import FatalError, SeqError, ValueFailure
from .steps import BorrowStep, Call, Formal, Result

__all__ = ["replay_graph"]

_MISSING = object()


class _Uncapturable(Exception):
    """A step cannot be captured: ``index`` is its position among the program's steps."""

    def __init__(self, index: int, text: str):
        super().__init__(text)
        self.index = index


class _Graph:
    """A captured program: the graph, its input buffers (argument index -> tensor), its outputs (output index ->
    tensor) and the captured tensors it was captured with (ref id -> tensor)."""

    def __init__(self, graph, inputs: dict, outputs: dict, captured: dict):
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs
        self.captured = captured

    def valid(self, env) -> bool:
        return all(env.get(rid) is value for rid, value in self.captured.items())


def _check_cuda(step: Call, env, index: int) -> None:
    values = [env.get(rid) for rid in step.reads()]
    values += [env.get(r.id) for r in step.results if r is not None]
    for value in values:
        if isinstance(value, torch.Tensor) and not value.is_cuda and value.dim() > 0:
            raise _Uncapturable(index, f"it uses a tensor on {value.device}, which a CUDA graph cannot hold "
                                       "(every tensor of a graph-replayed recording must be on the GPU)")


def _capture(stream, call, program) -> _Graph:
    env = stream.env
    inputs, outputs = {}, {}
    seen_storages = {}
    for step in program.steps:  # the input buffers: copies of this call's actuals, made before the capture
        if type(step) is Formal:
            i = step.msg.argument_index
            value = env.get(call.actuals[i].id) if i < len(call.actuals) else None
            if not isinstance(value, torch.Tensor):
                raise _Uncapturable(0, f"argument {i} is not a tensor")
            key = value.untyped_storage().data_ptr()
            if key in seen_storages and seen_storages[key] != i:
                raise _Uncapturable(0, f"arguments {seen_storages[key]} and {i} share memory, which a CUDA graph's "
                                       "input buffers cannot")
            seen_storages[key] = i
            inputs[i] = value.clone()
    captured = {rid: env[rid] for rid in program.captured if rid in env}
    graph = torch.cuda.CUDAGraph()
    failure = None
    # captured on a side stream (CUDA refuses captures on the default stream, which the main stream may be),
    # ordered after the stream's work; the graph is launched on the stream itself
    side = torch.cuda.Stream(stream.cuda_stream.device)
    side.wait_stream(stream.cuda_stream)
    try:
        with torch.cuda.graph(graph, stream=side):
            for index, runner in _units(program):
                if runner is None:
                    failure = _capture_step(stream, call, program.steps[index], index, inputs, outputs)
                else:
                    failure = _capture_region(stream, call, runner, index)
                if failure is not None:
                    break
    except Exception as e:  # ending a capture that a step invalidated raises too: the step's error is the one
        if failure is None:
            failure = _Uncapturable(len(program.steps) - 1, f"the capture failed: {type(e).__name__}: {e}")
    finally:
        stream.cuda_stream.wait_stream(side)
    if failure is not None:
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
        raise failure
    return _Graph(graph, inputs, outputs, captured)


def _capture_step(stream, call, step, index: int, inputs: dict, outputs: dict) -> "_Uncapturable | None":
    """Issue one step into the capture; what went wrong, or None."""
    env = stream.env
    kind = type(step)
    try:
        if kind is Formal:
            env[step.msg.result.id] = inputs[step.msg.argument_index]
        elif kind is Result:
            outputs[step.msg.output_index] = env[step.msg.result.id]
        elif kind is BorrowStep:
            raise _Uncapturable(index, "a borrow cannot be captured in a CUDA graph")
        elif getattr(step, "graph_refusal", None):
            raise _Uncapturable(index, step.graph_refusal)
        else:
            step.run(stream, env, call)
            if kind is Call:
                _check_cuda(step, env, index)
    except _Uncapturable as e:
        return e
    except (FatalError, ValueFailure) as e:
        return _Uncapturable(index, str(e))
    except Exception as e:
        return _Uncapturable(index, f"{type(e).__name__}: {e}")
    return None


def _units(program):
    """What a capture runs: each step on its own, or, for a recording compiled by Inductor, its compiled regions
    as they are (``(start step, runner)``) and the other steps on their own (``(index, None)``)."""
    if not program.backend:
        return ((index, None) for index in range(len(program.steps)))
    return ((start, runner if hasattr(runner, "failing") else None)
            for start, runner in zip(program.starts, program.runners))


def _capture_region(stream, call, runner, start: int) -> "_Uncapturable | None":
    """Issue a compiled region (or block) into the capture; what went wrong, or None."""
    env = stream.env
    for step in runner.block.steps if hasattr(runner, "block") else runner.steps:
        for spec in (*getattr(step, "args", ()), *getattr(step, "kwargs", {}).values()):
            value = spec[1] if spec[0] == "const" else None
            if (isinstance(value, torch.device) and value.type != "cuda") or (
                    isinstance(value, torch.Tensor) and not value.is_cuda and value.dim() > 0):
                return _Uncapturable(start, f"it uses {value!r} off the GPU, which a CUDA graph cannot hold")
    try:
        runner(stream, env, call)
    except Exception as e:
        return _Uncapturable(runner.failing(e), f"{type(e).__name__}: {e}")
    for rid in (*runner.inputs, *runner.outputs):
        value = env.get(rid)
        if isinstance(value, torch.Tensor) and not value.is_cuda and value.dim() > 0:
            return _Uncapturable(start, f"it uses a tensor on {value.device}, which a CUDA graph cannot hold")
    return None


def _launch(state: _Graph, stream, call, program) -> SeqError | None:
    """Run one call on the captured graph; returns the dependent error of an errored input, if any (the graph
    still runs, so that peers reach its collectives)."""
    env = stream.env
    error = None
    for i, buffer in state.inputs.items():
        value = env.get(call.actuals[i].id, _MISSING) if i < len(call.actuals) else _MISSING
        if value is _MISSING:
            raise FatalError(f"CallRecording seq {call.seq}: recording_formal called with too few arguments")
        if type(value) is SeqError:
            error = error or value
            continue
        buffer.copy_(value)
    for rid, value in state.captured.items():
        if type(env.get(rid)) is SeqError:
            error = error or env[rid]
    state.graph.replay()
    for j, out in state.outputs.items():
        if j >= len(call.results):
            raise FatalError(f"CallRecording seq {call.seq}: recording_result called with too few results")
        env[call.results[j].id] = out.clone()
    for i in program.mutated_formals:
        value = env.get(call.actuals[i].id)
        if isinstance(value, torch.Tensor):
            value.copy_(state.inputs[i])
    return error


def replay_graph(stream, call, run_plain) -> None:
    """Replay ``call`` on ``stream`` through its program's CUDA graph (captured on the second call);
    ``run_plain(stream, call)`` replays it without one (the first call, and on CPU workers)."""
    program = call.recording.programs[stream.ref.id]
    warm = 2 if program.backend else 1  # with Inductor: a plain replay, then the one that compiles
    if stream.cuda_stream is None or program.graph_calls < warm:
        program.graph_calls += 1
        run_plain(stream, call)
        return
    program.graph_calls += 1
    env = stream.env
    error = None
    captured = False  # a capture runs every step on its own, in the ref table
    stream.replaying = call
    try:
        state = program.graph
        if state is None or not state.valid(env):
            captured = True
            program.graph = None
            try:
                state = program.graph = _capture(stream, call, program)
            except _Uncapturable as e:
                step = program.steps[e.index]
                error = stream._root_error(step.index if step.index is not None else None,
                                           f"{step.name} cannot be captured in a CUDA graph: {e}")
                return
        error = _launch(state, stream, call, program)
    finally:
        stream.replaying = None
        program.end(env, call, error, everything=captured)
