"""Runs of simple steps of a recording compiled into one Python function (``Program.finish``).

A replay's cost beside the operations themselves is, per step, a Python call and its argument handling. For a run
of consecutive ``fast`` ``CallFunction`` steps (an op that returns one tensor, refs and plain values as arguments)
and ``DeleteRefs`` steps, the program generates the source of one function, one line per step::

    def block(stream, e, call):
        e[12] = f0(e[3], c0_1)
        e[13] = f1(e[12])
        e.pop(12, None)

with the functions and constants bound as its globals, so the replay runs that run in one call. A failure inside
names its step by the line it happened on (``failing_step``).
"""

from __future__ import annotations

from .steps import Call, Delete

__all__ = ["blockable", "compile_block", "failing_step"]

_FIRST_LINE = 2  # the line of the block's first step (line 1 is its def)


def blockable(step) -> bool:
    return (type(step) is Call and step.fast) or type(step) is Delete


def compile_block(steps: list, first: int):
    """One function running ``steps`` (``blockable``, the program's steps ``first``, ``first + 1``, ...)."""
    names: dict = {}
    lines = ["def block(stream, e, call):"]
    for k, step in enumerate(steps):
        if type(step) is Delete:
            lines.append("    " + ("; ".join(f"e.pop({rid}, None)" for rid in step.ids) or "pass"))
            continue
        names[f"f{k}"] = step.fn
        slots = dict(step.slots)
        args = []
        for pos, value in enumerate(step.args):
            if pos in slots:
                args.append(f"e[{slots[pos]}]")
            else:
                names[f"c{k}_{pos}"] = value
                args.append(f"c{k}_{pos}")
        lines.append(f"    e[{step.single}] = f{k}({', '.join(args)})")
    code = compile("\n".join(lines), f"<recording steps {first}-{first + len(steps) - 1}>", "exec")
    exec(code, names)
    block = names["block"]
    block.first_step = first
    return block


def failing_step(run, start: int, error: BaseException) -> int:
    """The index of the step that raised ``error`` in runner ``run``, which starts at step ``start``."""
    code = getattr(run, "__code__", None)
    if getattr(run, "first_step", None) is None:
        return start
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return start + tb.tb_lineno - _FIRST_LINE
        tb = tb.tb_next
    return start
