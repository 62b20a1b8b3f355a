"""Runs of simple steps of a recording generated as one straight-line Python function (``Program.finish``).

A replay's cost beside the operations themselves was, per step, a Python call and its argument handling. Each
maximal run of ``blockable`` steps (``fast`` ``CallFunction`` steps: ops whose schema returns what the step
stores, with refs, lists of refs and constants as arguments; and ``DeleteRefs``) becomes the source of one
function, one line per step, whose locals are the run's intermediates::

    def block(e):
        r12 = f0(r3 := e[3], c0)              # a ref from outside the run is read from the ref table once
        r13, _, r14 = f1(r12, [r3, r4 := e[4]], eps=c1)
        del r12                               # a recorded DeleteRefs: freed here, as in eager
        e[14] = r14                           # a ref used after the run goes to the ref table

with the functions (the plain torch bindings of ``worker/bindings.py``) and constants bound as its globals, so a
replay runs the whole run in one call and an operation costs what it costs in eager PyTorch. A failure inside
names its step by the line it happened on (``failing_step``).
"""

from __future__ import annotations

from .bindings import fast_callable
from .steps import Call, Delete

__all__ = ["blockable", "compile_block", "failing_step", "Block"]

_FIRST_LINE = 2  # the line of the block's first step (line 1 is its def)


def blockable(step) -> bool:
    return (type(step) is Call and step.fast) or type(step) is Delete


class Block:
    """What a replay calls for a run of blockable steps ``first`` .. ``first + len(steps) - 1``: ``run(e)``
    (the generated function). ``source`` is its text; ``lines[k]`` the step (counted from ``first``) of line
    ``k + 2``; ``inputs`` the refs it reads from the ref table, ``outputs`` those it writes there, ``pops`` those
    it deletes there."""

    def __init__(self, steps: list, first: int, escaping):
        self.steps = steps
        self.first_step = first
        names: dict = {}  # global name -> object
        by_id: dict = {}  # id(object) -> global name
        lines = ["def block(e):"]
        self.lines: list = []
        local: set = set()
        defined: set = set()  # refs a step of this run defines
        self.inputs: list = []
        self.outputs: list = []
        self.pops: list = []

        def bind(obj, prefix: str) -> str:
            name = by_id.get(id(obj))
            if name is None:
                name = by_id[id(obj)] = f"{prefix}{len(names)}"
                names[name] = obj
            return name

        def expr(spec, loads: list) -> str:
            kind = spec[0]
            if kind == "ref":
                rid = spec[1]
                if rid not in local:
                    local.add(rid)
                    loads.append(rid)
                    self.inputs.append(rid)
                    return f"(r{rid} := e[{rid}])"
                return f"r{rid}"
            if kind == "list":
                items = ", ".join(expr(item, loads) for item in spec[2])
                return f"[{items}]" if spec[1] is list else f"({items},)"
            return bind(spec[1], "c")

        for k, step in enumerate(steps):
            if type(step) is Delete:
                parts = []
                for rid in step.ids:
                    if rid in local:
                        parts.append(f"del r{rid}")
                        local.discard(rid)
                    if rid in escaping or rid not in defined:
                        parts.append(f"e.pop({rid}, None)")
                        self.pops.append(rid)
                lines.append("    " + ("; ".join(parts) or "pass"))
                self.lines.append(k)
                continue
            loads: list = []
            args = [expr(spec, loads) for spec in step.args]
            args += [f"{key}={expr(spec, loads)}" for key, spec in step.kwargs.items()]
            step.env_reads = tuple(loads)
            fn = bind(fast_callable(step.overload, step.args, step.kwargs), "f")
            call = f"{fn}({', '.join(args)})"
            targets = []
            stores = []
            for ref in step.results:
                if ref is None:
                    targets.append("_")
                    continue
                targets.append(f"r{ref.id}")
                local.add(ref.id)
                defined.add(ref.id)
                if ref.id in escaping:
                    stores.append(f"e[{ref.id}] = r{ref.id}")
                    self.outputs.append(ref.id)
            if step.returns_list:  # one ``Tensor[]`` return: its items are the results
                line = f"{', '.join(targets)}, = {call}" if targets else call
            elif all(t == "_" for t in targets):
                line = call
            else:
                line = f"{', '.join(targets)} = {call}"
            lines.append("    " + "; ".join([line] + stores))
            self.lines.append(k)
        self.source = "\n".join(lines)
        code = compile(self.source, f"<recording steps {first}-{first + len(steps) - 1}>", "exec")
        exec(code, names)
        self.run = names["block"]
        self.code = self.run.__code__

    def __call__(self, stream, env, call) -> None:
        self.run(env)

    def failing(self, error: BaseException) -> int:
        """The program index of the step that raised ``error``."""
        tb = error.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is self.code:
                line = tb.tb_lineno - _FIRST_LINE
                return self.first_step + (self.lines[line] if 0 <= line < len(self.lines) else 0)
            tb = tb.tb_next
        return self.first_step


def compile_block(steps: list, first: int, escaping=frozenset()) -> Block:
    """One ``Block`` running ``steps`` (``blockable``, the program's steps ``first``, ``first + 1``, ...); the refs
    in ``escaping`` are read after the run (by other steps), so the block also writes them to the ref table."""
    return Block(steps, first, escaping)


def failing_step(run, start: int, error: BaseException) -> int:
    """The index of the step that raised ``error`` in runner ``run``, which starts at step ``start``."""
    failing = getattr(run, "failing", None)
    return failing(error) if failing is not None else start
