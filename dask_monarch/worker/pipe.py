"""The worker side of pipes (``PipeRecv``; seed ``worker.rs``; DESIGN.md "Decisions": pipes return as a data feed
from Dask).

A pipe is an object in a stream's ref table, made by a ``CallFunction`` of :func:`open_generator` or
:func:`open_collection` (``dask_monarch/data/pipe.py`` sends them) and read by that stream's ``PipeRecv``
handler (``StreamWorker.pipe_recv``), which calls ``next_batch``. Both kinds load ahead while the stream computes:

* ``GeneratorSource``: the user's generator function runs on a thread of its own and fills a queue of at most
  ``prefetch`` batches (it blocks when the queue is full, so memory stays bounded).
* ``CollectionSource``: Dask tasks pinned to this worker (:func:`dask_monarch.data.tasks.feed_partition`) hand
  it this rank's partitions of a Dask collection as tensors, in any order; it cuts them into batches of
  ``batch_size`` rows in partition order (one batch per partition without a batch size). The controller keeps
  ``prefetch`` partitions per rank ahead of the ``recv`` calls.

Every wait is bounded (``timeout``) and says what it waited for. A pipe lives as long as its session on this
worker: ``release_session`` (called when the session ends here) stops its thread and drops what it holds.
"""

from __future__ import annotations

import queue
import threading
import traceback

import torch
from torch.utils._pytree import tree_flatten

from ..protocol import WorkerError, resolve_function
from .context import current_stream
from .errors import DependentError, SeqError, ValueFailure

__all__ = ["GeneratorSource", "CollectionSource", "SourceError", "Exhausted", "open_generator", "open_collection",
           "collection_source", "release_session", "recv"]

_END = object()

#: (session id, pipe token) -> source; a feed task may arrive before the pipe's open message has run
_sources: dict = {}
#: (session id, pipe token) of pipes closed here, so that a late feed task does not make them anew
_closed: set = set()
_lock = threading.Lock()


class SourceError(Exception):
    """The pipe's source raised (its traceback is the text), or a batch did not have the shapes the controller
    expects: the ``recv`` that would have returned it fails with this text (a ``RemoteException`` there)."""


class Exhausted(Exception):
    """The pipe's source has ended: ``recv`` stores this in its batch refs and ``False`` in its flag."""


def _check(batch, expect, where: str):
    """``batch`` (a tensor or a pytree of them), checked against ``expect`` (a list of (shape, dtype) per leaf)."""
    leaves = tree_flatten(batch)[0]
    if expect is not None:
        if len(leaves) != len(expect):
            raise SourceError(f"{where} has {len(leaves)} leaves, the controller expects {len(expect)}")
        for i, (leaf, (shape, dtype)) in enumerate(zip(leaves, expect)):
            if not isinstance(leaf, torch.Tensor):
                raise SourceError(f"{where}: leaf {i} is a {type(leaf).__name__}, not a torch.Tensor")
            if tuple(leaf.shape) != tuple(shape) or leaf.dtype != dtype:
                raise SourceError(
                    f"{where}: leaf {i} has shape {list(leaf.shape)} and dtype {leaf.dtype}, but the controller "
                    f"expects shape {list(shape)} and dtype {dtype} (from create_pipe's propagate= or its first "
                    "batch): every batch must have the same shapes"
                )
    return batch


class GeneratorSource:
    """Runs ``fn(*args, **kwargs)`` (a generator function, or any callable returning an iterable) on its own
    thread and queues up to ``prefetch`` of its items. ``next_batch(timeout)`` returns the next item, raises
    ``Exhausted`` after the last, ``SourceError`` if the source raised (with its traceback) or an item does not
    match ``expect``, and ``TimeoutError`` if nothing came for ``timeout`` seconds."""

    def __init__(self, fn, args, kwargs, prefetch: int, expect, name: str, timeout: float = 300.0):
        self.name = name
        self.timeout = timeout
        self.device = None
        self.expect = expect
        self.count = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, int(prefetch)))
        self._stop = threading.Event()
        self._ended = None
        self.thread = threading.Thread(target=self._run, args=(fn, args, kwargs), name=f"monarch-pipe-{name}",
                                       daemon=True)
        self.thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, fn, args, kwargs) -> None:
        try:
            for item in fn(*args, **kwargs):
                if not self._put(item):
                    return
        except BaseException:
            self._put(SourceError(f"the source of pipe {self.name} raised:\n{traceback.format_exc()}"))
            return
        self._put(_END)

    def next_batch(self, timeout: float):
        if self._ended is not None:
            raise self._ended
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"pipe {self.name}: its source gave no batch within {timeout} s (batch {self.count}; the source's "
                f"thread is {'running' if self.thread.is_alive() else 'not running'})"
            ) from None
        if item is _END:
            self._ended = Exhausted(f"the source of pipe {self.name} ended after {self.count} batches")
            raise self._ended
        if isinstance(item, SourceError):
            self._ended = item
            raise item
        self.count += 1
        return _check(item, self.expect, f"batch {self.count - 1} of pipe {self.name}")

    def close(self) -> None:
        self._stop.set()
        while True:  # what is queued is let go now
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break


class CollectionSource:
    """This rank's partitions of a Dask collection, handed over by feed tasks (``put``) in any order and cut into
    batches of ``batch_size`` rows in partition order (a batch per partition when ``batch_size`` is None).
    Each partition is a tuple of tensors with the same number of rows (features, and a label if asked)."""

    def __init__(self, name: str):
        self.name = name
        self.timeout = 300.0
        self.device = None  # where recv puts the batches (the feed tasks make CPU tensors)
        self.batch_size = None
        self.expect = None
        self.count = 0
        self._parts: dict = {}
        self._next_part = 0
        self._buffer: list = []  # partitions (tuples of tensors) taken, not yet cut into batches
        self._buffered = 0
        self._cond = threading.Condition()
        self._closed = False

    def configure(self, batch_size, expect, timeout: float, device) -> None:
        self.timeout = timeout
        self.device = None if device is None else torch.device(device)
        self.batch_size = batch_size
        self.expect = expect

    def put(self, index: int, part=None, error: str | None = None) -> None:
        """Partition ``index`` of this rank (a tuple of tensors), or the text of its failure."""
        with self._cond:
            if not self._closed:
                self._parts[index] = SourceError(error) if error is not None else part
                self._cond.notify_all()

    def _take(self, timeout: float):
        with self._cond:
            index = self._next_part
            if not self._cond.wait_for(lambda: index in self._parts or self._closed, timeout):
                raise TimeoutError(
                    f"pipe {self.name}: partition {index} of this rank did not arrive within {timeout} s (its Dask "
                    f"task has not run yet: see the dashboard's task stream; partitions here: {sorted(self._parts)})"
                )
            if self._closed:
                raise Exhausted(f"pipe {self.name} is closed")
            part = self._parts.pop(index)
            self._next_part += 1
        if isinstance(part, SourceError):
            raise part
        return part

    def next_batch(self, timeout: float):
        where = f"batch {self.count} of pipe {self.name}"
        if self.batch_size is None:
            batch = self._take(timeout)
        else:
            size = self.batch_size
            while self._buffered < size:
                part = self._take(timeout)
                if len(part[0]):
                    self._buffer.append(part)
                    self._buffered += len(part[0])
            if len(self._buffer) == 1:
                whole = self._buffer[0]
            else:
                whole = tuple(torch.cat(columns) for columns in zip(*self._buffer))
            batch = tuple(t[:size] for t in whole)
            rest = tuple(t[size:] for t in whole)
            self._buffered -= size
            self._buffer = [rest] if self._buffered else []
        self.count += 1
        batch = batch[0] if len(batch) == 1 else batch
        return _check(batch, self.expect, where)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._parts.clear()
            self._buffer = []
            self._cond.notify_all()


def _session_id() -> str:
    stream = current_stream()
    if stream is None:
        raise RuntimeError("pipes are opened by a stream of a dask_monarch session (dask_monarch.create_pipe)")
    return stream.tw.session_id


def _register(session_id: str, token: str, source) -> None:
    with _lock:
        _sources[(session_id, token)] = source


def open_generator(token: str, fn, args, kwargs, prefetch: int, expect, timeout: float):
    """The pipe object of a generator source (a ``CallFunction`` of ``create_pipe``): ``fn(*args, **kwargs)``
    (a ``DeviceMesh`` among them arrives as the worker's mesh) runs on a thread of its own. ``fn`` is a
    ``ResolvableFunction`` (a path, or the function by value)."""
    fn = resolve_function(fn)
    source = GeneratorSource(fn, args, kwargs, prefetch, [(tuple(s), d) for s, d in expect], token, timeout)
    _register(_session_id(), token, source)
    return source


def open_collection(token: str, batch_size, expect, timeout: float, device=None):
    """The pipe object of a collection source (a ``CallFunction`` of ``create_pipe``); its partitions arrive
    through ``feed_partition`` tasks, which may come first."""
    source = collection_source(_session_id(), token)
    source.configure(batch_size, [(tuple(s), d) for s, d in expect], timeout, device)
    return source


def collection_source(session_id: str, token: str) -> CollectionSource:
    """The ``CollectionSource`` of pipe ``token`` of ``session_id`` on this worker, made if it is not there yet
    (a closed one for a pipe already closed here)."""
    with _lock:
        if (session_id, token) in _closed:
            source = CollectionSource(token)
            source.close()
            return source
        source = _sources.get((session_id, token))
        if source is None:
            source = _sources[(session_id, token)] = CollectionSource(token)
        return source


def close_source(source) -> None:
    """``Pipe.close()``, in the stream's order after the pipe's recvs: stop the source, drop what it holds."""
    source.close()
    stream = current_stream()
    if stream is not None:
        with _lock:
            for key, value in list(_sources.items()):
                if value is source:
                    del _sources[key]
                    _closed.add(key)


def release_session(session_id: str) -> None:
    """The session ended on this worker: stop and forget its pipes."""
    with _lock:
        for key in [k for k in _closed if k[0] == session_id]:
            _closed.discard(key)
        keys = [k for k in _sources if k[0] == session_id]
        sources = [_sources.pop(k) for k in keys]
    for source in sources:
        source.close()


def recv(stream, msg) -> None:
    """``PipeRecv`` on ``stream``: the next batch of pipe ``msg.pipe`` (a source above, in the stream's ref table)
    into ``msg.results``: the batch's leaves, then a 0-d bool that is True. After the source's end the batch refs
    hold an error saying so (not reported: an end, not a failure) and the flag is False. A source that raised, a
    batch of other shapes than the controller's, or no batch within the pipe's timeout fail this recv (class V:
    ``RemoteFunctionFailed``, a ``RemoteException`` when fetched)."""
    results = msg.results
    env = stream.env
    try:
        pipe = env.get(msg.pipe.id)
        if pipe is None:
            raise ValueFailure(f"PipeRecv seq {msg.seq}: pipe not found: {msg.pipe}")
        if type(pipe) is SeqError:
            raise DependentError(pipe)
        if not hasattr(pipe, "next_batch"):
            raise ValueFailure(f"PipeRecv seq {msg.seq}: {msg.pipe} is a {type(pipe).__name__}, not a pipe")
        try:
            batch = pipe.next_batch(pipe.timeout)
        except Exhausted as e:
            err = SeqError(msg.seq, WorkerError(f"StopIteration: {e}", stream.tw.actor_id))
            stream._store_error(results[:-1], err)
            if results[-1] is not None:
                env[results[-1].id] = torch.tensor(False)
            return
        except (SourceError, TimeoutError) as e:
            raise ValueFailure(f"PipeRecv seq {msg.seq}: {e}") from None
        leaves = tree_flatten(batch)[0]
        if len(leaves) != len(results) - 1:
            raise ValueFailure(
                f"PipeRecv seq {msg.seq}: the batch has {len(leaves)} leaves, the controller expects {len(results) - 1}"
            )
        device = pipe.device
        for ref, value in zip(results, leaves):
            if ref is not None:
                if device is not None and isinstance(value, torch.Tensor) and value.device != device:
                    value = value.to(device)
                env[ref.id] = value
        if results[-1] is not None:
            env[results[-1].id] = torch.tensor(True)
    except DependentError as e:
        stream._store_error(results, e.root)
    except ValueFailure as e:
        stream._store_error(results, stream._root_error(msg.seq, str(e)))
    except BaseException:
        stream._store_error(results, stream._root_error(msg.seq))
