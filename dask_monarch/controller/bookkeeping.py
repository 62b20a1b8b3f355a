"""Bookkeeping of a session (``Session``'s concern ``Bookkeeping``): seqs and refs, the live aliases of every
remote tensor's storage, borrows, work the garbage collector left for later, the dependency graph (``History``),
and which communicators were set up. It sends nothing itself, except ``BackendNetworkInit``/``SplitComm`` in
``ensure_comm``, and queues ``DeleteRefs`` for dropped handles (``drop_ref``; ``transport.py`` sends them).

While a compiled function records (issue 11, ``compile.py``), its thread's ``new_seq``, ``track``, ``record`` and
``drop_ref`` go to the session's ``recorder`` (``recording.py``'s ``Recorder``) instead.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque

from ..protocol import BackendNetworkInit, Ref, SplitComm, StreamRef
from .coalescing import HeldDelete, held_messages
from .history import History

__all__ = ["Bookkeeping"]

_new_object = object.__new__


class Bookkeeping:
    """The session's bookkeeping (a part of ``Session``; see the module's docstring). ``_init_bookkeeping`` makes
    its state: ``lock`` (the session's lock, an ``RLock``), ``history``, ``functions`` (seq -> what it called,
    while incomplete), ``streams``, ``recorder``."""

    def _init_bookkeeping(self) -> None:
        self.lock = threading.RLock()
        self.history = History(self.world_size)
        self._next_seq = 0
        self._ref_ids = itertools.count()
        self.functions: dict[int, str] = {}  # seq -> description of what it called, while incomplete
        #: streams of this session other than the default: ``Stream`` -> ``StreamRef`` (``controller/stream.py``)
        self.streams: dict = {}
        # weak, so that an undropped borrow can be garbage-collected (it then drops itself, deferred)
        self._lent: dict = {}  # ``Storage`` of a borrowed tensor -> its live borrows (a WeakSet)
        self._borrowed = weakref.WeakValueDictionary()  # ``Storage`` of a borrow's tensor -> that borrow
        self._deferred: deque = deque()  # work the garbage collector left for the next send (Borrow.__del__)
        self._deletes: deque = deque()  # (targets tuple, ref id), appended from any thread (GC)
        #: a dropped handle whose ``DeleteRefs`` goes before the next message, not with the next flush (an
        #: ``OpaqueRef``'s key: its object is freed before anything sent after the drop runs, as Monarch frees it)
        self._urgent_deletes = False
        #: the ``Recorder`` of a compiled function recording now (``controller/recording.py``): what its thread (and
        #: autograd's threads, which run a backward pass of CUDA tensors) sends meanwhile is captured instead
        self.recorder = None
        self._network = False
        self._splits: set = set()

    # ------------------------------------------------------------------------------------------------ ids
    def recording(self):
        """The recorder capturing what this thread sends: set while a compiled function records, on its own thread
        and on autograd's threads (``Recorder.owns_thread``); else None."""
        recorder = self.recorder
        if recorder is not None and recorder.owns_thread():
            return recorder
        return None

    def new_seq(self) -> int:
        """The next seq; while a compiled function records, the next operation's index in the recording."""
        with self.lock:
            if self.recorder is not None and self.recorder.owns_thread():
                return self.recorder.next_index()
            seq = self._next_seq
            self._next_seq += 1
            return seq

    def new_call(self, defs: list, uses: list, what: str) -> int:
        """``new_seq()`` then ``record(seq, defs, uses, what)`` in one call (the per-op path: an eager op's
        ``CallFunction``); returns the seq. Call under the session's lock."""
        recorder = self.recorder
        if recorder is not None and recorder.owns_thread():
            seq = recorder.next_index()
            recorder.add(seq, defs, uses, what)
            return seq
        seq = self._next_seq
        self._next_seq = seq + 1
        self.functions[seq] = what
        self.history.new_node(seq, [t.ref.id for t in defs], [t.ref.id for t in uses])
        return seq

    def new_ref(self) -> Ref:
        """A new ref (``itertools.count``: atomic without the lock, which an op whose shapes are cached takes
        once, not once per output; built without ``Ref``'s check of its id, which the count makes valid)."""
        ref = _new_object(Ref)
        ref.id = next(self._ref_ids)
        return ref

    # ------------------------------------------------------------------------------------- tensors, history
    def track(self, tensor) -> None:
        """Remember ``tensor`` among the live aliases of its storage (``storage.py``)."""
        if self.recorder is not None and self.recorder.owns_thread():
            self.recorder.created(tensor)
        tensor._storage.add(tensor)

    def retrack(self, tensor, old_storage) -> None:
        """``tensor`` moved from ``old_storage`` to its new one (a ``.data`` assignment)."""
        old_storage.discard(tensor)
        self.track(tensor)

    @staticmethod
    def aliases_of(tensors) -> list:
        """Every live tensor that shares storage with one of ``tensors`` (these included), by ref id."""
        found = {}
        for t in tensors:
            found[t.ref.id] = t
            for alias in t._storage.aliases():
                found[alias.ref.id] = alias
        return list(found.values())

    # -------------------------------------------------------------------------------------------- borrows
    def lend(self, origin, borrow) -> None:
        """``borrow`` of ``origin`` is live (``controller/stream.py``)."""
        self._lent.setdefault(origin._storage, weakref.WeakSet()).add(borrow)
        self._borrowed[borrow.tensor._storage] = borrow

    def unlend(self, origin, borrow) -> None:
        """``borrow`` of ``origin`` was dropped."""
        live = self._lent.get(origin._storage)
        if live is not None:
            live.discard(borrow)
            if not live:
                del self._lent[origin._storage]
        self._borrowed.pop(borrow.tensor._storage, None)

    def borrows_of(self, tensor) -> list:
        """The live borrows of ``tensor``'s storage."""
        self.run_deferred()
        return list(self._lent.get(tensor._storage, ())) if self._lent else []

    def defer(self, fn) -> None:
        """Call ``fn()`` before the next message is sent (safe from the garbage collector: takes no lock)."""
        self._deferred.append(fn)

    def run_deferred(self) -> None:
        while self._deferred:
            try:
                fn = self._deferred.popleft()
            except IndexError:
                return
            with self.lock:
                fn()

    def borrow_by_alias(self, tensor):
        """The live borrow whose borrowed tensor shares ``tensor``'s storage, or None."""
        return self._borrowed.get(tensor._storage) if self._borrowed else None

    def record(self, seq: int, defs, uses, what="") -> None:
        """Add invocation ``seq``, which defines the remote tensors ``defs`` and uses ``uses``, to the dependency
        graph (``History.new_node``); ``what`` describes it in error reports. While a compiled function records,
        the recorder takes it instead (``seq`` is then the operation's index in the recording)."""
        recorder = self.recorder
        if recorder is not None and recorder.owns_thread():
            recorder.add(seq, defs, uses, what)
            return
        if what:
            self.functions[seq] = what
        self.history.new_node(seq, [t.ref.id for t in defs], [t.ref.id for t in uses])

    def drop_ref(self, ref_id: int, ranks=None, urgent: bool = False) -> None:
        """A controller-side handle died: free ``ref_id`` on ``ranks`` with the next flush (``DeleteRefs``);
        ``urgent``: before the next message sent (with the other deletes pending). Safe from any thread, including
        the garbage collector's. Inside ``coalescing()`` the delete waits for the end of the block: the block's held
        messages may still use the ref (``BorrowLastUse`` of a dropped borrow, an op on a tensor dropped after it),
        and a flush meanwhile would otherwise free it first."""
        if self.closed:
            return
        targets = self._all if ranks is None else tuple(ranks)
        recorder = self.recorder
        if recorder is not None and recorder.drop(targets, ref_id):
            return
        held = held_messages()
        if held is not None:
            held.setdefault(self, []).append((targets, HeldDelete(ref_id)))
        else:
            self._deletes.append((targets, ref_id))
            if urgent:
                self._urgent_deletes = True

    def ensure_comm(self, mesh, mesh_ref: Ref, stream: StreamRef, dims) -> None:
        """Send ``BackendNetworkInit`` (once per session, to every rank) and ``SplitComm`` (once per mesh, stream
        and sorted dims, to every rank) before the first ``Reduce`` that needs them (spec §1 ``reduce``)."""
        with self.lock:
            if not self._network:
                self._network = True
                self.send(BackendNetworkInit(f"{self.id}/net"))
            key = (mesh_ref.id, stream.id, tuple(dims))
            if key not in self._splits:
                self._splits.add(key)
                self.send(SplitComm(list(dims), mesh_ref, stream))
