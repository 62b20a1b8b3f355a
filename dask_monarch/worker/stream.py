"""``StreamWorker``: one logical stream of a session on one worker (spec §2, §4; seed ``StreamActor``).

Each stream owns a thread, an ordered queue and its own ref table (``env``: ref id -> value or ``SeqError``).
The dispatcher (``TensorWorker``) only enqueues; everything below runs on the stream's thread, in order.
A handler that raises ``FatalError`` (or anything unexpected) fails the session (class F); value errors are
stored in the target refs (class V) and reported once per root failure (spec §3).
"""

from __future__ import annotations

import queue
import threading
import traceback

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..protocol import (
    CallFunction,
    DeleteRefs,
    FetchResult,
    FunctionPath,
    GetRefResult,
    PickledValue,
    Ref,
    Reduce,
    RemoteFunctionFailed,
    SendValue,
    SetRefUnitTestsOnly,
    GetRefUnitTestsOnly,
    PipeRecv,
    StreamCreationMode,
    StreamRef,
    WireValue,
    WorkerError,
    resolve_function,
)
from ..protocol.batch import STREAM_MESSAGES
from ..protocol.function import TEST_PANIC
from ..protocol.session_id import session_tag
from .borrow import BorrowStep, SessionOver
from .device import pin
from .errors import DependentError, FatalError, SeqError, ValueFailure
from .inbox import load_segment
from .reduce import ReduceHandler
from .activity import function_name
from .result_checks import mismatch
from . import pipe
from .context import _local

__all__ = ["StreamWorker", "StreamSegment", "StatusBarrier"]

_MISSING = object()
try:  # the context variable behind distributed.get_worker()
    from distributed.worker import _worker_cvar
except ImportError:  # pragma: no cover - another distributed version
    _worker_cvar = None
_STOP = object()
_PLAIN = frozenset((int, float, bool, str, bytes, type(None), torch.Tensor, torch.dtype, torch.device))


def _is_none(x) -> bool:
    return x is None


def _leaves(out) -> list:
    """Leaves of a result, flattened with ``torch.utils._pytree`` with ``None`` as a leaf (spec §2 step 4)."""
    if type(out) in _PLAIN:
        return [out]
    return tree_flatten(out, is_leaf=_is_none)[0]


def _plain_tree(value) -> bool:
    """Whether every leaf of ``value`` is a tensor or a plain value, which any controller can unpickle."""
    if type(value) in _PLAIN:
        return True
    return all(type(leaf) in _PLAIN for leaf in tree_flatten(value)[0])


def _load_argument(pickled: PickledValue):
    try:
        return pickled.load()
    except Exception as e:
        raise RuntimeError(
            f"could not unpickle an argument of type {pickled.type_name} on this worker: {type(e).__name__}: {e}"
        ) from e


def store_results(env: dict, results, leaves, what: str) -> None:
    """Store each leaf of a call's output in its result ref (None: not kept); a ref already in ``env`` is a
    ``FatalError`` (spec §3: "Duplicate write to reference")."""
    for ref, value in zip(results, leaves):
        if ref is not None:
            if ref.id in env:
                raise FatalError(f"{what}: Duplicate write to reference {ref}")
            env[ref.id] = value


def _to_cpu(value):
    """A copy of ``value`` whose tensors are detached CPU copies, safe to pickle later (spec §1 "Fetch")."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return tree_map(lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v, value)


class StatusBarrier:
    """A ``RequestStatus`` queued on every stream: the last stream to reach it emits ``Status{seq + 1}``."""

    __slots__ = ("tw", "seq", "controller", "remaining", "lock")

    def __init__(self, tw, seq: int, controller: bool, count: int):
        self.tw = tw
        self.seq = seq
        self.controller = controller
        self.remaining = count
        self.lock = threading.Lock()

    def arrive(self) -> None:
        with self.lock:
            self.remaining -= 1
            done = self.remaining == 0
        if done:
            self.tw.emit_status(self.seq, self.controller)


class StreamSegment:
    """``count`` pickled messages that all run on one stream (``protocol/batch.py``), queued on it unopened."""

    __slots__ = ("count", "blob")

    def __init__(self, count: int, blob: bytes):
        self.count = count
        self.blob = blob


class StreamWorker(ReduceHandler):
    """Stream ``ref`` of ``tensor_worker``. ``creation`` is the ``StreamCreationMode``: on a GPU worker the
    device's current stream (``UseDefaultStream``) or a new ``torch.cuda.Stream`` (``CreateNewStream``), made on
    this stream's thread and current there, so every op of the stream is issued into it and the host does not
    wait (spec §4). On CPU the work runs on the thread."""

    def __init__(self, tensor_worker, ref: StreamRef, creation: StreamCreationMode):
        self.tw = tensor_worker
        self.ref = ref
        self.creation = creation
        self.env: dict = {}
        self.pending: list = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        #: messages handed to the stream thread (counted per flush) and run by it (counted per batch); their
        #: difference is the stream's backlog (``worker/metrics.py``)
        self.enqueued = 0
        self.applied = 0
        self._segment_extra = 0  # messages in the pending segments beyond one each
        self.cuda_stream = None  # the torch.cuda.Stream on GPU workers, set on the stream's thread
        self.comm = None  # this stream's communicator over all ranks, from BackendNetworkInit (spec §5)
        self.replaying = None  # the ReplayCall this stream's thread is replaying (worker/replay.py), if any
        #: the message with a seq (or borrow step) the thread is applying or applied last, and whether it is inside
        #: a batch: read by the dashboard's heartbeat metric (``worker/activity.py``), set by the handlers with no
        #: clock and no lock (``DeleteRefs`` leaves it alone: it has no seq and never waits)
        self.current = None
        self.busy = False
        self.replay = None  # the ReplayCall running on this thread, whose operations set ``current`` (activity.py)
        self.thread = threading.Thread(
            target=self._run, name=f"monarch-{session_tag(tensor_worker.session_id)}-stream{ref.id}", daemon=True
        )
        self.thread.start()

    # ------------------------------------------------------------------ dispatcher side (one thread: the dispatcher)
    def enqueue(self, msg) -> None:
        """Queue ``msg`` (a message this stream handles, or a ``StatusBarrier``) behind everything queued before;
        delivered at the next ``flush``."""
        self.pending.append(msg)

    def enqueue_segment(self, segment: StreamSegment) -> None:
        """Queue a ``StreamSegment``: its messages run on this stream's thread, in order, at its place."""
        self.pending.append(segment)
        self._segment_extra += segment.count - 1

    def flush(self) -> None:
        if self.pending:
            self.enqueued += len(self.pending) + self._segment_extra
            self._segment_extra = 0
            self._queue.put(self.pending)
            self.pending = []

    def stop(self) -> None:
        """Stop after everything queued so far has run."""
        self.flush()
        self._queue.put(_STOP)

    def backlog(self) -> int:
        """Batches queued for the stream thread, not yet taken."""
        return self._queue.qsize()

    # ------------------------------------------------------------------------------------------- stream thread
    def _start_device(self) -> None:
        _local.stream = self
        worker = self.tw.worker
        if _worker_cvar is not None and hasattr(worker, "data"):
            _worker_cvar.set(worker)  # distributed.get_worker() in a remote function is this Dask worker
        device = self.tw.device
        pin(device)
        if device.type == "cuda":
            if self.creation is StreamCreationMode.CreateNewStream:
                self.cuda_stream = torch.cuda.Stream(device)
            else:
                self.cuda_stream = torch.cuda.current_stream(device)
            torch.cuda.set_stream(self.cuda_stream)

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self._release()

    def _release(self) -> None:
        """The stream's thread ends (after ``stop``, or after the session failed): drop at once what the stream
        holds (its ref table's tensors, its communicator, its CUDA stream, what is still queued), so that
        nothing waits for the garbage collector (the tensor worker and its streams refer to each other)."""
        self.env.clear()
        self.comm = None
        self.cuda_stream = None
        self.current = None  # a queue item (an Exchange of SendTensor) refers back to this stream
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    def _serve(self) -> None:
        tw = self.tw
        try:
            self._start_device()
        except Exception:
            tw.fail(f"stream {self.ref.id}: could not start on {tw.device}\n{traceback.format_exc()}")
            return
        get = self._queue.get
        handlers = {
            CallFunction: self.call_function,
            SendValue: self.send_value,
            Reduce: self.reduce,
            DeleteRefs: self.delete_refs,
            SetRefUnitTestsOnly: self.set_ref,
            GetRefUnitTestsOnly: self.get_ref,
            PipeRecv: self.pipe_recv,
            StatusBarrier: self.status_barrier,
            BorrowStep: self.borrow_step,
        }
        while True:
            items = get()
            if items is _STOP:
                return
            if tw.failure is not None:
                continue
            self.busy = True
            try:
                for msg in items:
                    if tw.failure is not None:  # the session failed meanwhile: run none of its queued work
                        break
                    if type(msg) is StreamSegment:
                        self.run_segment(msg, handlers)
                        continue
                    handler = handlers.get(type(msg))
                    if handler is None:  # a queue item that runs itself here (a ReplayCall: worker/recording.py)
                        self.current = msg
                        msg.run(self)
                    else:
                        handler(msg)
                    self.applied += 1
            except SessionOver:
                return
            except FatalError as e:
                tw.fail(f"stream {self.ref.id}: {e}")
            except BaseException:
                tw.fail(f"stream {self.ref.id}: unexpected error\n{traceback.format_exc()}")
            finally:
                self.busy = False

    def run_segment(self, segment: StreamSegment, handlers: dict) -> None:
        """Unpickle a ``StreamSegment`` here, on the stream's thread, and run its messages in order. A message that
        may not travel in a stream's segment, or that names another stream, is a fatal error (a controller bug)."""
        tw = self.tw
        sid = self.ref.id
        for msg in load_segment(segment.blob):
            if tw.failure is not None:
                return
            if type(msg) not in STREAM_MESSAGES or msg.stream.id != sid:
                raise FatalError(f"a segment for stream {sid} holds {type(msg).__name__} {msg!r:.200}")
            handlers[type(msg)](msg)
            self.applied += 1

    def _root_error(self, seq: int, text: str | None = None) -> SeqError:
        """Record a root failure of ``seq`` and report ``RemoteFunctionFailed`` once (spec §3). During a replay,
        ``seq`` is the operation's position in the recording, and the report is the call's (spec §7)."""
        if self.replaying is not None:
            return self.replaying.root_error(self, seq, text or traceback.format_exc())
        err = SeqError(seq, WorkerError(text or traceback.format_exc(), self.tw.actor_id))
        self.tw.report(RemoteFunctionFailed(seq, err.error))
        self.tw.note_error(seq, err.error.backtrace)
        return err

    def _lookup(self, ref_id: int, meshes: bool, groups: dict | None = None):
        if groups and ref_id in groups:
            return groups[ref_id]
        if meshes:
            mesh = self.tw.device_meshes.get(ref_id)
            if mesh is not None:
                return mesh
        value = self.env.get(ref_id, _MISSING)
        if value is _MISSING:
            raise ValueFailure(f"ref not found: r{ref_id}")
        if type(value) is SeqError:
            raise DependentError(value)
        return value

    def _resolve(self, obj, meshes: bool, groups: dict | None = None):
        """Replace every ``Ref`` leaf (or object with ``__monarch_ref__``) of ``obj`` by its value (spec §8);
        ``groups`` maps the refs of the call's process groups to theirs (``worker/process_group.py``)."""
        t = type(obj)
        if t is Ref:
            return self._lookup(obj.id, meshes, groups)
        if t in _PLAIN:
            return obj
        if t is PickledValue:
            return _load_argument(obj)

        def leaf(x):
            if type(x) is Ref:
                return self._lookup(x.id, meshes, groups)
            if type(x) is PickledValue:
                return _load_argument(x)
            ref = getattr(x, "__monarch_ref__", None)
            if ref is not None and not isinstance(x, type):
                return self._lookup(ref(), meshes, groups)
            return x

        return tree_map(leaf, obj)

    def _resolve_args(self, args_kwargs, meshes: bool, groups: dict | None = None):
        """Resolved ``(args, kwargs)``. Plain values and top-level refs take a fast path (the per-message
        budget); containers go through ``_resolve``."""
        env = self.env
        device_meshes = self.tw.device_meshes if meshes else None
        args = []
        for a in args_kwargs.args:
            t = type(a)
            if t is Ref:
                if groups and a.id in groups:
                    args.append(groups[a.id])
                    continue
                if device_meshes:
                    mesh = device_meshes.get(a.id)
                    if mesh is not None:
                        args.append(mesh)
                        continue
                value = env.get(a.id, _MISSING)
                if value is _MISSING:
                    raise ValueFailure(f"ref not found: r{a.id}")
                if type(value) is SeqError:
                    raise DependentError(value)
                args.append(value)
            elif t in _PLAIN:
                args.append(a)
            else:
                args.append(self._resolve(a, meshes, groups))
        kwargs = args_kwargs.kwargs
        if kwargs:
            kwargs = {k: self._resolve(v, meshes, groups) for k, v in kwargs.items()}
        return args, kwargs

    def _store_error(self, refs, err: SeqError) -> None:
        env = self.env
        for ref in refs:
            if ref is not None:
                env[ref.id] = err

    # ----------------------------------------------------------------------------------------------- handlers
    def call_function(self, msg) -> None:
        """``CallFunction`` (spec §2 "Computation", steps 1-5)."""
        self.current = msg
        try:
            function = msg.function
            if type(function) is FunctionPath and function.path == TEST_PANIC:
                raise FatalError(f"CallFunction seq {msg.seq}: {TEST_PANIC} called: it asks the stream to fail")
            try:
                fn = resolve_function(function)
            except Exception as e:
                raise ValueFailure(
                    f"invalid remote function: failed to resolve function {function!r}: {type(e).__name__}: {e}"
                ) from None
            groups = None
            if msg.remote_process_groups:
                groups = self.tw.process_groups.for_call(msg.remote_process_groups, self.ref.id,
                                                         f"CallFunction seq {msg.seq}")
            args, kwargs = self._resolve_args(msg.args_kwargs, True, groups)
            out = fn(*args, **kwargs)
            results = msg.results
            declared = msg.declared
            if declared is not None:
                leaves = [out] if type(out) is torch.Tensor else _leaves(out)
                text = mismatch(declared, leaves, function) if len(leaves) == len(results) else None
                if text is not None:
                    raise ValueFailure(text)
            if type(out) is torch.Tensor and len(results) == 1:  # the common case, without flattening
                ref = results[0]
                if ref is not None:
                    if ref.id in self.env:
                        raise FatalError(f"CallFunction seq {msg.seq}: Duplicate write to reference {ref}")
                    self.env[ref.id] = out
                return
            leaves = _leaves(out)
            if len(leaves) != len(results):
                raise ValueFailure(
                    f"unexpected number of returns from op, expected {len(results)}, got {len(leaves)}"
                    f" (remote function {function_name(function)})"
                )
            store_results(self.env, results, leaves, f"CallFunction seq {msg.seq}")
        except DependentError as e:
            self._store_error(msg.results, e.root)
            self._store_error(msg.mutates, e.root)
        except FatalError:
            raise
        except ValueFailure as e:
            err = self._root_error(msg.seq, str(e))
            self._store_error(msg.results, err)
            self._store_error(msg.mutates, err)
        except BaseException:  # whatever the function raises (KeyboardInterrupt, SystemExit, ...) is a value error
            err = self._root_error(msg.seq)
            self._store_error(msg.results, err)
            self._store_error(msg.mutates, err)

    def send_value(self, msg) -> None:
        """``SendValue``: answer ``FetchResult`` with the value or the error (DESIGN.md "Decisions")."""
        self.current = msg
        if msg.destination is not None:
            raise FatalError(f"SendValue seq {msg.seq}: destination {msg.destination} (pipes) is not supported")
        try:
            args, kwargs = self._resolve_args(msg.args_kwargs, msg.function is not None)
            if msg.function is not None:
                try:
                    fn = resolve_function(msg.function)
                except Exception as e:
                    raise ValueFailure(
                        f"invalid remote function: failed to resolve function {msg.function!r}: "
                        f"{type(e).__name__}: {e}"
                    ) from None
                value = fn(*args, **kwargs)
            else:
                if len(args) != 1 or kwargs:
                    raise ValueFailure(
                        f"SendValue without a function takes exactly one argument, got {len(args)} and "
                        f"{len(kwargs)} keyword arguments"
                    )
                value = args[0]
            value = _to_cpu(value)
            try:  # objects pickle on their own, so that one the controller cannot unpickle fails only this fetch
                if not _plain_tree(value):
                    value = PickledValue.dumps(value)
            except Exception as e:
                text = f"the fetched value of type {type(value).__name__} cannot be pickled: {type(e).__name__}: {e}"
                self.tw.report(FetchResult(msg.seq, error=WorkerError(text, self.tw.actor_id)))
                return
            self.tw.report(FetchResult(msg.seq, value=value))
        except DependentError as e:
            self._store_error(msg.mutates, e.root)
            self.tw.report(FetchResult(msg.seq, error=e.root.error))
        except ValueFailure as e:
            err = self._root_error(msg.seq, str(e))
            self._store_error(msg.mutates, err)
            self.tw.report(FetchResult(msg.seq, error=err.error))
        except BaseException:  # as in call_function: whatever the function raises is a value error
            err = self._root_error(msg.seq)
            self._store_error(msg.mutates, err)
            self.tw.report(FetchResult(msg.seq, error=err.error))

    def pipe_recv(self, msg) -> None:
        """``PipeRecv``: the next batch of a pipe into ``msg.results`` (``worker/pipe.py``: ``recv``)."""
        pipe.recv(self, msg)

    def borrow_step(self, step: BorrowStep) -> None:
        """A step of a borrow (``Borrow.lend``, ``first_use``, ``last_use``, ``drop``; ``worker/borrow.py``)."""
        self.current = step
        step.fn(self)

    def status_barrier(self, barrier: StatusBarrier) -> None:
        """This stream's arrival at a ``RequestStatus`` barrier."""
        self.current = barrier
        barrier.arrive()

    def delete_refs(self, msg) -> None:
        """``DeleteRefs``: drop what this stream has; missing refs are ignored (spec §2)."""
        pop = self.env.pop
        for ref in msg.refs:
            pop(ref.id, None)

    def set_ref(self, msg) -> None:
        """``SetRefUnitTestsOnly``."""
        self.env[msg.reference.id] = msg.value.to_python()

    def get_ref(self, msg) -> None:
        """``GetRefUnitTestsOnly``: absent -> ``present=False``; errored -> error text; else a ``WireValue``."""
        value = self.env.get(msg.value.id, _MISSING)
        if value is _MISSING:
            reply = GetRefResult(msg.value)
        elif type(value) is SeqError:
            reply = GetRefResult(msg.value, error=str(value), present=True)
        else:
            reply = GetRefResult(msg.value, value=WireValue.for_reply(value), present=True)
        self.tw.report(reply)
