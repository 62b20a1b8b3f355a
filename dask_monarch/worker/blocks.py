"""Runs of simple steps of a recording compiled into one Python function (``Program.finish``).

A replay's cost beside the operations themselves is, per step, a Python call and its argument handling. For a run
of consecutive ``fast`` ``CallFunction`` steps (ops whose schema returns the tensors the step stores, with refs,
lists of refs and constants as arguments) and ``DeleteRefs`` steps, the program generates the source of one
function, one line per step::

    def block(stream, e, call):
        e[12] = f0(e[3], c0_1)
        e[13], _, e[14] = f1(e[12], [e[3], e[4]], eps=k1_eps)
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

    def expr(spec, name: str) -> str:
        kind = spec[0]
        if kind == "ref":
            return f"e[{spec[1]}]"
        if kind == "list":
            items = ", ".join(expr(item, f"{name}_{i}") for i, item in enumerate(spec[2]))
            return f"[{items}]" if spec[1] is list else f"({items},)"
        names[name] = spec[1]
        return name

    for k, step in enumerate(steps):
        if type(step) is Delete:
            lines.append("    " + ("; ".join(f"e.pop({rid}, None)" for rid in step.ids) or "pass"))
            continue
        names[f"f{k}"] = step.fn
        args = [expr(spec, f"c{k}_{i}") for i, spec in enumerate(step.args)]
        args += [f"{key}={expr(spec, f'k{k}_{key}')}" for key, spec in step.kwargs.items()]
        call = f"f{k}({', '.join(args)})"
        targets = [f"e[{ref.id}]" if ref is not None else "_" for ref in step.results]
        if all(t == "_" for t in targets):
            lines.append(f"    {call}")
        elif len(targets) == 1:
            lines.append(f"    {targets[0]} = {call}")
        else:
            lines.append(f"    {', '.join(targets)} = {call}")
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
