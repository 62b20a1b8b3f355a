"""Recording what a compiled function sends, and calling the recording (spec §7 "Client"; Monarch's ``Recorder``
and ``Recording``).

While a compiled function records, its session's ``recorder`` is a ``Recorder``: every message the function's
operations send is captured (tensors as refs) instead of sent, and the seq of each operation is its index in
the recording. Messages that set up the machinery (``CreateStream``, ``CreateDeviceMesh``, ``BackendNetworkInit``,
``SplitComm``, ...) and the first use of a borrow made outside go out at once. Tensors the function uses but did
not make are its *captures*; those it writes are *mutated*. The captured messages become a ``Recording``: one
``DefineRecording`` per rank, in chunks of at most 1,000 commands; each call is one ``CallRecording`` per rank.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import weakref

import torch

from torch.utils._pytree import tree_map

from ..protocol import (
    BackendNetworkInit,
    BackendNetworkPointToPointInit,
    BorrowCreate,
    BorrowFirstUse,
    CallFunction,
    CallRecording,
    ArgsKwargs,
    CreateDeviceMesh,
    CreateRemoteProcessGroup,
    CreateStream,
    DefineRecording,
    DeleteRefs,
    Ref,
    SendTensor,
    SplitComm,
    SplitCommForProcessGroup,
)
from .mesh import DeviceMesh
from .storage import Storage
from .stream import check_access
from .tensor import Tensor
from .dynamo_skip import skip_dynamo

__all__ = ["Recorder", "Recording", "MAX_COMMANDS"]

#: commands per ``DefineRecording`` chunk (Monarch's ``_MAX_MESSAGES_PER_DEFINE_RECORDING``)
MAX_COMMANDS = 1000
#: messages sent at once while recording: they set up what the recording's operations use
_SENT_AT_ONCE = (
    CreateStream, CreateDeviceMesh, BackendNetworkInit, SplitComm, BackendNetworkPointToPointInit,
    SplitCommForProcessGroup, CreateRemoteProcessGroup,
)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(sys.modules["torch"].__file__))


def _user_frame() -> str:
    """``file:line in function`` of the innermost caller outside dask_monarch and torch (where an operation was
    recorded); cheap, unlike a whole stack."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_PACKAGE) or path.startswith(_TORCH) or path.startswith("<")):
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _as_ref(x):
    if isinstance(x, Tensor):
        return Ref(x.ref.id)
    if isinstance(x, DeviceMesh):
        return x.define_remotely()
    return x


class Recorder:
    """What compiled function ``name`` sends on ``session`` while it records."""

    def __init__(self, session, name: str):
        self.session = session
        self.name = name
        self.thread = threading.get_ident()
        self.messages: list = []  # (targets, message): messages hold refs, not tensors
        self.ops: list = []  # operation index -> (what, where)
        self.created_refs: dict = {}  # ref id of a tensor made while recording -> its position
        self.created_tensors: list = []  # weak references to them
        self.captures: dict = {}  # ref id -> tensor used but made outside (kept alive by the recording)
        self.mutated: dict = {}  # ref id -> tensor made outside and written
        self.formal_groups: dict = {}  # fake storage of formals -> the argument indices sharing it
        self.formal_offsets: list = []  # argument index -> storage offset of its formal
        self.mutated_formals: set = set()
        self.borrows: dict = {}  # borrow id -> Borrow made while recording and not yet dropped
        self.borrow_order: dict = {}  # borrow id -> position, for comparing recordings

    # ----------------------------------------------------------------------------------- session hooks
    def owns_thread(self) -> bool:
        """Whether what this thread sends belongs to the recording: the compiled function's own thread, or an
        autograd engine thread in a backward pass (a backward of CUDA tensors runs on autograd's device threads).
        Another thread's operations on the session go out as usual meanwhile (unless it runs a backward pass of
        its own at the same moment, which would be recorded)."""
        return threading.get_ident() == self.thread or torch._C._current_graph_task_id() != -1

    def next_index(self) -> int:
        """``Session.new_seq`` while recording: the next operation's index."""
        self.ops.append(None)
        return len(self.ops) - 1

    def created(self, tensor) -> None:
        """``Session.track``: ``tensor`` was made while recording."""
        self.created_refs[tensor.ref.id] = len(self.created_refs)
        self.created_tensors.append(weakref.ref(tensor))

    def add(self, seq: int, defs, uses, what) -> None:
        """``Session.record`` while recording: operation ``seq`` writes ``defs`` and reads ``uses``."""
        if 0 <= seq < len(self.ops):
            self.ops[seq] = (str(what), _user_frame())
        created = self.created_refs
        for t in uses:
            if t.ref.id not in created:
                self.captures.setdefault(t.ref.id, t)
        for t in defs:
            if t.ref.id not in created:
                self.mutated.setdefault(t.ref.id, t)
            else:
                self.mutated_formals.update(self.formal_groups.get(t._storage, ()))

    def capture(self, targets: tuple, msg) -> bool:
        """``Session.send`` while recording: keep ``msg`` (True), or let it go out at once (False)."""
        kind = type(msg)
        if kind in _SENT_AT_ONCE or (kind is BorrowFirstUse and msg.borrow not in self.borrow_order):
            return False
        if kind is CallFunction:
            args, kwargs = tree_map(_as_ref, (msg.args_kwargs.args, msg.args_kwargs.kwargs))
            msg = CallFunction(msg.seq, msg.results, msg.mutates, msg.function, ArgsKwargs(tuple(args), kwargs),
                               msg.stream, msg.remote_process_groups, msg.declared)
        elif kind is BorrowCreate:
            self.borrow_order[msg.borrow] = len(self.borrow_order)
        self.messages.append((targets, msg))
        return True

    def drop(self, targets: tuple, ref_id: int) -> bool:
        """``Session.drop_ref`` while recording: a tensor made inside died, so each replay frees it there (True);
        a tensor from outside is freed as usual (False). Safe from the garbage collector (no lock)."""
        if ref_id not in self.created_refs:
            return False
        if self.messages:
            last_targets, last = self.messages[-1]
            if type(last) is DeleteRefs and last_targets == targets:
                last.refs.append(Ref(ref_id))
                return True
        self.messages.append((targets, DeleteRefs([Ref(ref_id)])))
        return True

    # ------------------------------------------------------------------------------------------- formals
    def formals(self, inputs: list) -> list:
        """A formal tensor for each input: its metadata on a fake storage of its own (inputs that share storage
        share one), with a ``RecordingFormal`` sent for it."""
        from ..protocol import RecordingFormal

        session = self.session
        storages: dict = {}
        formals = []
        for i, t in enumerate(inputs):
            storage = storages.get(t._storage)
            if storage is None:
                storage = storages[t._storage] = Storage(t._storage.nbytes)
            formal = Tensor.viewing(session.new_ref(), storage, t._meta, False, t.mesh, t.stream)
            self.formal_groups.setdefault(storage, []).append(i)
            self.formal_offsets.append(t._meta[2])
            session.send(RecordingFormal(formal.ref, i, t.stream.ref_for(session)), t.mesh._rank_list)
            formals.append(formal)
        return formals

    # -------------------------------------------------------------------------------------------- ending
    def undropped_borrows(self) -> list:
        return list(self.borrows.values())

    def close(self, reason: str) -> None:
        """The recording is over: tensors made inside exist only inside it (using one raises ``DROPPED`` with
        ``reason``), and borrows made inside and left undropped are forgotten."""
        for w in self.created_tensors:
            t = w()
            if t is not None and t._dropped_at is None:
                t._dropped_at = reason
        for borrow in self.borrows.values():
            borrow.dropped = True
            self.session.unlend(borrow.origin, borrow)
        self.borrows.clear()


class _Describe:
    """What a call of a recording ran, for error reports: ``operation(i)`` names operation ``i`` and where it was
    recorded (``Session._handle`` of ``RemoteFunctionFailed.controller_frame_index``)."""

    def __init__(self, name: str, ops: list):
        self.name = name
        self.ops = ops

    def __str__(self) -> str:
        return f"compiled function {self.name}"

    def operation(self, index: int) -> str:
        op = self.ops[index] if 0 <= index < len(self.ops) else None
        what, where = op if op is not None else ("?", "?")
        return f"compiled function {self.name}, operation {index} of {len(self.ops)} ({what}, recorded at {where})"


class Recording:
    """A recording defined on its ranks, called with ``call(actuals)`` (one ``CallRecording`` per rank).

    ``outputs`` are the recorded output tensors (in ``RecordingResult`` order), ``inputs`` the actuals of the
    recording call (their formals' storages tell which outputs alias inputs)."""

    def __init__(self, recorder: Recorder, inputs: list, outputs: list, cuda_graph: bool = False,
                 backend: str = ""):
        session = recorder.session
        self.session = session
        self.name = recorder.name
        self.describe = _Describe(recorder.name, recorder.ops)
        self.messages = recorder.messages
        self.captures = list(recorder.captures.values())
        self.mutated_captures = list(recorder.mutated.values())
        self.mutated_formals = sorted(recorder.mutated_formals)
        self.nformals = len(inputs)
        capture_storages = {t._storage: t for t in self.captures + self.mutated_captures}
        self.capture_index = {key: k for k, key in enumerate(capture_storages)}
        self.input_pattern = tuple(self.capture_index.get(t._storage) for t in inputs)
        self.outputs = self._recipes(recorder, outputs, capture_storages)
        if cuda_graph:
            streams = {m.stream.id for _, m in self.messages if hasattr(m, "stream")}
            streams |= {s.id for _, m in self.messages if type(m) in (BorrowCreate, SendTensor)
                        for s in (m.from_stream, m.to_stream)}
            if len(streams) > 1:
                raise RuntimeError(
                    f"compiled function {self.name}: cuda_graph=True needs a function that runs on one stream; it "
                    f"uses {len(streams)} streams (a CUDA graph is captured on one stream)"
                )
        per_rank: dict = {}
        for targets, msg in self.messages:
            for rank in targets:
                per_rank.setdefault(rank, []).append(msg)
        self.ranks = tuple(sorted(per_rank))
        self.ref = session.new_ref()
        groups: dict = {}
        for rank, msgs in per_rank.items():
            groups.setdefault(tuple(map(id, msgs)), [msgs, []])[1].append(rank)
        with session.lock:
            for msgs, ranks in groups.values():
                chunks = [msgs[i:i + MAX_COMMANDS] for i in range(0, len(msgs), MAX_COMMANDS)]
                for index, chunk in enumerate(chunks):
                    session.send(DefineRecording(self.ref, len(outputs), len(inputs), chunk, len(chunks), index,
                                                 cuda_graph, backend), ranks)
        # the /monarch page counts each compiled function's calls by the replays of its recordings
        session.tell_dashboard("monarch_session_recording", recording=self.ref.id, name=self.name)

    @staticmethod
    def _recipes(recorder: Recorder, outputs: list, capture_storages: dict) -> list:
        """How to make each output's fake tensor at a call: its metadata and the storage it views (an input's, a
        capture's, an earlier output's, or its own)."""
        formal_input = {key: indices[0] for key, indices in recorder.formal_groups.items()}
        seen: dict = {}
        recipes = []
        for j, o in enumerate(outputs):
            size, stride, offset, dtype, device = o._meta
            key = o._storage
            if key in formal_input:  # at a call: relative to where that actual starts in its storage
                i = formal_input[key]
                base = ("input", i)
                offset -= recorder.formal_offsets[i]
            elif key in capture_storages:
                base = ("capture", capture_storages[key])
            elif key in seen:
                base = ("output", seen[key])
            else:
                base = ("fresh", key.nbytes)
                seen[key] = j
            recipes.append((base, offset, size, stride, dtype, device, o.mesh, o.stream))
        return recipes

    def matches(self, inputs: list) -> bool:
        """Whether ``inputs`` alias the captures as the recorded inputs did (Monarch's ``CacheEntry.matches``)."""
        index = self.capture_index
        return tuple(index.get(t._storage) for t in inputs) == self.input_pattern

    def _results(self, actuals: list) -> list:
        """The result tensors of a call on ``actuals``: metadata and storage from the recipes, no fake tensors (each
        torch call may hand the GIL to the client's threads; a fake is made when something needs one)."""
        session = self.session
        results = []
        for base, offset, size, stride, dtype, device, mesh, stream in self.outputs:
            kind, which = base
            if kind == "fresh":
                storage = Storage(which)
            elif kind == "input":
                storage = actuals[which]._storage
                offset += actuals[which]._meta[2]
            elif kind == "capture":
                storage = which._storage
            else:
                storage = results[which]._storage
            results.append(Tensor.viewing(session.new_ref(), storage, (size, stride, offset, dtype, device), False,
                                          mesh, stream))
        return results

    def call(self, actuals: list) -> list:
        """Send one ``CallRecording`` per rank and return the result tensors (spec §7 "A call"). Raises
        ``TypeError`` (DROPPED, WRONG_STREAM, BORROWED, MUTATING_BORROW) for a capture or actual that cannot be
        used now, ``SessionError`` if the session failed."""
        session = self.session
        captures = self.captures
        with session.lock:
            session.check_ok()
            for t in captures:
                t.check_usable()
            for t in actuals:
                t.check_usable()
            written = self.mutated_captures + [actuals[i] for i in self.mutated_formals]
            uses = captures + actuals
            streams = {id(t.stream): t.stream for t in uses + written}
            for stream in streams.values():
                check_access(stream, [t for t in uses if t.stream is stream],
                             [t for t in written if t.stream is stream])
            mutates = session.aliases_of(written)
            results = self._results(actuals)
            seq = session.new_seq()
            session.record(seq, defs=results + mutates, uses=uses, what=self.describe)
            if self.ranks:
                session.send(CallRecording(seq, self.ref, [r.ref for r in results], [a.ref for a in actuals]),
                             self.ranks)
        return results

    @skip_dynamo  # the collector may run it inside a torch.compile'd function (dynamo_skip.py)
    def __del__(self):
        try:
            if not self.session.closed:
                self.session.drop_ref(self.ref.id, self.ranks)
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------- comparing
def normalized(recorder: Recorder) -> list:
    """The recorder's messages with the refs and borrow ids of what it made renumbered in order of creation,
    without ``DeleteRefs`` (when Python frees a temporary does not change what a recording computes), and with
    only the recording's own tensors among a ``CallFunction``'s ``mutates`` (which aliases from outside were alive
    when it recorded does not either): two recordings of the same computation compare equal
    (``compile(verify=True)``)."""
    created, borrows = recorder.created_refs, recorder.borrow_order

    def norm(x):
        t = type(x)
        if t is Ref:
            position = created.get(x.id)
            return ("ref", x.id) if position is None else ("made", position)
        if t in (list, tuple):
            return tuple(norm(v) for v in x)
        if t is dict:
            return tuple((k, norm(v)) for k, v in x.items())
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            values = []
            for field in dataclasses.fields(x):
                value = getattr(x, field.name)
                if field.name == "borrow" and type(value) is int:
                    value = ("borrow", borrows.get(value, value))
                elif field.name == "mutates" and t is CallFunction:
                    value = sorted(created[r.id] for r in value if r.id in created)
                values.append(norm(value))
            return (t.__name__, *values)
        return x

    return [(targets, norm(msg)) for targets, msg in recorder.messages if type(msg) is not DeleteRefs]
