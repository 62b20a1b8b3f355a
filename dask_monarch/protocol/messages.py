"""Every ``WorkerMessage`` variant of the seed ``worker.rs`` and the ``ControllerMessage`` variants.

Names and fields follow the seed; the behaviour of each is spec §2 (and §4, §5, §7 for borrows, comms and
recordings). Each class validates its fields when constructed (``ProtocolError`` naming the message and the
field), and pickles as a call of its constructor, so the worker validates what it receives while unpickling it
(a message changed after construction included). :func:`validate` checks a message built in-process. The field
checks are in ``checks.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .checks import WORKER_TYPES, call_function_ok, nested, validate
from .checks import Validated as _Validated
from .checks import message as _message
from .refs import Ref, StreamRef
from .slice import Slice
from .types import ArgsKwargs, Factory, Reduction, StreamCreationMode, WorkerError
from .wire_value import WireValue

__all__ = [
    # worker messages
    "BackendNetworkInit",
    "BackendNetworkPointToPointInit",
    "BorrowCreate",
    "BorrowDrop",
    "BorrowFirstUse",
    "BorrowLastUse",
    "CallActorMethod",
    "CallFunction",
    "CallRecording",
    "CommandGroup",
    "CreateDeviceMesh",
    "CreateRemoteProcessGroup",
    "CreateStream",
    "DefineRecording",
    "DeleteRefs",
    "Exit",
    "GetRefUnitTestsOnly",
    "PipeRecv",
    "RecordingFormal",
    "RecordingResult",
    "Reduce",
    "RequestStatus",
    "SendResultOfActorCall",
    "SendTensor",
    "SendValue",
    "SetRefUnitTestsOnly",
    "SplitComm",
    "SplitCommForProcessGroup",
    "ActorCallParams",
    "WORKER_MESSAGES",
    "WorkerMessage",
    # controller messages
    "ControllerMessage",
    "FetchResult",
    "GetRefResult",
    "RemoteFunctionFailed",
    "SessionFailed",
    "Status",
    "validate",
]


# ---------------------------------------------------------------------------------------------- worker messages
@_message
class BackendNetworkInit(_Validated):
    """Create the world communicator of this session, then one per existing stream in ascending stream order
    (spec §5). ``unique_id`` is the rendezvous key (the analogue of Monarch's NCCL ``UniqueId``)."""

    unique_id: str


@_message
class BackendNetworkPointToPointInit(_Validated):
    """Create the send/recv communicator for ``(from_stream, to_stream)`` (spec §5)."""

    from_stream: StreamRef
    to_stream: StreamRef


@_message
class CallFunction(_Validated):
    """Call ``function(*args, **kwargs)`` on ``stream``; store the flattened result's leaves in ``results``
    (spec §2 "Computation"). ``declared``, if not None, has one entry per result: ``None`` (not checked) or the
    ``(dtype, shape)`` the controller propagated for that output; a leaf that is not a tensor of that dtype and
    shape fails the call (its results and mutated refs take the error; ``worker/result_checks.py``)."""

    seq: Seq
    results: list[Optional[Ref]]
    mutates: list[Ref]
    function: ResolvableFunction
    args_kwargs: ArgsKwargs
    stream: StreamRef
    remote_process_groups: list[Ref]
    declared: Optional[Declared] = None

    def __post_init__(self):
        if not call_function_ok(self):
            validate(self)


@_message
class CommandGroup(_Validated):
    """Handle ``commands`` in order; the first fatal error aborts the rest (spec §2)."""

    commands: list[WorkerMessage]


@_message
class CreateStream(_Validated):
    """Start stream ``id`` (its own thread and ref table); an existing id is replaced (spec §2, §4)."""

    id: StreamRef
    stream_creation: StreamCreationMode


@_message
class CreateDeviceMesh(_Validated):
    """Store the worker-side device mesh ``names`` x ``ranks`` under ``result`` (spec §2, §6)."""

    result: Ref
    names: list[str]
    ranks: Slice


@_message
class CreateRemoteProcessGroup(_Validated):
    """Store a process group over ``dims`` of ``device_mesh`` under ``result`` (spec §5)."""

    result: Ref
    device_mesh: Ref
    dims: list[str]


@_message
class BorrowCreate(_Validated):
    """Borrow ``tensor`` from ``from_stream`` into ``to_stream`` as ``result`` (spec §4)."""

    result: Ref
    borrow: int
    tensor: Ref
    from_stream: StreamRef
    to_stream: StreamRef


@_message
class BorrowFirstUse(_Validated):
    """First use of borrow ``borrow`` on the receiving stream (spec §4)."""

    borrow: int


@_message
class BorrowLastUse(_Validated):
    """Last use of borrow ``borrow`` on the receiving stream (spec §4)."""

    borrow: int


@_message
class BorrowDrop(_Validated):
    """Release borrow ``borrow`` on the lending stream (spec §4)."""

    borrow: int


@_message
class DeleteRefs(_Validated):
    """Drop ``refs`` from every stream's ref table; missing refs are ignored (spec §2)."""

    refs: list[Ref]


@_message
class RequestStatus(_Validated):
    """Answer ``Status{seq + 1}`` once every stream has drained what was queued before (spec §2)."""

    seq: Seq
    controller: bool


@_message
class Reduce(_Validated):
    """Collective over ``dims`` of ``mesh`` on ``stream``: all-reduce, reduce-scatter, all-gather (stack) or
    all-to-all (stack + scatter), into ``result`` (spec §5 table).

    ``seq`` (not in the seed) is the controller's seq of the reduce: a rank whose input does not match
    ``factory`` reports its error as ``RemoteFunctionFailed{seq}`` (DESIGN.md "Decisions"); None in raw
    messages, which then only store the error."""

    result: Ref
    tensor: Ref
    factory: Factory
    mesh: Ref
    stream: StreamRef
    dims: list[str]
    reduction: Reduction
    scatter: bool
    in_place: bool
    out: Optional[Ref]
    seq: Optional[Seq] = None


@_message
class SplitComm(_Validated):
    """Create the communicator of ``(stream, sorted dims)`` of ``device_mesh`` (spec §5)."""

    dims: list[str]
    device_mesh: Ref
    stream: StreamRef


@_message
class SplitCommForProcessGroup(_Validated):
    """Create the communicator of a remote process group on ``stream`` (spec §5)."""

    remote_process_group: Ref
    stream: StreamRef


@_message
class SendTensor(_Validated):
    """Point-to-point copy of ``tensor`` from ``from_ranks`` to ``to_ranks``, paired by row-major index (spec §5).

    ``seq`` (not in the seed) is the controller's seq of the ``to_mesh``: a sender whose input does not match
    ``factory`` reports its error as ``RemoteFunctionFailed{seq}`` (it sends zeros, so the receiver never
    waits); None in raw messages, which then only store the error."""

    result: Ref
    from_ranks: Slice
    to_ranks: Slice
    tensor: Ref
    factory: Factory
    from_stream: StreamRef
    to_stream: StreamRef
    seq: Optional[Seq] = None


@_message
class SendValue(_Validated):
    """Send ``function(*args, **kwargs)`` (or ``args[0]`` without a function) to the controller as a
    ``FetchResult`` (spec §2). ``destination`` (a pipe) is not supported."""

    seq: Seq
    destination: Optional[Ref]
    mutates: list[Ref]
    function: Optional[ResolvableFunction]
    args_kwargs: ArgsKwargs
    stream: StreamRef


@_message
class ActorCallParams(_Validated):
    """Parameters of a call of an actor's method on a stream (seed ``ActorCallParams``; spec §2 "Other variants").

    ``broker_id`` is ``(base key, 0)``: the Dask actor of this call on global rank ``r`` is the one whose key is
    ``f"{base}-{r}"`` (``mesh.spawn``), so one message serves every rank. ``local_state`` lists the refs among the
    arguments (each rank passes its local tensors), ``mutates`` the refs the method writes. Unlike the seed, where
    the method and its arguments travel in the actor's own message (its mailbox), here they travel in the call:
    ``method`` (the attribute name) and ``args_kwargs`` (refs as leaves, resolved on the stream as for
    ``CallFunction``, spec §8), because the stream itself runs the method, in its order."""

    seq: Seq
    broker_id: BrokerId
    local_state: list[Ref]
    mutates: list[Ref]
    stream: StreamRef
    method: str
    args_kwargs: ArgsKwargs


nested(ActorCallParams)


@_message
class SendResultOfActorCall(_Validated):
    """Run the actor method of ``params`` on its stream, in the stream's order, and answer ``FetchResult{seq}`` with
    what it returned (tensors as CPU copies) or its error (spec §2; ``worker/actors.py``)."""

    params: ActorCallParams


@_message
class CallActorMethod(_Validated):
    """Like ``SendResultOfActorCall``, storing the leaves of what the method returned in ``results`` (flattened with
    ``torch.utils._pytree``, as ``CallFunction``) instead of answering (spec §2; ``worker/actors.py``)."""

    results: list[Optional[Ref]]
    call: ActorCallParams


@_message
class PipeRecv(_Validated):
    """Receive a value from pipe ``pipe`` into ``results`` (removed in Monarch; a later issue)."""

    seq: Seq
    results: list[Optional[Ref]]
    pipe: Ref
    stream: StreamRef


@_message
class Exit(_Validated):
    """Drain and stop every stream and end this session on the worker; ``error`` is ``None`` or
    ``(actor id or None, message)`` (spec §2). The Dask worker process keeps running."""

    error: ExitError = None


@_message
class DefineRecording(_Validated):
    """Define (a chunk of) recording ``result`` made of ``commands`` (spec §7). ``cuda_graph`` (not in the seed;
    DESIGN.md "Decisions"): on GPU workers, replay each stream's part as a CUDA graph after a first replay.
    ``backend`` (not in the seed): ``"inductor"`` compiles the recording's runs of aten ops with ``torch.compile``
    after its first replay (``worker/inductor.py``); ``""`` replays them as generated Python."""

    result: Ref
    nresults: int
    nformals: int
    commands: list[WorkerMessage]
    ntotal_messages: int
    index: int
    cuda_graph: bool = False
    backend: str = ""


@_message
class RecordingFormal(_Validated):
    """Input ``argument_index`` of the recording being defined, as ``result`` on ``stream`` (spec §7)."""

    result: Ref
    argument_index: int
    stream: StreamRef


@_message
class RecordingResult(_Validated):
    """Output ``output_index`` of the recording being defined, read from ``result`` on ``stream`` (spec §7)."""

    result: Ref
    output_index: int
    stream: StreamRef


@_message
class CallRecording(_Validated):
    """Replay ``recording`` with ``actuals`` as inputs, storing outputs in ``results`` (spec §7)."""

    seq: Seq
    recording: Ref
    results: list[Ref]
    actuals: list[Ref]


@_message
class SetRefUnitTestsOnly(_Validated):
    """Test-only: store ``value`` (a ``WireValue``) in ``reference`` on ``stream`` (spec §2)."""

    reference: Ref
    value: WireValue
    stream: StreamRef


@_message
class GetRefUnitTestsOnly(_Validated):
    """Test-only: answer a ``GetRefResult`` with the value of ``value`` on ``stream`` (spec §2)."""

    value: Ref
    stream: StreamRef


WORKER_MESSAGES = (
    BackendNetworkInit,
    BackendNetworkPointToPointInit,
    CallFunction,
    CommandGroup,
    CreateStream,
    CreateDeviceMesh,
    CreateRemoteProcessGroup,
    BorrowCreate,
    BorrowFirstUse,
    BorrowLastUse,
    BorrowDrop,
    DeleteRefs,
    RequestStatus,
    Reduce,
    SplitComm,
    SplitCommForProcessGroup,
    SendTensor,
    SendValue,
    SendResultOfActorCall,
    CallActorMethod,
    PipeRecv,
    Exit,
    DefineRecording,
    RecordingFormal,
    RecordingResult,
    CallRecording,
    SetRefUnitTestsOnly,
    GetRefUnitTestsOnly,
)
WORKER_TYPES.update(WORKER_MESSAGES)

WorkerMessage = Any  # one of WORKER_MESSAGES


# ------------------------------------------------------------------------------------------ controller messages
@dataclass(slots=True)
class RemoteFunctionFailed:
    """A root failure of invocation ``seq`` on one rank (sent once per seq and rank; spec §3). For a failed
    ``CallRecording``, ``controller_frame_index`` is the position of the failing operation in the recording (the
    seq it was recorded with; Monarch's ``RemoteException.controller_frame_index``), else None."""

    seq: int
    error: WorkerError
    controller_frame_index: Optional[int] = None


@dataclass(slots=True)
class FetchResult:
    """The answer to ``SendValue`` ``seq``: ``value`` (tensors on CPU) or ``error`` (DESIGN.md "Decisions": a
    failing ``SendValue`` answers with its error)."""

    seq: int
    value: Any = None
    error: Optional[WorkerError] = None


@dataclass(slots=True)
class Status:
    """Every message before ``RequestStatus{seq - 1}`` is done on this worker (``seq`` is the first incomplete
    one; spec §2)."""

    seq: int
    worker_actor_id: str
    controller: bool = False


@dataclass(slots=True)
class GetRefResult:
    """Answer to ``GetRefUnitTestsOnly``: ``None`` if absent, ``error`` text if errored, else a ``WireValue``."""

    ref: Ref
    value: Optional[WireValue] = None
    error: Optional[str] = None
    present: bool = False


@dataclass(slots=True)
class SessionFailed:
    """A fatal error (spec §2 class F) ended this session on one worker; the Dask worker keeps running
    (DESIGN.md "Decisions"). The analogue of Monarch's supervision event."""

    error: WorkerError


ControllerMessage = Any  # RemoteFunctionFailed | FetchResult | Status | GetRefResult | SessionFailed
