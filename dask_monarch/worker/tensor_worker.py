"""``TensorWorker``: the tensor-worker state machine of one controller session on one Dask worker
(seed ``WorkerActor`` in ``lib.rs``; spec §2).

Batches arrive through the ``Inbox`` in the controller's order. One dispatcher thread unpickles them and applies
each message with the handler named after it (``CallFunction`` -> ``call_function``, ...); a segment of messages
that all run on one stream goes to that stream unopened (``protocol/batch.py``). Handlers that belong to
a stream only enqueue on that ``StreamWorker``; the dispatcher itself waits only for comm setup. A batch that only
hands work to streams (stream segments and barriers) is applied by the answer sockets' reader thread instead when
the dispatcher is idle (``enqueue_batch``; ``worker/inbox.py``), one wake-up fewer. Answers for the
controller (``RemoteFunctionFailed``, ``FetchResult``, ``Status``, ...) collect in the outbox
(``worker/outbox.py``), which the session's answer channel pushes and the ``sync_batch`` tasks take.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque

import torch

from ..protocol import (
    BackendNetworkInit, BackendNetworkPointToPointInit, BorrowCreate, BorrowDrop, BorrowFirstUse, BorrowLastUse,
    CallActorMethod, CallFunction, CallRecording, CommandGroup, CreateDeviceMesh, CreateRemoteProcessGroup,
    CreateStream, DefineRecording, DeleteRefs, Exit, GetRefUnitTestsOnly, PipeRecv, RecordingFormal, RecordingResult,
    Reduce, RequestStatus, SendResultOfActorCall, SendTensor, SendValue, SessionFailed, SetRefUnitTestsOnly, SplitComm,
    SplitCommForProcessGroup, Status, StreamRef, WorkerError,
)
from ..protocol.session_id import session_tag
from .actors import ActorCallStep
from .borrow import Borrow, BorrowStep
from .comm import Comms
from .comm_handlers import CommHandlers
from .device import guard_set_device, pin, select_device
from .device_mesh import DeviceMesh, MeshError
from .errors import FatalError
from .inbox import Inbox, load_segment
from .outbox import Outbox
from .process_group import ProcessGroups, unregister
from . import environment, exports, imports, opaque, pipe
from .recording import Definitions
from .stream import StatusBarrier, StreamSegment, StreamWorker

__all__ = ["TensorWorker", "SessionParams", "STUCK_AFTER", "RECENT_ERRORS"]

logger = logging.getLogger("dask_monarch.worker")

#: default of the session option ``stuck_after`` (Dask config ``monarch.dashboard.stuck-after``), seconds
STUCK_AFTER = 60.0
#: root failures remembered for the dashboard's list of remote errors (the newest)
RECENT_ERRORS = 8


def _empty_cache(device) -> None:
    """Return the CUDA caching allocator's unused blocks to the device (a clean end: no kernel is pending)."""
    if device.type == "cuda":
        try:
            torch.cuda.empty_cache()
        except Exception:
            pass


class SessionParams(tuple):
    """``(session_id, rank, world_size, options)`` as carried by every task of a session. ``options`` is a dict:
    ``comm_timeout`` (seconds, default 300) bounds rendezvous and collectives."""

    __slots__ = ()

    def __new__(cls, session_id: str, rank: int, world_size: int, options: dict | None = None):
        return super().__new__(cls, (session_id, rank, world_size, dict(options or {})))

    def __reduce__(self):
        return (SessionParams, tuple(self))


class TensorWorker(CommHandlers):
    """State of session ``session_id`` as rank ``rank`` of ``world_size`` on Dask ``worker``.

    ``on_close`` is called (with the session id and the failure text, or None) once the session has stopped on
    this worker: after ``Exit``, or right after a fatal error (``fail``).
    """

    def __init__(self, worker, session_id: str, rank: int, world_size: int, options: dict | None = None,
                 on_close=None):
        options = dict(options or {})
        self._default_dtype = torch.get_default_dtype()  # put back at close: a session may set it (follow_default_dtype)
        self.worker = worker
        self.session_id = session_id
        self.rank = rank
        self.world_size = world_size
        address = getattr(worker, "address", "local")
        self.actor_id = f"{address}/{session_tag(session_id)}/rank{rank}"
        self.device = select_device(int(options.get("local_rank", 0)))
        guard_set_device()  # Monarch's check on torch.cuda.set_device in remote functions
        self.streams: dict[int, StreamWorker] = {}
        self.device_meshes: dict[int, DeviceMesh] = {}
        self.borrows: dict[int, Borrow] = {}
        self.recordings = Definitions(self)
        self.comms = Comms(worker, rank, world_size, float(options.get("comm_timeout", 300.0)), self.device,
                           key=session_id)
        #: ``(from stream id, to stream id)`` -> the send/recv ``ProcessGroup`` (``BackendNetworkPointToPointInit``)
        self.p2p: dict = {}
        self.process_groups = ProcessGroups(self)
        self.inbox = Inbox()
        self.outbox = Outbox(self.actor_id)
        self.failure: str | None = None
        #: the last root failure reported (``(seq, text)``) and how many there were, for the dashboard
        self.last_error: tuple[int, str] | None = None
        self.errors = 0
        #: the newest root failures, ``(wall time, seq, text)``, for the dashboard's list of remote errors
        self.recent_errors: deque = deque(maxlen=RECENT_ERRORS)
        self.stuck_after = float(options.get("stuck_after", STUCK_AFTER))
        #: the message the dispatcher is applying (or applied last) and whether it is inside a batch
        #: (``worker/activity.py``)
        self.current = None
        self.busy = False
        self.closed = False
        self._closing = False
        self.completed_seq = 0
        self.socket_inbox = None  # what its answer sockets deliver to (``worker/channel.py``), once offered
        self.received = 0
        self._cond = threading.Condition()
        self._on_close = on_close
        self._handlers = {
            BackendNetworkInit: self.backend_network_init,
            BackendNetworkPointToPointInit: self.backend_network_point_to_point_init,
            CallFunction: self.call_function,
            CommandGroup: self.command_group,
            CreateStream: self.create_stream,
            CreateDeviceMesh: self.create_device_mesh,
            CreateRemoteProcessGroup: self.create_remote_process_group,
            BorrowCreate: self.borrow_create,
            BorrowFirstUse: self.borrow_first_use,
            BorrowLastUse: self.borrow_last_use,
            BorrowDrop: self.borrow_drop,
            DeleteRefs: self.delete_refs,
            RequestStatus: self.request_status,
            Reduce: self.reduce,
            SplitComm: self.split_comm,
            SplitCommForProcessGroup: self.split_comm_for_process_group,
            SendTensor: self.send_tensor,
            SendValue: self.send_value,
            SendResultOfActorCall: self.send_result_of_actor_call,
            CallActorMethod: self.call_actor_method,
            PipeRecv: self.pipe_recv,
            Exit: self.exit,
            DefineRecording: self.define_recording,
            RecordingFormal: self.recording_formal,
            RecordingResult: self.recording_result,
            CallRecording: self.call_recording,
            SetRefUnitTestsOnly: self.set_ref_unit_tests_only,
            GetRefUnitTestsOnly: self.get_ref_unit_tests_only,
        }
        local_rank = int(options.get("local_rank", 0))  # RANK, LOCAL_RANK, ... in os.environ (worker/environment.py)
        environment.enter_session(session_id, rank, world_size, local_rank,
                                  int(options.get("local_world_size", local_rank + 1)))
        self.thread = threading.Thread(target=self._run, name=f"monarch-{session_tag(session_id)}-dispatch",
                                       daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------------------------------- dispatcher loop
    def _run(self) -> None:
        pin(self.device)
        while True:
            segments = self.inbox.get()
            if segments is None:
                break
            if self.failure is not None or self.closed:
                continue
            self.busy = True
            try:
                if not self.apply_batch(segments):
                    return
            finally:
                self.busy = False
                self.inbox.done()
        if self.failure is not None:
            self.close(join_timeout=1.0)  # a failed session stops here and frees its streams, refs and comms

    def apply_batch(self, segments: list) -> bool:
        """Apply one batch's ``segments`` in order: a stream segment (a tuple: stream id, count, bytes) goes to that
        stream unopened, for its thread to open; pickled bytes are opened here; a list is messages ``SocketInbox``
        already opened. A fatal error fails the session. The streams are flushed at the end. Returns False if the
        session closed meanwhile (an ``Exit``)."""
        try:
            for segment in segments:
                if type(segment) is tuple:
                    self.stream_segment(*segment)
                    continue
                messages = segment if type(segment) is list else load_segment(segment)
                self.received += len(messages)
                self.apply(messages)
                if self.closed:
                    return False
        except FatalError as e:
            self.fail(str(e))
        except BaseException:
            self.fail(f"unexpected error in the dispatcher\n{traceback.format_exc()}")
        finally:
            self.flush_streams()
        return True

    def enqueue_batch(self, segments: list) -> None:
        """``apply_batch`` on the calling thread (the answer sockets' reader: ``SocketInbox``), in the dispatcher's
        place, for a batch that only hands work to the streams: stream segments and lists of messages whose handlers
        only enqueue on the streams (``RequestStatus``, ``DeleteRefs``). The caller holds the inbox (``Inbox.take``),
        so the dispatcher applies nothing meanwhile. The calling thread is pinned to the rank's device first, as the
        dispatcher is: a deletion may free a recording's CUDA graphs here."""
        if self.failure is None and not self.closed:
            pin(self.device)
            self.apply_batch(segments)

    def apply(self, messages) -> None:
        """Apply ``messages`` (validated: unpickled through their constructors) in order. Something that is not a
        worker message, or a fatal error, stops here (``FatalError``)."""
        handlers = self._handlers
        for msg in messages:
            handler = handlers.get(type(msg))
            if handler is None:
                raise FatalError(f"malformed message: expected a WorkerMessage, got {type(msg).__name__}")
            self.current = msg
            handler(msg)
            if self.failure is not None or self.closed:
                return

    def stream_segment(self, stream_id, count, blob) -> None:
        """Hand a stream segment (``count`` pickled messages that all run on stream ``stream_id``;
        ``protocol/batch.py``) to that stream unopened."""
        stream = self.streams.get(stream_id)
        if stream is None:
            raise FatalError(
                f"a batch of {count} messages for unknown stream {stream_id} (known streams: {sorted(self.streams)})"
            )
        self.received += count
        stream.enqueue_segment(StreamSegment(count, blob))

    def flush_streams(self) -> None:
        for stream in self.streams.values():
            stream.flush()

    def _stream(self, ref: StreamRef, what: str) -> StreamWorker:
        stream = self.streams.get(ref.id)
        if stream is None:
            raise FatalError(f"{what}: unknown stream {ref.id} (known streams: {sorted(self.streams)})")
        return stream

    # ------------------------------------------------------------------------------------------ answers, failure
    def report(self, message) -> None:
        """Queue a controller message (``RemoteFunctionFailed``, ``FetchResult``, ...) for the controller
        (``Outbox.put``)."""
        self.outbox.put(message)

    def note_error(self, seq: int, text: str) -> None:
        """Remember a root failure (``RemoteFunctionFailed``) for the dashboard; called on error paths only."""
        self.last_error = (seq, text)
        self.errors += 1
        self.recent_errors.append((time.time(), seq, text))

    def emit_status(self, seq: int, controller: bool = False, report: bool = True) -> None:
        """Every stream has run what came before ``RequestStatus{seq}``: report ``Status{seq + 1}`` (unless
        ``report`` is False: a barrier the rank's host relay answered for it, ``worker/relay.py``) and wake
        ``wait_status``."""
        if report:
            self.report(Status(seq + 1, self.actor_id, controller))
        with self._cond:
            self.completed_seq = max(self.completed_seq, seq + 1)
            self._cond.notify_all()

    def wait_status(self, seq: int) -> None:
        """Block until ``Status{seq + 1}`` was emitted, or the session failed or closed."""
        with self._cond:
            self._cond.wait_for(lambda: self.completed_seq > seq or self.failure is not None or self.closed)

    def wait_closed(self) -> None:
        """Block until the session stopped on this worker (after ``Exit``) or failed."""
        with self._cond:
            self._cond.wait_for(lambda: self.closed or self.failure is not None)

    def fail(self, text: str, owner_left: bool = False) -> None:
        """Fail the session on this worker (class F): report ``SessionFailed`` once, stop applying messages, and
        abort the communicators (``Comms.abort``), so that a collective waiting here or on a peer errors out now
        instead of at ``comm_timeout``. Closing the inbox wakes the dispatcher, which then stops the session
        (``close``). ``owner_left``: the controller's Client disconnected; logged as the session's end (WARNING)
        rather than as a failure (ERROR)."""
        with self._cond:
            if self.failure is not None:
                return
            self.failure = text
            self.report(SessionFailed(WorkerError(text, self.actor_id)))
            self._cond.notify_all()
        if owner_left:
            logger.warning("dask_monarch session %s rank %d ended: %s", self.session_id, self.rank, text)
        else:
            logger.error("dask_monarch session %s rank %d failed: %s", self.session_id, self.rank, text)
        self.comms.abort(f"the session failed on rank {self.rank}: {text[:500]}")
        self.inbox.close()

    def close(self, join_timeout: float | None = 10.0) -> None:
        """Stop every stream (after what is queued), release comms, and forget the session. Idempotent.

        ``join_timeout`` (seconds) bounds the wait for each stream to run what is queued; None (a clean ``Exit``)
        waits as long as the session has not failed: the controller bounds that wait (``exit_timeout``) and, past
        it, ends the session through the scheduler (``fail``), after which a stream gets one more second.

        Everything the session held here is let go now, not at the next run of Python's cyclic garbage collector:
        each stream's thread drops its ref table as it ends (``StreamWorker._release``; of a failed session's stream
        still running a user function after the join, the closing thread empties the table, and the function keeps
        only what it holds until it returns), the process groups are released
        (aborted if the session failed), and the tables that tie the tensor worker to its streams, meshes and
        borrows are emptied. On a GPU worker a clean end also hands the caching allocator's free blocks back to
        the device (``torch.cuda.empty_cache``)."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
        streams = list(self.streams.values())
        for stream in streams:
            stream.stop()
        if self.failure is not None:
            self.comms.abort()  # first: a stream blocked in a collective or a transfer with a lost peer errors out now
        for stream in streams:
            self._join(stream.thread, join_timeout)
            if self.failure is not None and stream.thread.is_alive():
                # still in a user function: a failed session runs nothing after it (``StreamWorker._serve``), so
                # its ref table is let go now; the function keeps what it holds until it returns
                stream.env.clear()
        if self.failure is None:
            self.comms.shutdown()
        self.process_groups.close()  # out of torch.distributed's tables too
        self.process_groups = ProcessGroups(None)  # it refers back to this object
        for group in self.p2p.values():
            unregister(group)
        self.p2p = {}
        self.inbox.close()
        for mesh in list(self.device_meshes.values()):
            mesh.comms.clear()  # a remote function may have kept the mesh: not its communicators
        pipe.release_session(self.session_id)
        opaque.release_session(self.session_id)  # the objects OpaqueRefs name, held or not by the controller
        exports.release_session(self.session_id)
        imports.release_session(self.session_id)
        environment.leave_session(self.session_id)
        self.streams = {}
        self.device_meshes = {}
        self.borrows = {}
        self._handlers = {}  # its bound methods refer back to this object: a cycle only the collector would free
        self.recordings = Definitions(None)  # the recordings (and their CUDA graphs) refer back to it too
        del streams
        if self.failure is None:
            _empty_cache(self.device)
        if torch.get_default_dtype() is not self._default_dtype:
            torch.set_default_dtype(self._default_dtype)
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        self.outbox.closed()
        if self._on_close is not None:
            self._on_close(self.session_id, self.failure)

    def _join(self, thread: threading.Thread, timeout: float | None) -> None:
        """Join a stream's thread within ``timeout`` seconds; None: while the session has not failed, then 1 s."""
        if timeout is None:
            while thread.is_alive() and self.failure is None:
                thread.join(0.25)
            timeout = 1.0
        thread.join(timeout)

    @property
    def exiting(self) -> bool:
        """Whether the session is ending here and waits for its streams to finish what was queued (after a clean
        ``Exit``: the dashboard's "finishing")."""
        return self._closing and not self.closed and self.failure is None

    # ------------------------------------------------------------------------------------------------ handlers
    def call_function(self, msg: CallFunction) -> None:
        stream = self.streams.get(msg.stream.id) or self._stream(msg.stream, f"CallFunction seq {msg.seq}")
        stream.enqueue(msg)

    def send_value(self, msg: SendValue) -> None:
        stream = self.streams.get(msg.stream.id) or self._stream(msg.stream, f"SendValue seq {msg.seq}")
        stream.enqueue(msg)

    def send_result_of_actor_call(self, msg: SendResultOfActorCall) -> None:
        """Run the actor method on ``msg.params.stream`` in its order; answer its result (``worker/actors.py``)."""
        self._stream(msg.params.stream, f"SendResultOfActorCall seq {msg.params.seq}").enqueue(ActorCallStep(msg))

    def call_actor_method(self, msg: CallActorMethod) -> None:
        """Run the actor method on ``msg.call.stream`` in its order; store its result in ``msg.results``
        (``worker/actors.py``)."""
        self._stream(msg.call.stream, f"CallActorMethod seq {msg.call.seq}").enqueue(ActorCallStep(msg))

    def reduce(self, msg: Reduce) -> None:
        stream = self.streams.get(msg.stream.id) or self._stream(msg.stream, "Reduce")
        stream.enqueue(msg)

    def pipe_recv(self, msg: PipeRecv) -> None:
        """The next batch of a pipe, on its stream (``worker/pipe.py``; DESIGN.md "Decisions": pipes)."""
        stream = self.streams.get(msg.stream.id) or self._stream(msg.stream, f"PipeRecv seq {msg.seq}")
        stream.enqueue(msg)

    def command_group(self, msg: CommandGroup) -> None:
        self.apply(msg.commands)

    def create_stream(self, msg: CreateStream) -> None:
        """Start stream ``id``; an existing one is stopped after its queued work and replaced (spec §2)."""
        old = self.streams.pop(msg.id.id, None)
        if old is not None:
            old.stop()
        self.streams[msg.id.id] = StreamWorker(self, msg.id, msg.stream_creation)

    def create_device_mesh(self, msg: CreateDeviceMesh) -> None:
        try:
            self.device_meshes[msg.result.id] = DeviceMesh(msg.names, msg.ranks, self.rank)
        except MeshError as e:
            raise FatalError(str(e)) from None

    def borrow_create(self, msg: BorrowCreate) -> None:
        """Open borrow ``msg.borrow``: the from stream hands ``msg.tensor`` over (spec §4 "Create")."""
        if msg.borrow in self.borrows:
            raise FatalError(f"BorrowCreate: duplicate borrow id {msg.borrow} ({self.borrows[msg.borrow]!r} is live)")
        lender = self._stream(msg.from_stream, f"BorrowCreate {msg.borrow} from_stream")
        borrower = self._stream(msg.to_stream, f"BorrowCreate {msg.borrow} to_stream")
        borrow = Borrow(msg.borrow, msg.tensor, msg.result, lender, borrower, self.comms.timeout)
        self.borrows[msg.borrow] = borrow
        lender.enqueue(BorrowStep(borrow.lend))

    def borrow_first_use(self, msg: BorrowFirstUse) -> None:
        """The to stream takes the borrowed tensor as ``result`` once the from stream handed it over (spec §4)."""
        borrow = self._borrow(msg.borrow, "BorrowFirstUse")
        borrow.advance("BorrowFirstUse")
        borrow.borrower.enqueue(BorrowStep(borrow.first_use))

    def borrow_last_use(self, msg: BorrowLastUse) -> None:
        """The to stream removes ``result`` and hands it back (spec §4 "LastUse")."""
        borrow = self._borrow(msg.borrow, "BorrowLastUse")
        borrow.advance("BorrowLastUse")
        borrow.borrower.enqueue(BorrowStep(borrow.last_use))

    def borrow_drop(self, msg: BorrowDrop) -> None:
        """The from stream waits for the hand-back, then the borrow is forgotten (spec §4 "Drop")."""
        borrow = self._borrow(msg.borrow, "BorrowDrop")
        borrow.advance("BorrowDrop")
        del self.borrows[msg.borrow]
        borrow.lender.enqueue(BorrowStep(borrow.drop))

    def _borrow(self, borrow_id: int, what: str) -> Borrow:
        borrow = self.borrows.get(borrow_id)
        if borrow is None:
            raise FatalError(f"{what}: invalid borrow id: {borrow_id} (live borrows: {sorted(self.borrows)})")
        return borrow

    def delete_refs(self, msg: DeleteRefs) -> None:
        for ref in msg.refs:
            self.device_meshes.pop(ref.id, None)
            self.recordings.delete(ref.id)
            self.process_groups.delete(ref.id)
        for stream in self.streams.values():
            stream.enqueue(msg)

    def request_status(self, msg: RequestStatus) -> None:
        """``Status{seq + 1}`` once every stream has run what was queued before (spec §2). Non-blocking: each
        stream arrives at a barrier; the last one emits."""
        streams = list(self.streams.values())
        if not streams:
            self.emit_status(msg.seq, msg.controller)
            return
        barrier = StatusBarrier(self, msg.seq, msg.controller, len(streams))
        for stream in streams:
            stream.enqueue(barrier)

    def exit(self, msg: Exit) -> None:
        """Drain and stop every stream and end the session on this worker; the Dask worker lives on. A stream busy
        on a long function is waited for (the controller waits for its ``Status``, up to its ``exit_timeout``). With an
        error (a peer or the controller failed) the session fails here instead: queued work is dropped, and the
        communicators are released first, so that a stream blocked in a collective with a lost peer errors out
        now instead of at the collective's timeout."""
        if msg.error is not None:
            self.fail(f"the controller ended the session: {msg.error[1]}")
        self.flush_streams()
        self.close(join_timeout=None if msg.error is None else 1.0)  # a clean exit waits for busy streams

    def define_recording(self, msg: DefineRecording) -> None:
        """A chunk of recording ``msg.result``; with the last one, its commands become one prepared program per
        stream (spec §7; ``worker/recording.py``)."""
        self.recordings.define(msg)

    def recording_formal(self, msg: RecordingFormal) -> None:
        """Only among a ``DefineRecording``'s commands (spec §7)."""
        raise FatalError(f"RecordingFormal {msg.result}: recording_formal called outside of recording")

    def recording_result(self, msg: RecordingResult) -> None:
        """Only among a ``DefineRecording``'s commands (spec §7)."""
        raise FatalError(f"RecordingResult {msg.result}: recording_result called outside of recording")

    def call_recording(self, msg: CallRecording) -> None:
        """Replay recording ``msg.recording`` on each of its streams, in their order (spec §7)."""
        self.recordings.call(msg)

    def set_ref_unit_tests_only(self, msg: SetRefUnitTestsOnly) -> None:
        stream = self._stream(msg.stream, "SetRefUnitTestsOnly")
        stream.enqueue(msg)

    def get_ref_unit_tests_only(self, msg: GetRefUnitTestsOnly) -> None:
        stream = self._stream(msg.stream, "GetRefUnitTestsOnly")
        stream.enqueue(msg)
