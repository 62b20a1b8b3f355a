"""Recordings on the worker: ``DefineRecording`` turns a list of commands into one program per stream, prepared
once; ``CallRecording`` replays them (spec §7 "Worker DefineRecording", "Stream in defining mode"; seed
``lib.rs`` ``define_recording``, ``call_recording``).

A definition arrives in chunks (``index`` 0, 1, ... of ``ntotal_messages``) that accumulate until the last one;
then its commands are taken in order, as Monarch's streams in defining mode take them: each stream a command
names joins the recording and *appends* it instead of running it (``CallFunction``, ``Reduce``, ``SendTensor``
(on its from stream, and on its to stream where this rank receives there), the four borrow messages,
``DeleteRefs``, ``RecordingFormal``, ``RecordingResult``). A ``DeleteRefs`` is appended to the streams
already in the recording and runs at once on the others. The checks of defining mode are fatal (class F), with
Monarch's texts. Each stream's commands become a ``Program`` of prepared steps (``worker/replay.py``): functions
resolved, arguments bound to ref ids, so that a replay pays no unpickling, validation or path resolution.

The dispatcher handles these messages (``TensorWorker``); a ``CallRecording`` only enqueues one ``ReplayCall``
on every stream of the recording, which replays its program there, in the stream's order.
"""

from __future__ import annotations

import threading

from ..protocol import (
    BackendNetworkInit,
    BackendNetworkPointToPointInit,
    BorrowCreate,
    BorrowDrop,
    BorrowFirstUse,
    BorrowLastUse,
    CallFunction,
    CallRecording,
    CommandGroup,
    CreateDeviceMesh,
    CreateRemoteProcessGroup,
    CreateStream,
    DefineRecording,
    DeleteRefs,
    Exit,
    RecordingFormal,
    RecordingResult,
    Reduce,
    RemoteFunctionFailed,
    RequestStatus,
    SendTensor,
    SendValue,
    SplitComm,
    SplitCommForProcessGroup,
    WorkerError,
)
from .borrow import Borrow
from .errors import FatalError, NotImplementedYet, SeqError
from .graphs import replay_graph
from .replay import Program, replay
from .send_tensor import SendStep, TakeStep, plan
from .steps import BorrowStep, Call, Delete, Formal, ReduceStep, Result

__all__ = ["Definitions", "Recording", "ReplayCall", "BACKENDS"]

#: ``DefineRecording.backend`` values: generated Python (``worker/blocks.py``), or Inductor (``worker/inductor.py``)
BACKENDS = frozenset(("", "inductor"))

#: commands that may not appear among a recording's commands, with the text of the fatal error (spec §7, §9)
_REFUSED = {
    RequestStatus: "request_status not allowed in recording",
    BackendNetworkInit: "init_comm not allowed in recording",
    SplitComm: "init_comm not allowed in recording (SplitComm)",
    BackendNetworkPointToPointInit: "init_comm not allowed in recording (BackendNetworkPointToPointInit)",
    SplitCommForProcessGroup: "init_comm not allowed in recording (SplitCommForProcessGroup)",
    CallRecording: "cannot call recording while another recording is active",
    SendValue: "send_value not allowed in recording (a fetch cannot wait inside a recording)",
    CreateStream: "create_stream not allowed in recording",
    CreateDeviceMesh: "create_device_mesh not allowed in recording",
    CreateRemoteProcessGroup: "create_remote_process_group not allowed in recording",
    Exit: "exit not allowed in recording",
}


class Recording:
    """A complete recording: ``programs`` (stream id -> ``Program``) in ascending stream order, the specs of
    the borrows it creates (made anew for each call), and its declared ``nresults`` / ``nformals``."""

    def __init__(self, ref_id: int, programs: dict, borrows: dict, nresults: int, nformals: int,
                 cuda_graph: bool = False):
        self.ref_id = ref_id
        self.programs = programs
        self.borrows = borrows  # borrow id -> (tensor Ref, result Ref, from stream id, to stream id)
        self.nresults = nresults
        self.nformals = nformals
        self.cuda_graph = cuda_graph  # replayed as CUDA graphs on GPU workers (worker/graphs.py)
        #: replays run to their end on the recording's first stream (the dashboard's compiled calls per second)
        self.replayed = 0
        self._first = min(programs) if programs else None

    def __repr__(self) -> str:
        steps = sum(len(p.steps) for p in self.programs.values())
        return f"recording r{self.ref_id} ({steps} steps on streams {sorted(self.programs)})"


class ReplayCall:
    """One ``CallRecording`` on one worker, queued on every stream of its recording: the actuals, the result refs,
    the borrows made for this call, and the report of its first root failure (one ``RemoteFunctionFailed`` per
    call and rank, under the ``CallRecording`` seq, whichever stream fails first; spec §7)."""

    __slots__ = ("recording", "seq", "results", "actuals", "borrows", "_reported", "_lock")

    def __init__(self, recording: Recording, seq: int, results: list, actuals: list, borrows: dict):
        self.recording = recording
        self.seq = seq
        self.results = results
        self.actuals = actuals
        self.borrows = borrows
        self._reported = False
        self._lock = threading.Lock()

    def run(self, stream) -> None:
        """On ``stream``'s thread, in its order: replay this stream's part (``worker/replay.py``), through a CUDA
        graph if the recording asks for one (``worker/graphs.py``)."""
        recording = self.recording
        stream.replay = self  # the dashboard shows the operations it runs as this call's (worker/activity.py)
        try:
            if recording.cuda_graph:
                replay_graph(stream, self, replay)
            else:
                replay(stream, self)
        finally:
            stream.replay = None
        if stream.ref.id == recording._first:
            recording.replayed += 1

    def root_error(self, stream, index: int | None, text: str) -> SeqError:
        """A root failure of operation ``index`` of the recording on ``stream``: the error its results take, and
        the call's one ``RemoteFunctionFailed`` (under the ``CallRecording`` seq) if none was sent yet."""
        program = self.recording.programs[stream.ref.id]
        where = f"operation {index} ({program.names.get(index, '?')})" if index is not None else "a formal or result"
        error = WorkerError(f"recording r{self.recording.ref_id} failed at {where}: {text}", stream.tw.actor_id)
        with self._lock:
            first = not self._reported
            self._reported = True
        if first:
            stream.tw.report(RemoteFunctionFailed(self.seq, error, index))
            stream.tw.note_error(self.seq, error.backtrace)
        return SeqError(self.seq, error)


class _Partial:
    """A recording whose chunks are still arriving."""

    __slots__ = ("ref_id", "last_index", "commands")

    def __init__(self, ref_id: int):
        self.ref_id = ref_id
        self.last_index = 0
        self.commands: list = []


class Definitions:
    """The recordings of one session on one worker (``TensorWorker.recordings``)."""

    def __init__(self, tw):
        self.tw = tw
        self.complete: dict[int, Recording] = {}
        self.partial: _Partial | None = None

    # --------------------------------------------------------------------------------------- DefineRecording
    def define(self, msg: DefineRecording) -> None:
        """Take one chunk; build the recording when its last chunk is here (spec §7)."""
        rid = msg.result.id
        partial = self.partial
        if partial is not None and partial.ref_id != rid:
            raise FatalError(
                f"DefineRecording r{rid}: different recording already active (r{partial.ref_id} is being defined)"
            )
        if not 0 <= msg.index < msg.ntotal_messages:
            raise FatalError(
                f"DefineRecording r{rid}: index {msg.index} is not below ntotal_messages {msg.ntotal_messages}"
            )
        if partial is None:
            if rid in self.complete:
                raise FatalError(f"DefineRecording r{rid}: recording r{rid} already defined")
            if msg.index != 0:
                raise FatalError(
                    f"DefineRecording r{rid}: got index {msg.index} > 0 for a previously unseen recording"
                )
            partial = self.partial = _Partial(rid)
        elif msg.index != partial.last_index + 1:
            raise FatalError(
                f"DefineRecording r{rid}: got index {msg.index}, but the last index seen for it is "
                f"{partial.last_index}"
            )
        partial.last_index = msg.index
        partial.commands.extend(msg.commands)
        if msg.index < msg.ntotal_messages - 1:
            return
        self.partial = None
        if msg.backend not in BACKENDS:
            raise FatalError(f"DefineRecording r{rid}: unknown backend {msg.backend!r} (known: {sorted(BACKENDS)})")
        recording = _Builder(self.tw, rid).build(partial.commands, msg.nresults, msg.nformals)
        for program in recording.programs.values():
            program.backend = msg.backend
        if msg.cuda_graph:
            if len(recording.programs) > 1:
                raise FatalError(
                    f"DefineRecording r{rid}: cuda_graph: a recording on several streams "
                    f"({sorted(recording.programs)}) cannot be replayed as one CUDA graph"
                )
            recording.cuda_graph = True
        self.complete[rid] = recording

    # ----------------------------------------------------------------------------------------- CallRecording
    def call(self, msg: CallRecording) -> None:
        """Queue the replay of ``msg.recording`` on each of its streams (spec §7 "Worker CallRecording")."""
        if self.partial is not None:
            raise FatalError(
                f"CallRecording seq {msg.seq}: cannot call recording while another recording is active "
                f"(r{self.partial.ref_id} is being defined)"
            )
        recording = self.complete.get(msg.recording.id)
        if recording is None:
            raise FatalError(f"CallRecording seq {msg.seq}: could not find recording {msg.recording}: not found")
        tw = self.tw
        streams = {sid: tw.streams.get(sid) for sid in recording.programs}
        missing = sorted(sid for sid, s in streams.items() if s is None)
        if missing:
            raise FatalError(f"CallRecording seq {msg.seq}: {recording!r} runs on unknown streams {missing}")
        borrows = {
            bid: Borrow(bid, tensor, result, streams[lender], streams[borrower], tw.comms.timeout)
            for bid, (tensor, result, lender, borrower) in recording.borrows.items()
        }
        call = ReplayCall(recording, msg.seq, list(msg.results), list(msg.actuals), borrows)
        for sid in recording.programs:
            streams[sid].enqueue(call)

    def delete(self, ref_id: int) -> None:
        """``DeleteRefs`` of a recording's ref frees it (replays already queued keep their program)."""
        self.complete.pop(ref_id, None)


class _Builder:
    """Takes a recording's commands in order (spec §7 "Stream in defining mode") into per-stream programs."""

    def __init__(self, tw, rid: int):
        self.tw = tw
        self.rid = rid
        self.programs: dict[int, Program] = {}
        self.borrows: dict[int, tuple] = {}
        self.borrow_state: dict[int, str] = {}

    def fail(self, text: str):
        raise FatalError(f"DefineRecording r{self.rid}: {text}")

    def program(self, ref, what: str) -> Program:
        """The program of stream ``ref``; the stream joins the recording on its first command."""
        program = self.programs.get(ref.id)
        if program is None:
            if ref.id not in self.tw.streams:
                self.fail(f"{what}: unknown stream {ref.id} (known streams: {sorted(self.tw.streams)})")
            program = self.programs[ref.id] = Program(ref.id)
        return program

    def build(self, commands: list, nresults: int, nformals: int) -> Recording:
        for msg in commands:
            self.add(msg)
        undropped = sorted(bid for bid, state in self.borrow_state.items() if state != "dropped")
        if undropped:
            self.fail(f"all borrows created within recording must be dropped within recording (live: {undropped})")
        keep = {ref.id for tensor, result, _, _ in self.borrows.values() for ref in (tensor, result)}
        for program in self.programs.values():
            program.finish(self.tw, keep)
        programs = dict(sorted(self.programs.items()))
        return Recording(self.rid, programs, self.borrows, nresults, nformals)

    def add(self, msg) -> None:
        kind = type(msg)
        if kind is CommandGroup:
            for inner in msg.commands:
                self.add(inner)
        elif kind is CallFunction:
            self.program(msg.stream, f"CallFunction {msg.seq}").add(Call(msg), msg.results)
        elif kind is Reduce:
            self.program(msg.stream, "Reduce").add(ReduceStep(msg), [msg.result])
        elif kind is SendTensor:
            self.send_tensor(msg)
        elif kind is RecordingFormal:
            self.program(msg.stream, "RecordingFormal").add(Formal(msg), [msg.result])
        elif kind is RecordingResult:
            self.program(msg.stream, "RecordingResult").add(Result(msg), ())
        elif kind is DeleteRefs:
            self.delete_refs(msg)
        elif kind in (BorrowCreate, BorrowFirstUse, BorrowLastUse, BorrowDrop):
            self.borrow(msg)
        elif kind is DefineRecording:
            self.fail(f"different recording already active (a DefineRecording of {msg.result} among its commands)")
        elif kind in _REFUSED:
            self.fail(_REFUSED[kind])
        else:
            raise NotImplementedYet(f"{kind.__name__} in a recording")

    def send_tensor(self, msg: SendTensor) -> None:
        """A ``SendTensor`` joins the recording on the from stream (where the transfer runs) and, when this rank
        receives on another stream, on the to stream too (``worker/send_tensor.py``)."""
        p = plan(self.tw, msg, f"DefineRecording r{self.rid}: SendTensor")
        self.program(msg.from_stream, "SendTensor").add(SendStep(p), [msg.result] if p.defines_on_from else ())
        if p.handoff is not None:
            self.program(msg.to_stream, "SendTensor").add(TakeStep(p), [msg.result])

    def delete_refs(self, msg: DeleteRefs) -> None:
        for program in self.programs.values():
            program.add(Delete(msg), ())
        others = [s for sid, s in self.tw.streams.items() if sid not in self.programs]
        for stream in others:  # streams outside the recording run it now (spec §7 note)
            stream.enqueue(msg)

    def borrow(self, msg) -> None:
        bid = msg.borrow
        kind = type(msg)
        if kind is BorrowCreate:
            if bid in self.borrows or bid in self.tw.borrows:
                self.fail(f"duplicate borrow create in recording (borrow {bid})")
            self.program(msg.to_stream, f"BorrowCreate {bid} to_stream")
            self.program(msg.from_stream, f"BorrowCreate {bid} from_stream").add(BorrowStep("lend", bid), ())
            self.borrows[bid] = (msg.tensor, msg.result, msg.from_stream.id, msg.to_stream.id)
            self.borrow_state[bid] = "created"
            return
        name = kind.__name__
        if bid not in self.borrows:
            what = "borrow drop" if kind is BorrowDrop else name
            self.fail(f"{what} for borrow not defined in recording (borrow {bid})")
        needed, after, step, side = {
            BorrowFirstUse: ("created", "first_used", "first_use", 3),
            BorrowLastUse: ("first_used", "last_used", "last_use", 3),
            BorrowDrop: ("last_used", "dropped", "drop", 2),
        }[kind]
        state = self.borrow_state[bid]
        if state != needed:
            self.fail(f"{name}: borrow {bid} is {state}, but {name} needs it {needed}")
        self.borrow_state[bid] = after
        sid = self.borrows[bid][side]
        result = [self.borrows[bid][1]] if kind is BorrowFirstUse else ()
        self.programs[sid].add(BorrowStep(step, bid), result)
