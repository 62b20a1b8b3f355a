"""Runs of aten steps compiled by Inductor (``compile(fn, backend="inductor")``; beyond Monarch).

A recording defined with ``backend="inductor"`` replays its first call as generated Python (``worker/blocks.py``).
At its second call (after the controller's verifying call) each stream's program lowers every block of at least
``MIN_OPS`` operations to an ``torch.fx.GraphModule`` of the same aten ops (placeholders: the refs the block reads
from the ref table; outputs: those it writes there) and compiles it with ``torch.compile(backend="inductor",
fullgraph=True, dynamic=False)``, so that the step's pointwise operations fuse into few kernels. Everything that is
not an aten op stays a step of its own between the compiled regions, in the recorded order: ``Reduce`` and the
other collectives, ``SendTensor``, borrows, remote functions; so collectives stay ordered on every rank.

In-place operations on captured tensors (an optimizer's update of parameters) are functionalized by AOTAutograd
and written back into the same tensors; random operations keep eager's generator (``fallback_random``), so a
compiled replay draws the numbers an eager one would.

What Inductor cannot compile (Dynamo refusing an operation, a backend error, no C++ compiler on a CPU worker) is
detected at the region's first call, before anything ran: that region replays as generated Python from then on,
and the worker says so once per recording, in its log and as a Dask event on topic ``compile_topic(session)``,
which the controller turns into one ``RuntimeWarning`` naming the reason (``controller/compile.py``). A failure of
the compiled code itself names the region's first operation and its range of operations.
"""

from __future__ import annotations

import logging
import operator

import torch

from ..protocol.session_id import compile_topic
from .blocks import Block
from .steps import Call

__all__ = ["Region", "compile_regions", "MIN_OPS"]

logger = logging.getLogger("dask_monarch.worker")

#: blocks with fewer operations stay generated Python (a compiled call costs tens of microseconds of wrappers)
MIN_OPS = 4
_OPTIONS = {"fallback_random": True}


def lower(block: Block) -> torch.fx.GraphModule:
    """The block's operations as an FX graph of their ``OpOverload`` s."""
    graph = torch.fx.Graph()
    root = torch.nn.Module()
    nodes = {rid: graph.placeholder(f"r{rid}") for rid in block.inputs}
    constants: list = []

    def value(spec):
        kind = spec[0]
        if kind == "ref":
            return nodes[spec[1]]
        if kind == "list":
            return spec[1](value(item) for item in spec[2])
        v = spec[1]
        if _inline(v):
            return v
        name = f"const{len(constants)}"  # a tensor, a generator, ...: an attribute of the module
        constants.append(v)
        if isinstance(v, torch.Tensor):
            root.register_buffer(name, v)
        else:
            setattr(root, name, v)
        return graph.get_attr(name)

    for step in block.steps:
        if type(step) is not Call:
            continue  # DeleteRefs: the graph frees what it no longer needs
        node = graph.call_function(step.overload, tuple(value(s) for s in step.args),
                                   {k: value(s) for k, s in step.kwargs.items()})
        results = step.results
        if step.returns_list or len(step.returns) > 1:
            for i, ref in enumerate(results):
                if ref is not None:
                    nodes[ref.id] = graph.call_function(operator.getitem, (node, i))
        elif results and results[0] is not None:
            nodes[results[0].id] = node
    graph.output(tuple(nodes[rid] for rid in block.outputs))
    return torch.fx.GraphModule(root, graph)


_SIMPLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _inline(v) -> bool:
    """Whether FX writes ``v`` into the graph's code as it is."""
    if type(v) in (list, tuple):
        return all(_inline(x) for x in v)
    return type(v) in _SIMPLE


class Region:
    """A block compiled by Inductor; called like the block (``run(stream, env, call)``), falling back to it."""

    def __init__(self, block: Block, notify, cpu: bool):
        self.block = block
        self.first_step = block.first_step
        self.inputs = block.inputs
        self.outputs = block.outputs
        self.pops = block.pops
        self.notify = notify  # notify(reason): the region could not be compiled
        self.ops = sum(1 for s in block.steps if type(s) is Call)
        self.fallback: str | None = None
        self.module = lower(block)
        options = dict(_OPTIONS)
        if cpu:  # C++ kernels: compiled in this process (a pool of compiling processes costs more to start)
            options["compile_threads"] = 1
        self.compiled = torch.compile(self.module, backend="inductor", fullgraph=True, dynamic=False,
                                      options=options)

    def __call__(self, stream, env, call) -> None:
        if self.fallback is not None:
            return self.block(stream, env, call)
        args = [env[rid] for rid in self.inputs]
        try:
            outs = self.compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as e:  # compiling failed; nothing ran yet
            self.fallback = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            self.notify(self.describe(), self.fallback)
            return self.block(stream, env, call)
        for rid, value in zip(self.outputs, outs):
            env[rid] = value
        pop = env.pop
        for rid in self.pops:
            pop(rid, None)

    def failing(self, error: BaseException) -> int:
        return self.block.failing(error)

    def describe(self) -> str:
        last = self.first_step + len(self.block.steps) - 1
        return f"steps {self.first_step}-{last} ({self.ops} operations)"


def compile_regions(program, stream, recording) -> None:
    """Replace the program's blocks of at least ``MIN_OPS`` operations by ``Region`` s (at a replay, on the
    stream's thread: ``torch.compile`` compiles at each region's first call)."""
    tw = stream.tw
    reported = []

    def notify(what: str, reason: str) -> None:
        text = (f"recording r{recording.ref_id} on rank {tw.rank}: Inductor could not compile {what}; they "
                f"replay as Python: {reason}")
        logger.warning("dask_monarch: %s", text)
        if reported:
            return
        reported.append(text)
        try:
            tw.worker.log_event(compile_topic(tw.session_id),
                                {"recording": recording.ref_id, "rank": tw.rank, "reason": text})
        except Exception:  # no Dask worker (a unit test): the log line above is the report
            pass

    runners = []
    for runner in program.runners:
        if type(runner) is Block and sum(1 for s in runner.steps if type(s) is Call) >= MIN_OPS:
            try:
                runner = Region(runner, notify, stream.cuda_stream is None)
            except Exception as e:  # lowering to FX failed: say why, keep the block
                notify(f"steps {runner.first_step}-{runner.first_step + len(runner.steps) - 1}",
                       f"lowering to FX: {type(e).__name__}: {e}")
        runners.append(runner)
    program.runners = runners
