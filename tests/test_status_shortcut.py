"""``SocketInbox`` (worker/inbox.py): a batch that is a lone ``RequestStatus`` reaching an idle rank on its answer
sockets is answered on the reader thread; behind any work still queued or running, or out of order, it takes the
dispatcher's way and its ``Status`` waits for that work (spec §2). A ``TensorWorker`` in this process, fed as the
socket's reader feeds it."""

from __future__ import annotations

import pickle
import threading
import time

import torch

from dask_monarch.protocol import (
    ArgsKwargs,
    CallFunction,
    CreateStream,
    FunctionPath,
    Ref,
    RequestStatus,
    Status,
    StreamCreationMode,
    StreamRef,
)
from dask_monarch.worker.inbox import SocketInbox, _idle
from dask_monarch.worker.tensor_worker import TensorWorker

S0 = StreamRef(0)
ONES = FunctionPath("torch.ops.aten.ones.default")
_gates: dict = {}


def _status(seq: int) -> list:
    return [pickle.dumps([RequestStatus(seq, False)])]


def _worker(tag: str) -> TensorWorker:
    tw = TensorWorker(None, f"test-shortcut-{tag}", 0, 1)
    tw.inbox.put(0, [pickle.dumps([CreateStream(S0, StreamCreationMode.UseDefaultStream)])])
    tw.inbox.put(1, _status(1))
    tw.wait_status(1)
    deadline = time.monotonic() + 30  # the barrier emits before its stream counts it applied
    while tw.inbox._active or not _idle(tw):
        assert time.monotonic() < deadline, "the worker did not become idle"
        time.sleep(0.01)
    return tw


def _statuses(tw: TensorWorker) -> list:
    return [m.seq for m in tw.outbox._messages if type(m) is Status]


def test_a_lone_status_request_at_an_idle_rank_is_answered_on_the_reader_thread():
    tw = _worker("idle")
    try:
        inbox = SocketInbox(tw)
        dispatcher_before = tw.received
        assert inbox.put(2, _status(5)) is True
        # answered before put returned, on this thread: no other thread had to run
        assert inbox.answered == 1 and tw.completed_seq == 6
        assert _statuses(tw)[-1] == 6
        assert tw.received == dispatcher_before + 1
        # the next batch goes the ordinary way, in order after it
        tw.inbox.put(3, [pickle.dumps([CallFunction(6, [Ref(10)], [], ONES, ArgsKwargs(([2],)), S0, [])])])
        inbox.put(4, _status(7))
        tw.wait_status(7)
        assert tw.failure is None and torch.equal(tw.streams[0].env[10], torch.ones(2))
    finally:
        tw.close()


def _gated_call(name: str) -> CallFunction:
    """Unpickled on the stream's thread (a stream segment): waits for its gate, then is a ``CallFunction``."""
    entered, release = _gates[name]
    entered.set()
    assert release.wait(30)
    return CallFunction(2, [Ref(11)], [], ONES, ArgsKwargs(([3],)), S0, [])


class _Gate:
    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return (_gated_call, (self.name,))


def test_a_status_request_behind_a_running_stream_waits_for_it():
    tw = _worker("busy")
    _gates["busy"] = (threading.Event(), threading.Event())
    try:
        inbox = SocketInbox(tw)
        tw.inbox.put(2, [(0, 1, pickle.dumps([_Gate("busy")]))])
        assert _gates["busy"][0].wait(30)  # the stream is running it
        assert inbox.put(3, _status(3)) is True  # accepted by the inbox, not answered
        assert inbox.answered == 0
        time.sleep(0.2)
        assert tw.completed_seq == 2  # no Status{4} while the stream still runs seq 2
        _gates["busy"][1].set()
        tw.wait_status(3)
        assert tw.failure is None and torch.equal(tw.streams[0].env[11], torch.ones(3))
        assert inbox.answered == 0 and _statuses(tw)[-1] == 4
    finally:
        _gates["busy"][1].set()
        tw.close()


def test_a_status_request_out_of_order_or_with_other_messages_is_not_answered_at_once():
    tw = _worker("order")
    try:
        inbox = SocketInbox(tw)
        assert inbox.put(3, _status(4)) is True  # batch 2 has not come: it waits for it
        assert inbox.answered == 0 and tw.completed_seq == 2
        both = [pickle.dumps([CallFunction(2, [Ref(12)], [], ONES, ArgsKwargs(([1],)), S0, []),
                              RequestStatus(3, False)])]
        assert inbox.put(2, both) is True
        tw.wait_status(4)
        assert inbox.answered == 0 and tw.failure is None and _statuses(tw)[-2:] == [4, 5]
    finally:
        tw.close()
