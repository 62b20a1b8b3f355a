"""Gradients one at a time, as backward produces them (Monarch's ``monarch.gradient_generator``: ``grad_generator``,
``grad_function``, ``gradient_execution_order``).

``grad_generator(roots, with_respect_to, grad_roots)`` is ``torch.autograd.grad(roots, with_respect_to, grad_roots)``
that yields the gradients in the order of ``with_respect_to``, each as soon as the part of backward it needs has
run, and runs nothing more until the next one is asked for. A data-parallel step reduces each gradient while backward
computes the next (Monarch's overlap pattern)::

    for p, g in zip(params, dm.grad_generator(loss, params)):   # params in gradient_execution_order
        p.grad = g.reduce("dp", "avg")                           # sent before backward's ops for the next one

How: the autograd graph of the roots is read once (``next_functions``). For the k-th gradient, the nodes it needs
that have not run yet (its buffer's producers and their ancestors) form a stage, which runs as one call of torch's
own engine, ``torch.autograd.grad`` with the stage's inputs as ``GradientEdge`` outputs (the roots' gradients, and
the gradients earlier stages left at the stage's border) and the gradients leaving it as ``GradientEdge`` inputs.
Every node runs once, with all its inputs, in torch's engine (hooks, custom ``Function`` s and shape checks as in
``torch.autograd.grad``), so the values are those of ``torch.autograd.grad``; a gradient that reaches a buffer from
two stages is the sum of the two parts, which may differ from autograd's own order of additions in the last bits.

Two differences from Monarch's C++ generator, which drives autograd's nodes itself: (1) it splits a node that feeds
two stages (``mm``'s weight and input gradients), which torch's Python API cannot: here such a node runs whole in
the first stage that needs it; (2) torch's engine runs every node between what a call is given and what it captures,
so where a gradient reaches a node by two paths (a residual connection ``h + f(h)``), the stage that hands on the
first part also runs the other path down to that node: a residual block's gradients come in one stage, one after
the other, not layer by layer. A stage is widened until torch's engine runs exactly it (``_run_stage``).

Each stage runs with the roots' mesh and stream active (Monarch restores the mesh and stream of the forward pass; an
autograd graph here cannot cross meshes or streams: ``to_mesh`` refuses tensors that require grad). Saved tensors
of a node are freed when it runs (``retain_graph=False``): like Monarch's, a generator is the graph's one backward.
"""

from __future__ import annotations

import contextlib
import functools
import math
import types

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from .tensor import Tensor

__all__ = ["grad_generator", "grad_function", "gradient_execution_order"]


def _edge(x, what: str, i: int, graph: "_Graph | None" = None) -> "GradientEdge | None":
    """The ``GradientEdge`` of ``x`` (a tensor or an edge), ``what[i]`` in errors. A leaf's is its ``AccumulateGrad``
    node: found in ``graph`` if given (None if the leaf is not in it: no path reaches it), else through torch's helper
    (one view op, on a remote leaf's stream)."""
    if isinstance(x, GradientEdge):
        return x
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}[{i}] must be a tensor or a torch.autograd.graph.GradientEdge, got {type(x).__name__}")
    if not x.requires_grad:
        raise ValueError(f"{what}[{i}] (shape {tuple(x.shape)}) does not require grad and has no grad_fn: there is "
                         "no gradient to compute for it")
    if x.grad_fn is not None:
        return GradientEdge(x.grad_fn, x.output_nr)
    if graph is not None:
        node = graph.accumulators.get(id(x))
        return None if node is None else GradientEdge(node, 0)
    with x.stream.activate() if isinstance(x, Tensor) else contextlib.nullcontext():
        return get_gradient_edge(x)


class _Graph:
    """The autograd graph below some nodes: ``children[node]`` are its (node, input number) edges, ``feeders[(node,
    input number)]`` the nodes whose outputs go into that input, ``parents[node]`` the nodes with an edge to it."""

    def __init__(self, nodes):
        self.children: dict = {}
        self.feeders: dict = {}
        self.parents: dict = {}
        self.index: dict = {}  # node -> its place in the walk (a deterministic order of the nodes)
        self.accumulators: dict = {}  # id of a leaf tensor -> its AccumulateGrad node
        stack = list(nodes)
        while stack:
            node = stack.pop()
            if node in self.children:
                continue
            self.index[node] = len(self.index)
            leaf = getattr(node, "variable", None)  # an AccumulateGrad node's tensor
            if leaf is not None:
                self.accumulators[id(leaf)] = node
            edges = tuple((child, nr) for child, nr in node.next_functions if child is not None)
            self.children[node] = edges
            for child, nr in edges:
                self.feeders.setdefault((child, nr), set()).add(node)
                self.parents.setdefault(child, set()).add(node)
                if child not in self.children:
                    stack.append(child)

    def order(self, buffer) -> tuple:
        """A deterministic sort key of a (node, input number) pair: the same program sends the same messages."""
        return self.index[buffer[0]], buffer[1]

    def ancestors(self, nodes, done: set) -> set:
        """``nodes`` and every node above them, except those in ``done``."""
        found: set = set()
        stack = list(nodes)
        while stack:
            node = stack.pop()
            if node in found or node in done:
                continue
            found.add(node)
            stack.extend(self.parents.get(node, ()))
        return found

    def executed(self, starts, capture_nodes: set) -> set:
        """The nodes torch's engine runs for a call that feeds the nodes ``starts`` and captures inputs of
        ``capture_nodes``: those reachable from ``starts`` with a child that leads to a capture (engine.cpp's
        ``init_to_execute``; a node whose input is captured and that leads nowhere is not run)."""
        leads: dict = {}  # node -> whether it is a capture node or leads to one
        needed: set = set()
        seen: set = set()
        for start in starts:
            if start in seen:
                continue
            seen.add(start)
            stack = [(start, iter(self.children[start]))]
            while stack:  # iterative post-order: deep graphs (long sequences) exceed Python's recursion limit
                node, edges = stack[-1]
                for child, _ in edges:
                    if child not in seen:
                        seen.add(child)
                        stack.append((child, iter(self.children[child])))
                        break
                else:
                    stack.pop()
                    if any(leads[c] for c, _ in self.children[node]):
                        needed.add(node)
                    leads[node] = node in capture_nodes or node in needed
        return needed


class _Generator:
    """The iterator ``grad_generator`` returns (see the module's docstring)."""

    def __init__(self, graph: _Graph, roots: list, grad_roots: list, with_respect_to: list, context):
        self._graph = graph
        self._targets = [None if e is None else (e.node, e.output_nr) for e in with_respect_to]
        self._wanted = set(self._targets)
        self._context = context
        self._done: set = set()  # nodes that have run
        self._grads: dict = {}  # (node, input number) -> the gradient that has reached it so far
        for edge, grad in zip(roots, grad_roots):
            if grad is None:
                with context():
                    meta = edge.node._input_metadata[edge.output_nr]
                    grad = torch.ones(meta.shape, dtype=meta.dtype, device=meta.device)
            self._add((edge.node, edge.output_nr), grad)
        self._next = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self._next >= len(self._targets):
            raise StopIteration
        target = self._targets[self._next]
        self._next += 1
        pending = [n for n in self._graph.feeders.get(target, ()) if n not in self._done]
        if pending:
            self._run_stage(pending)
        grad = self._grads.get(target)
        if self._next == len(self._targets):  # nothing more runs: let the graph and the border's gradients go
            self._grads.clear()
            self._graph = _Graph(())
        return grad

    def _add(self, buffer, grad) -> None:
        if grad is None:
            return
        before = self._grads.get(buffer)
        if before is None:
            self._grads[buffer] = grad
        else:
            with torch.no_grad():
                self._grads[buffer] = before + grad

    def _run_stage(self, pending) -> None:
        graph, done = self._graph, self._done
        stage = graph.ancestors(pending, done)
        while True:
            # gradients leaving the stage, and those asked for that the stage's nodes consume
            captures = sorted({(child, nr) for node in stage for child, nr in graph.children[node]
                               if child not in stage or (child, nr) in self._wanted}, key=graph.order)
            entries = sorted({(node, nr) for (node, nr) in self._grads if node in stage}, key=graph.order)
            executed = graph.executed({node for node, _ in entries}, {node for node, _ in captures})
            extra = executed - stage
            if not extra:
                break
            stage |= graph.ancestors(extra, done)
        if entries:
            outputs = [GradientEdge(node, nr) for node, nr in entries]
            grad_outputs = [self._grads[b] for b in entries]
            inputs = [GradientEdge(node, nr) for node, nr in captures]
            for b in entries:
                if b not in self._wanted:
                    del self._grads[b]  # consumed by this stage: free it on the workers as soon as it has run
            with self._context():
                found = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True, materialize_grads=False)
            for b, grad in zip(captures, found):
                self._add(b, grad)
        done |= stage


def _context_of(roots: list):
    """The context each stage runs in: the mesh and stream of the roots' remote tensors (none for local ones)."""
    remote = [r for r in roots if isinstance(r, Tensor)]
    if not remote:
        return contextlib.nullcontext
    first = remote[0]

    @contextlib.contextmanager
    def context():
        with first.mesh.activate(), first.stream.activate():
            yield

    return context


def grad_generator(roots=(), with_respect_to=(), grad_roots=()):
    """An iterator over the gradients of ``roots`` with respect to each of ``with_respect_to``, in that order, each
    computed when it is asked for (Monarch's ``grad_generator``; see the module's docstring).

    ``roots``: a tensor or a sequence of tensors (or ``torch.autograd.graph.GradientEdge`` s) to differentiate;
    ``with_respect_to``: tensors (leaves or not) or edges; ``grad_roots``: the gradient of each root (``None``, or
    left out: ones of the root's shape, for a root of any shape, as Monarch's). Each item is a tensor of its
    ``with_respect_to`` entry's shape and dtype (remote for remote roots), or None where no path leads to it (torch's
    ``allow_unused``); the values equal ``torch.autograd.grad(roots, with_respect_to, grad_roots)``. Leaves' ``.grad``
    is not touched. Raises ``TypeError`` for an entry that is neither a tensor nor an edge, ``ValueError`` for a tensor
    that does not require grad or more ``grad_roots`` than roots, and what torch's engine raises (a second backward
    through freed buffers, a gradient of the wrong shape)."""
    if isinstance(roots, (torch.Tensor, GradientEdge)):
        roots = [roots]
    roots, with_respect_to, grad_roots = list(roots), list(with_respect_to), list(grad_roots)
    if len(grad_roots) > len(roots):
        raise ValueError(f"grad_generator: {len(grad_roots)} grad_roots for {len(roots)} roots")
    edges = [_edge(r, "roots", i) for i, r in enumerate(roots)]
    graph = _Graph([e.node for e in edges])
    wrt = [_edge(w, "with_respect_to", i, graph) for i, w in enumerate(with_respect_to)]
    for i, g in enumerate(grad_roots):
        if g is not None and not isinstance(g, torch.Tensor):
            raise TypeError(f"grad_roots[{i}] must be a tensor or None, got {type(g).__name__}")
    grad_roots = grad_roots + [None] * (len(roots) - len(grad_roots))
    return _Generator(graph, edges, grad_roots, wrt, _context_of(roots))


def gradient_execution_order(roots, with_respect_to) -> list:
    """The indices of ``with_respect_to`` in the order autograd run on ``roots`` would produce their gradients
    (Monarch's ``gradient_execution_order``): latest first use in backward first, i.e. by the highest sequence number
    among the nodes that consume each one, highest first; entries no path reaches come first. Pass
    ``[with_respect_to[i] for i in order]`` to ``grad_generator`` to reduce each gradient as soon as backward has it.
    Arguments as ``grad_generator``'s; raises the same errors."""
    if isinstance(roots, (torch.Tensor, GradientEdge)):
        roots = [roots]
    graph = _Graph([_edge(r, "roots", i).node for i, r in enumerate(roots)])
    edges = [_edge(w, "with_respect_to", i, graph) for i, w in enumerate(with_respect_to)]
    targets = [None if e is None else (e.node, e.output_nr) for e in edges]
    first_use = {t: math.inf for t in targets}
    for buffer in first_use:
        users = graph.feeders.get(buffer, ()) if buffer is not None else ()
        if users:
            first_use[buffer] = min(node._sequence_nr() for node in users)
    return sorted(range(len(targets)), key=lambda i: first_use[targets[i]], reverse=True)


class _GradFunction(torch.autograd.Function):
    """``grad_function``'s autograd node: ``forward`` runs ``fn`` and keeps the backward continuation it returns, with
    the tensors its closure holds saved for backward (so autograd checks and frees them) instead of held by it."""

    @staticmethod
    def forward(ctx, fn, *args):
        result, backward = fn(*args)
        if not callable(backward):
            raise TypeError(f"grad_function: {getattr(fn, '__name__', fn)!r} must return (result, backward function), "
                            f"got a {type(backward).__name__} as the second item")
        cells = backward.__closure__ or ()
        values = [cell.cell_contents for cell in cells]
        leaves, ctx.spec = tree_flatten(values)
        ctx.tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        ctx.save_for_backward(*[leaves[i] for i in ctx.tensor_at])
        ctx.others = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        ctx.code = backward.__code__, backward.__globals__, backward.__name__, backward.__defaults__
        for cell in cells:
            cell.cell_contents = None  # the continuation holds nothing now: the saved tensors are autograd's
        return result

    @staticmethod
    def backward(ctx, *grads):
        leaves = list(ctx.others)
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            leaves[i] = t
        closure = tuple(types.CellType(v) for v in tree_unflatten(leaves, ctx.spec))
        code, globals_, name, defaults = ctx.code
        out = types.FunctionType(code, globals_, name, defaults, closure)(*grads)
        return (None, *out) if isinstance(out, tuple) else (None, out)


def grad_function(fn):
    """Make ``fn`` a differentiable function with a hand-written backward (Monarch's ``grad_function``). ``fn(*args)``
    returns ``(result, backward)``, where ``backward(*grad_of_each_result)`` is a function defined inside ``fn``
    (a closure) that returns the gradient of each argument (a tensor, or a tuple of one per argument; None for one
    without). The tensors ``backward`` uses from ``fn`` are kept as autograd's saved tensors, so they are freed with
    the graph. Returns the function to call: ``grad_function(fn)(*args)`` gives ``result`` with a grad_fn.
    Positional arguments only (``torch.autograd.Function.apply``'s rule); ``TypeError`` if ``fn`` does not return a
    pair whose second item is callable."""
    return functools.partial(_GradFunction.apply, fn)
