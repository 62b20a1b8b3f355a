"""``compile``: record a function's operations once, then run each later call as one ``CallRecording`` per rank
(spec §1 "Coalescing and compile", §7; Monarch's ``monarch.compile``; DESIGN.md "Decisions").

The first call with a given *cache key* records: the function runs on the controller with a formal tensor for
each tensor argument, and what its operations would send is captured instead (``recording.py``), defined on the
ranks as a recording, and called. A later call with the same key sends one ``CallRecording`` per rank, which the
workers replay at their own speed; the function's Python does not run again. The key is the non-tensor argument
values, the active mesh and stream, grad mode, autocast and the default dtype, each tensor argument's metadata (sizes, strides, offset, dtype, device, layout,
mesh, stream, ``requires_grad``) and the pattern of aliasing among the tensor arguments and with the tensors the
recording captured. Storage offsets count only relative to the other arguments on the same storage, so a batch
sliced from a larger tensor at another row replays the same recording.

Beyond Monarch: a whole training step compiles (forward, ``loss.backward()``, ``reduce_`` of the gradients,
``optimizer.step()``, ``zero_grad()``): tensors the step uses without taking them as arguments (parameters,
optimizer state) are captures, read and written in place by every replay. Results are detached: autograd of a
compiled function runs inside it.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..protocol import RecordingResult
from .coalescing import compiling, is_coalescing, recording_block
from .mesh import get_active_mesh
from .compile_notices import BACKENDS, fallbacks, warn_fallbacks, watch
from .recording import Recorder, Recording, normalized
from .stream import get_active_stream
from .tensor import Tensor

__all__ = ["compile", "Compiled"]


def _cache_key(leaves: list, spec, name: str) -> tuple:
    """``(key, tensor arguments)`` for the flattened arguments ``leaves`` of structure ``spec``. Raises ``TypeError`` for a local
    ``torch.Tensor`` (LOCAL_TENSOR), an argument that requires grad (REQUIRES_GRAD) or an unhashable value."""
    mesh = get_active_mesh()  # operations without tensor inputs (factories) run on the active mesh and stream
    parts = [spec, None if mesh is None else (id(mesh._session), mesh._rank_list, mesh.names), get_active_stream(),
             torch.is_grad_enabled(), torch.is_autocast_enabled("cuda"), torch.is_autocast_enabled("cpu"),
             torch.get_default_dtype()]
    tensors = []
    storages: dict = {}  # storage -> (its index, the storage offset of its first tensor)
    for i, x in enumerate(leaves):
        if isinstance(x, Tensor):
            if x.requires_grad:
                raise TypeError(
                    f"REQUIRES_GRAD: compiled function {name}: argument {i} ({x.ref!r}) requires grad; a compiled "
                    "function runs its autograd inside: pass parameters by using them in the function (they are "
                    "captured), not as arguments"
                )
            size, stride, offset, dtype, device = x._meta
            alias, first = storages.setdefault(x._storage, (len(storages), offset))
            mesh = x.mesh
            # offsets only relative to the other tensors of the same storage: a batch sliced from a larger tensor
            # at another row is the same recording
            parts.append((size, stride, offset - first, dtype, device, x.layout,
                          id(mesh._session), mesh._rank_list, mesh.names, x.stream, alias))
            tensors.append(x)
        elif isinstance(x, torch.Tensor):
            raise TypeError(
                f"LOCAL_TENSOR: compiled function {name}: argument {i} is a local torch.Tensor (shape "
                f"{tuple(x.shape)}); pass remote tensors (made under mesh.activate()) or plain values"
            )
        else:
            try:
                hash(x)
            except TypeError:
                raise TypeError(
                    f"compiled function {name}: argument {i} of type {type(x).__name__} is not hashable; a compiled "
                    "function's non-tensor arguments are part of its cache key"
                ) from None
            parts.append((type(x), x))
    return tuple(parts), tensors


def _same(a: list, b: list) -> bool:
    """Whether two lists of non-tensor results are equal (values whose ``==`` is not a bool count as equal)."""
    try:
        return bool(a == b)
    except Exception:
        return True


_SIMPLE = frozenset((int, float, bool, str, type(None)))


def _flatten(args: tuple, kwargs: dict):
    """``(leaves, spec)`` of a call's arguments: ``torch.utils._pytree``'s, except for the common call of positional
    tensors and plain values, whose spec is their count (cheaper; it only names the call's structure)."""
    if not kwargs and all(type(a) in _SIMPLE or isinstance(a, Tensor) for a in args):
        return list(args), len(args)
    return tree_flatten((args, kwargs))


def _unflatten(leaves: list, spec):
    return (tuple(leaves), {}) if type(spec) is int else tree_unflatten(leaves, spec)


class _Entry:
    """One recording of the function and the non-tensor leaves of its result."""

    def __init__(self, recording: Recording | None, spec, values: list, positions: list, reference: list | None):
        self.recording = recording
        self.spec = spec
        self.values = values  # the result's leaves, None where a tensor goes
        self.positions = positions  # where the result tensors go among them
        self.reference = reference  # the recording's normalized messages, until verified (verify=True)
        self.single = spec.is_leaf() and positions == [0]  # the function returns one tensor

    def matches(self, tensors: list) -> bool:
        return self.recording is None or (not self.recording.session.closed and self.recording.matches(tensors))

    def call(self, tensors: list):
        if self.recording is None:
            return tree_unflatten(list(self.values), self.spec)
        results = self.recording.call(tensors)
        if self.single:
            return results[0]
        values = list(self.values)
        for position, result in zip(self.positions, results):
            values[position] = result
        return tree_unflatten(values, self.spec)


class Compiled:
    """``fn`` wrapped by ``compile`` (see ``compile``); call it like ``fn``."""

    def __init__(self, fn, verify: bool = True, cuda_graph: bool = False, warmup: int = 0, backend: str | None = None):
        if not callable(fn):
            raise TypeError(f"compile needs a callable, got {type(fn).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"compile: backend must be one of {sorted(BACKENDS, key=str)}, got {backend!r}")
        if not isinstance(verify, bool):
            raise TypeError(f"compile: verify must be a bool, got {verify!r}")
        if not isinstance(cuda_graph, bool):
            raise TypeError(f"compile: cuda_graph must be a bool, got {cuda_graph!r}")
        if type(warmup) is not int or warmup < 0:
            raise ValueError(f"compile: warmup must be a non-negative int, got {warmup!r}")
        self.fn = fn
        self.verify = verify
        self.cuda_graph = cuda_graph
        self.warmup = warmup
        self.backend = backend
        self._warm: dict = {}  # cache key -> calls run eagerly so far
        self.name = getattr(fn, "__qualname__", None) or repr(fn)
        self._cache: dict = {}
        self._warned = False
        #: how many times the function was recorded (a recording, and the re-recording of ``verify``)
        self.recordings = 0
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if is_coalescing() or compiling() is not None:
            return self.fn(*args, **kwargs)  # inside coalescing() or another compiled function: its messages join
        if self.backend and fallbacks:
            warn_fallbacks(self)
        leaves, spec = _flatten(args, kwargs)
        key, tensors = _cache_key(leaves, spec, self.name)
        for entry in self._cache.get(key, ()):
            if entry.matches(tensors):
                if entry.reference is not None:
                    self._verify(entry, leaves, spec, tensors)
                return entry.call(tensors)
        if self._warm.get(key, 0) < self.warmup:
            self._warm[key] = self._warm.get(key, 0) + 1
            out = self.fn(*args, **kwargs)  # detached as a replay's results are: every call returns alike
            return tree_map(lambda x: x.detach() if isinstance(x, Tensor) and x.requires_grad else x, out)
        self._prune()
        entry = self._record(leaves, spec, tensors)
        self._cache.setdefault(key, []).append(entry)
        self._warn_if_many()
        return entry.call(tensors)

    #: recordings of one compiled function (over its live sessions) beyond which it warns, once
    MANY_RECORDINGS = 64

    def _prune(self) -> None:
        """Forget the recordings of sessions that ended."""
        for key, entries in list(self._cache.items()):
            entries[:] = [e for e in entries if e.recording is None or not e.recording.session.closed]
            if not entries:
                del self._cache[key]
                self._warm.pop(key, None)

    def _warn_if_many(self) -> None:
        count = sum(len(entries) for entries in self._cache.values())
        if count > self.MANY_RECORDINGS and not self._warned:
            self._warned = True
            warnings.warn(
                f"compiled function {self.name} has {count} recordings: an argument whose value changes from call "
                "to call (a float learning rate, a step counter) makes a new recording each time; pass it as a "
                "remote tensor instead", RuntimeWarning, stacklevel=3,
            )

    # ------------------------------------------------------------------------------------------- recording
    def _session(self, tensors: list):
        if tensors:
            session = tensors[0].mesh._session
            for i, t in enumerate(tensors[1:], 1):
                if t.mesh._session is not session:
                    raise TypeError(
                        f"WRONG_MESH: compiled function {self.name}: its tensor arguments belong to two sessions "
                        f"(tensor argument 0 to session {session.tag}, tensor argument {i} to session "
                        f"{t.mesh._session.tag})"
                    )
            return session
        mesh = get_active_mesh()
        if mesh is None:
            raise ValueError(
                f"compiled function {self.name}: no mesh: pass remote tensors or call it under mesh.activate()"
            )
        return mesh._session

    def _run_recording(self, leaves, spec, tensors):
        """Run the function on formals with the session's messages captured. Returns ``(recorder, result leaves,
        result spec, output tensors)``; on an error nothing is sent and the error is raised."""
        session = self._session(tensors)
        recorder = Recorder(session, self.name)
        with session.lock:
            session.check_ok()
            if session.recorder is not None:
                raise RuntimeError(
                    f"compiled function {self.name}: {session.recorder.name} is recording on this session (from "
                    "another thread); a session records one compiled function at a time"
                )
            session.recorder = recorder
        try:
            with recording_block(self.name):
                formals = iter(recorder.formals(tensors))
                args, kwargs = _unflatten([next(formals) if isinstance(x, Tensor) else x for x in leaves], spec)
                result = self.fn(*args, **kwargs)
                out_leaves, out_spec = tree_flatten(result)
                outputs = [x for x in out_leaves if isinstance(x, Tensor)]
                for j, out in enumerate(outputs):
                    if out.mesh._session is not session:
                        raise TypeError(
                            f"WRONG_MESH: compiled function {self.name} returns a tensor of another session"
                        )
                    out.check_usable()
                    session.send(RecordingResult(out.ref, j, out.stream.ref_for(session)), out.mesh._rank_list)
                undropped = recorder.undropped_borrows()
                if undropped:
                    raise RuntimeError(
                        f"compiled function {self.name}: borrows made inside it must be dropped inside it: "
                        f"{', '.join(map(repr, undropped))}"
                    )
        except BaseException:
            with session.lock:
                session.recorder = None
            recorder.close(f"inside compiled function {self.name}, whose recording failed")
            raise
        with session.lock:
            session.recorder = None
        self.recordings += 1
        recorder.close(
            f"the end of compiled function {self.name}'s recording: a tensor made inside a compiled function exists "
            "only while it runs; return it from the function to use it after the call (state that a function makes "
            "on its first call, such as an optimizer's momentum buffers, must exist before it is recorded: "
            "compile(fn, warmup=1) runs the first call eagerly)"
        )
        return recorder, out_leaves, out_spec, outputs

    def _record(self, leaves, spec, tensors) -> _Entry:
        recorder, out_leaves, out_spec, outputs = _record_and_define(self, leaves, spec, tensors)
        positions = [i for i, x in enumerate(out_leaves) if isinstance(x, Tensor)]
        values = [None if isinstance(x, Tensor) else x for x in out_leaves]
        recording = None
        if recorder.messages:
            recording = Recording(recorder, tensors, outputs, self.cuda_graph, self.backend or "")
            if self.backend:
                watch(recording, self)
        return _Entry(recording, out_spec, values, positions, normalized(recorder) if self.verify else None)

    def _verify(self, entry: _Entry, leaves, spec, tensors) -> None:
        """Record again and compare with the first recording (Monarch's ``verify``): ``RuntimeError`` naming the
        first operation that differs, e.g. when the function reads a global that changed, and the non-tensor
        results. Until a comparison succeeds, every reuse compares again."""
        recorder, out_leaves, out_spec, _ = _record_and_define(self, leaves, spec, tensors)
        first = entry.reference
        second = normalized(recorder)
        for k, (a, b) in enumerate(zip(first, second)):
            if a != b:
                seq = getattr(recorder.messages[k][1], "seq", None) if k < len(recorder.messages) else None
                op = recorder.ops[seq] if isinstance(seq, int) and 0 <= seq < len(recorder.ops) else None
                where = f" (recorded at {op[1]})" if op else ""
                raise RuntimeError(
                    f"compiled function {self.name}: the recording diverges at operation {k} of {len(first)}{where}: "
                    f"the first recording has\n  {a}\nthe second\n  {b}\n(the function's messages depend on "
                    "something other than its arguments: a global or a captured tensor that changed; "
                    "compile(verify=False) turns this check off)"
                )
        if len(first) != len(second):
            raise RuntimeError(
                f"compiled function {self.name}: the recording diverges at operation {min(len(first), len(second))}: "
                f"the first recording has {len(first)} operations, the second {len(second)}"
            )
        values = [None if isinstance(x, Tensor) else x for x in out_leaves]
        if out_spec != entry.spec or not _same(values, entry.values):
            raise RuntimeError(
                f"compiled function {self.name}: the recording diverges in its non-tensor results: the first "
                f"recording returned {tree_unflatten(entry.values, entry.spec)!r}, the second "
                f"{tree_unflatten(values, out_spec)!r} (a compiled function's non-tensor results are those of its "
                "recording; return tensors for values that change)"
            )
        entry.reference = None

    def __repr__(self) -> str:
        backend = f", backend={self.backend!r}" if self.backend else ""
        return f"compile({self.fn!r}, verify={self.verify}{backend})"


def _record_and_define(compiled: Compiled, leaves, spec, tensors):
    """Run ``compiled``'s function once, recording its messages: ``(recorder, output leaves, output spec, output
    tensors)``. Every recording goes through here (Monarch's ``_coalescing._record_and_define``): the first call
    for a new signature, and ``verify``'s second recording; a call that replays does not."""
    return compiled._run_recording(leaves, spec, tensors)


def compile(fn=None, *, verify: bool = True, cuda_graph: bool = False, warmup: int = 0, backend: str | None = None):
    """Wrap ``fn`` so that its first call (per cache key) records its operations and later calls replay them with
    one ``CallRecording`` per rank (Monarch's ``compile``; spec §7). Usable as ``compile(fn)``, ``@compile`` or
    ``@compile(verify=False)``.

    * ``verify``: the first reuse of a recording records the function again and raises ``RuntimeError`` naming
      the first operation that differs ("diverges at operation N").
    * ``cuda_graph``: on GPU workers, each stream's part of a replay is captured as a CUDA graph after the first
      replay and launched on later calls (DESIGN.md "Decisions").
    * ``warmup``: the first ``warmup`` calls per cache key run eagerly, before the recording, so that state a
      function makes on its first call (an optimizer's momentum buffers, say) exists before it is recorded.
    * ``backend``: ``None`` (default) replays each run of aten operations as one generated Python function
      (``worker/blocks.py``); ``"inductor"`` (beyond Monarch) has each rank compile those runs with
      ``torch.compile`` (Inductor) at the recording's second call, so that pointwise operations fuse; collectives,
      borrows and remote functions stay steps of their own, in order. A run Inductor cannot compile replays as
      Python, and the next call of the compiled function warns once (``RuntimeWarning``) naming the reason. With
      ``cuda_graph=True`` the compiled replay is captured as a CUDA graph at the third call. ``ValueError`` for
      another value.

    Rules (Monarch's): tensors the function uses but does not take as arguments are *captured* (kept alive with
    the recording; changing their metadata or rebinding them is not seen); tensors made inside cannot be used
    after the call unless returned (``TypeError`` DROPPED); a fetch, ``inspect`` or ``coalescing()`` inside raises
    ``RuntimeError``; arguments that require grad raise ``TypeError`` (REQUIRES_GRAD), while results are detached;
    a local ``torch.Tensor`` argument raises ``TypeError`` (LOCAL_TENSOR); a failure inside a replay is raised
    by a fetch of what depends on it as ``RemoteException`` naming the compiled function, the operation (its
    position and what it called) and the rank.
    """
    if fn is None:
        return lambda f: Compiled(f, verify, cuda_graph, warmup, backend)
    return Compiled(fn, verify, cuda_graph, warmup, backend)
