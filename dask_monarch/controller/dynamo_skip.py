"""``skip_dynamo``: code that Dynamo (``torch.compile``'s frame evaluator) must neither compile nor trace.

A ``torch.compile``d function called under ``mesh.activate()`` runs its ops through the mode's handler, and the
garbage collector may run a remote object's ``__del__`` in the middle of such a function; Dynamo's frame callback
sees every frame its thread evaluates, so without a mark it would compile the handler, the finalizer and what they
call (session bookkeeping) as if they were the user's code. torch's own ``torch._dynamo.disable`` wraps the function
and turns the callback off and on around every call (about 1 us, on the per-op path); a per-code strategy costs
nothing per call."""

from __future__ import annotations

try:  # Dynamo's per-code frame strategy (C): a code marked (SKIP, SKIP) runs, with all it calls, outside Dynamo
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
except ImportError:  # pragma: no cover - a torch without it: the marks do nothing
    set_code_exec_strategy = None

__all__ = ["skip_dynamo"]


def skip_dynamo(fn):
    """Mark ``fn`` (a function) so that Dynamo neither compiles its frames nor any frame it calls, and does not
    inline it when tracing (``torch._dynamo.disable``'s effect, without its wrapper: that wrapper turns Dynamo's
    frame callback off and on again around every call, about 1 us a call on the per-op path, even when nothing
    compiles). Returns ``fn``; without torch's ``set_code_exec_strategy`` it does nothing."""
    if set_code_exec_strategy is not None:
        set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
        fn._torchdynamo_disable = True  # Dynamo's tracer: a call of it is a graph break, not inlined
    return fn
