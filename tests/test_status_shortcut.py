"""``SocketInbox`` (worker/inbox.py): a batch that is a lone ``RequestStatus`` reaching an idle rank on its answer
sockets is answered on the reader thread; behind any work still queued or running, or out of order, it takes the
dispatcher's way and its ``Status`` waits for that work (spec §2). A batch that only hands work to streams (stream
segments, barriers, deletions) is handed to them on the reader thread when the dispatcher is idle, in order; any
other batch, or one that comes while the dispatcher applies another, takes the dispatcher's way. A ``TensorWorker``
in this process, fed as the socket's reader feeds it."""

from __future__ import annotations

import pickle
import threading
import time

import torch

from dask_monarch.protocol import (
    ArgsKwargs,
    CallFunction,
    CreateStream,
    DeleteRefs,
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
    _wait_idle(tw)
    return tw


def _wait_idle(tw: TensorWorker) -> None:
    deadline = time.monotonic() + 30  # the barrier emits before its stream counts it applied
    while tw.inbox._active or not _idle(tw):
        assert time.monotonic() < deadline, "the worker did not become idle"
        time.sleep(0.01)


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


def _ones(seq: int, ref: int, n: int) -> CallFunction:
    return CallFunction(seq, [Ref(ref)], [], ONES, ArgsKwargs(([n],)), S0, [])


def _appliers(tw: TensorWorker) -> list:
    """The threads that run ``tw.apply`` from now on (the dispatcher's, or the caller of ``SocketInbox.put``)."""
    threads, apply = [], tw.apply

    def recording(messages):
        threads.append(threading.current_thread())
        apply(messages)
    tw.apply = recording
    return threads


def test_a_batch_of_stream_work_a_deletion_and_a_barrier_is_handed_to_the_streams_on_the_reader_thread():
    tw = _worker("enqueue")
    try:
        inbox = SocketInbox(tw)
        tw.inbox.put(2, [(0, 1, pickle.dumps([_ones(2, 10, 2)]))])
        tw.inbox.put(3, _status(3))
        tw.wait_status(3)
        _wait_idle(tw)
        appliers = _appliers(tw)
        batch = [(0, 1, pickle.dumps([_ones(4, 13, 4)])), pickle.dumps([DeleteRefs([Ref(10)])]),
                 (0, 1, pickle.dumps([_ones(5, 14, 5)])), pickle.dumps([RequestStatus(6, False)])]
        assert inbox.put(4, batch) is True
        assert inbox.enqueued == 1 and inbox.answered == 0
        assert appliers == [threading.current_thread()] * 2  # the deletion and the barrier, on this thread
        assert tw.inbox.next_batch == 5
        tw.wait_status(6)
        env = tw.streams[0].env
        assert tw.failure is None and 10 not in env
        assert torch.equal(env[13], torch.ones(4)) and torch.equal(env[14], torch.ones(5))
        assert _statuses(tw)[-1] == 7
        # the next batch, which needs the dispatcher (a new stream), goes its way, in order after it
        assert inbox.put(5, [pickle.dumps([CreateStream(StreamRef(1), StreamCreationMode.CreateNewStream),
                                           RequestStatus(7, False)])]) is True
        tw.wait_status(7)
        assert inbox.enqueued == 1 and 1 in tw.streams and appliers[-1] is tw.thread
    finally:
        tw.close()


def test_stream_work_that_comes_while_the_dispatcher_applies_a_batch_waits_for_it_in_order():
    tw = _worker("enqueue-busy")
    _gates["enqueue-busy"] = (threading.Event(), threading.Event())
    try:
        inbox = SocketInbox(tw)
        # unpickled by the dispatcher itself (a segment of messages that is not a stream's): it holds the dispatcher
        tw.inbox.put(2, [pickle.dumps([_Gate("enqueue-busy")])])
        assert _gates["enqueue-busy"][0].wait(30)
        assert inbox.put(3, [(0, 1, pickle.dumps([_ones(3, 15, 7)])), pickle.dumps([RequestStatus(4, False)])])
        assert inbox.enqueued == 0  # the dispatcher is busy: the batch waits for it in the inbox
        time.sleep(0.2)
        env = tw.streams[0].env
        assert tw.completed_seq == 2 and 11 not in env and 15 not in env  # nothing of it ran ahead
        _gates["enqueue-busy"][1].set()
        tw.wait_status(4)
        assert tw.failure is None and torch.equal(env[11], torch.ones(3)) and torch.equal(env[15], torch.ones(7))
        assert inbox.enqueued == 0 and _statuses(tw)[-1] == 5
    finally:
        _gates["enqueue-busy"][1].set()
        tw.close()


def test_stream_work_for_an_unknown_stream_fails_the_session_naming_it():
    tw = _worker("enqueue-bad")
    try:
        inbox = SocketInbox(tw)
        assert inbox.put(2, [(7, 1, pickle.dumps([_ones(2, 10, 2)])), pickle.dumps([RequestStatus(2, False)])])
        deadline = time.monotonic() + 30
        while tw.failure is None:
            assert time.monotonic() < deadline, "the session did not fail"
            time.sleep(0.01)
        assert "unknown stream 7" in tw.failure and "known streams: [0]" in tw.failure
        assert inbox.enqueued == 1
    finally:
        tw.close()
