"""Helpers for tests that drive a session with raw worker messages (spec §9's worker cases): send a
``CallFunction``, wait for every rank, read refs back with the test-only ``GetRefUnitTestsOnly``."""

from __future__ import annotations

from dask_monarch.protocol import (
    ArgsKwargs,
    CallFunction,
    CreateStream,
    FunctionPath,
    GetRefResult,
    GetRefUnitTestsOnly,
    RemoteFunctionFailed,
    SendValue,
    Status,
    StreamCreationMode,
    StreamRef,
    WireValue,
)

TIMEOUT = 60
ST0 = StreamRef(0)  # created by the session itself
ST1 = StreamRef(1)

ONES = FunctionPath("torch.ops.aten.ones.default")
ZEROS = FunctionPath("torch.ops.aten.zeros.default")
FULL = FunctionPath("torch.ops.aten.full.default")
ADD = FunctionPath("torch.ops.aten.add.Tensor")
ADD_ = FunctionPath("torch.ops.aten.add_.Tensor")
SUB_ = FunctionPath("torch.ops.aten.sub_.Scalar")
MUL = FunctionPath("torch.ops.aten.mul.Tensor")
ALLCLOSE = FunctionPath("torch.ops.aten.allclose.default")
TENSOR = FunctionPath("torch.tensor")
MISSING = FunctionPath("i.dont.exist")


def refs(session, n):
    return [session.new_ref() for _ in range(n)]


def create_stream(session, stream, mode=StreamCreationMode.CreateNewStream):
    session.send(CreateStream(stream, mode))


def call_message(session, function, args=(), results=(None,), mutates=(), stream=ST1, kwargs=None, seq=None):
    """A ``CallFunction`` with a fresh seq (or ``seq``)."""
    seq = session.new_seq() if seq is None else seq
    return CallFunction(seq, list(results), list(mutates), function, ArgsKwargs(tuple(args), kwargs or {}), stream, [])


def call(session, function, args=(), results=(None,), mutates=(), stream=ST1, kwargs=None) -> int:
    """Send one ``CallFunction`` with a fresh seq; return the seq."""
    message = call_message(session, function, args, results, mutates, stream, kwargs)
    session.send(message)
    return message.seq


def sync(session):
    """Wait until every rank applied everything sent before; return the seq of the ``RequestStatus`` it sent."""
    future = session.sync("test sync")
    future.result(timeout=TIMEOUT)
    return future.status_seq


def get_refs(session, *wanted) -> list[GetRefResult]:
    """``GetRefUnitTestsOnly`` for each ``(ref, stream)`` of ``wanted`` (distinct refs) on a one-rank session; the
    replies in the same order (streams answer concurrently, so they arrive in any order)."""
    for ref, stream in wanted:
        session.send(GetRefUnitTestsOnly(ref, stream))
    sync(session)
    replies = {msg.ref: msg for _, msg in session.get_ref_results}
    assert len(replies) == len(session.get_ref_results) == len(wanted)
    session.get_ref_results.clear()
    return [replies[ref] for ref, _ in wanted]


def ctl_messages(session) -> list:
    """The controller messages received other than ``Status`` and ``GetRefResult``."""
    return [msg for _, msg in session.answers if not isinstance(msg, (Status, GetRefResult))]


def failures(session) -> list:
    """The ``RemoteFunctionFailed`` reports received so far."""
    return [msg for _, msg in session.answers if isinstance(msg, RemoteFunctionFailed)]


def fetch(session, obj, stream=ST1, rank=0):
    """The value of ``obj`` (refs resolved on ``stream``) on ``rank`` through an identity ``SendValue``."""
    seq = session.new_seq()
    session.send(SendValue(seq, None, [], None, ArgsKwargs((obj,)), stream), [rank])
    sync(session)
    answer = session.take_fetch_result(seq)
    assert answer is not None and answer.error is None, answer
    return answer.value


def ok(reply: GetRefResult, value: WireValue | None = None) -> bool:
    return reply.present and reply.error is None and (value is None or reply.value == value)
