"""Batch framing (protocol/batch.py): which messages travel in a stream's segment, and what the worker does with
a segment it cannot run. The worker cases feed a ``TensorWorker`` wire input that the controller never builds."""

from __future__ import annotations

import gc
import pickle
import threading

import torch

from dask_monarch.protocol import (
    ArgsKwargs,
    CallFunction,
    CreateStream,
    DeleteRefs,
    FunctionPath,
    ProtocolError,
    Ref,
    RequestStatus,
    SendValue,
    StreamCreationMode,
    StreamRef,
)
from dask_monarch.protocol import batch
from dask_monarch.worker.inbox import load_segment
from dask_monarch.worker.tensor_worker import TensorWorker

S0, S1 = StreamRef(0), StreamRef(1)
ONES = FunctionPath("torch.ops.aten.ones.default")


def call(seq: int, ref: int, stream=S0) -> CallFunction:
    return CallFunction(seq, [Ref(ref)], [], ONES, ArgsKwargs(([2],)), stream, [])


def test_segments_split_by_targets_and_stream():
    items = [
        ((0, 1), call(0, 10)),
        ((0, 1), call(1, 11)),
        ((0, 1), call(2, 12, S1)),
        ((0, 1), DeleteRefs([Ref(10)])),
        ((0, 1), RequestStatus(3, False)),
        ((1,), call(4, 13)),
        ((1,), SendValue(5, None, [], None, ArgsKwargs((Ref(13),)), S0)),
    ]
    out = batch.segments(items, pickle.dumps)
    shapes = [(targets, seg[:2] if type(seg) is tuple else "dispatcher") for targets, seg in out]
    assert shapes == [((0, 1), (0, 2)), ((0, 1), (1, 1)), ((0, 1), "dispatcher"), ((1,), (0, 2))]
    # a segment holds exactly its messages, in order
    assert [m.seq for m in pickle.loads(out[0][1][2])] == [0, 1]
    assert [type(m) for m in pickle.loads(out[2][1])] == [DeleteRefs, RequestStatus]


def test_a_message_changed_after_construction_fails_while_unpickling():
    msg = call(0, 10)
    msg.seq = -1
    try:
        pickle.loads(pickle.dumps(msg))
    except ProtocolError as e:
        assert str(e).startswith("CallFunction.seq: expected a non-negative int, got -1")
    else:
        raise AssertionError("unpickling a malformed CallFunction did not raise")


def _worker(tag: str) -> TensorWorker:
    tw = TensorWorker(None, f"test-batch-{tag}", 0, 1)
    tw.inbox.put(0, [pickle.dumps([CreateStream(S0, StreamCreationMode.UseDefaultStream)])])
    return tw


def _failure(tw: TensorWorker) -> str:
    tw.wait_closed()
    tw.thread.join(10)
    return tw.failure


def test_stream_segment_runs_on_its_stream():
    tw = _worker("ok")
    tw.inbox.put(1, [(0, 2, pickle.dumps([call(1, 10), call(2, 11)])), pickle.dumps([RequestStatus(3, False)])])
    tw.wait_status(3)
    assert tw.failure is None
    assert torch.equal(tw.streams[0].env[11], torch.ones(2))
    assert tw.received == 4  # CreateStream, the 2 calls (counted from the segment's header), RequestStatus
    assert tw.streams[0].applied == 3  # the 2 calls and the status barrier
    tw.close()


def test_segment_for_an_unknown_stream_fails_the_session_naming_it():
    tw = _worker("unknown")
    tw.inbox.put(1, [(7, 1, pickle.dumps([call(1, 10, StreamRef(7))]))])
    text = _failure(tw)
    assert "a batch of 1 messages for unknown stream 7 (known streams: [0])" in text


def test_segment_holding_another_streams_message_fails_the_session():
    tw = _worker("mixed")
    tw.inbox.put(1, [(0, 2, pickle.dumps([call(1, 10), call(2, 11, S1)]))])
    text = _failure(tw)
    assert text.startswith("stream 0: a segment for stream 0 holds CallFunction")


def test_malformed_message_in_a_stream_segment_fails_the_session_naming_the_field():
    tw = _worker("malformed")
    bad = call(1, 10)
    bad.results = [5]
    tw.inbox.put(1, [(0, 1, pickle.dumps([bad]))])
    text = _failure(tw)
    assert "malformed message: CallFunction.results[0]: expected a Ref or None, got 5 (int)" in text


_gates: dict = {}


def _gated(name: str) -> str:
    """Called while ``load_segment`` unpickles a ``_Gate``: notes whether the GC is enabled, then waits."""
    entered, release, seen = _gates[name]
    seen.append(gc.isenabled())
    entered.set()
    assert release.wait(30)
    seen.append(gc.isenabled())
    return name


class _Gate:
    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return (_gated, (self.name,))


def test_overlapping_segment_loads_keep_the_gc_paused_until_the_last_ends():
    # the dispatcher and every stream thread open segments (load_segment) at the same time: the GC stays paused
    # while any of them unpickles, and is on again after the last one (never left off)
    assert gc.isenabled()
    threads = {}
    try:
        for name in ("first", "second"):
            _gates[name] = (threading.Event(), threading.Event(), [])
            threads[name] = threading.Thread(target=load_segment, args=(pickle.dumps([_Gate(name)]),))
            threads[name].start()
            assert _gates[name][0].wait(30)
        _gates["first"][1].set()
        threads["first"].join(30)
        assert not gc.isenabled()  # the second load still runs
        _gates["second"][1].set()
        threads["second"].join(30)
        assert gc.isenabled()
        assert _gates["first"][2] == _gates["second"][2] == [False, False]
    finally:
        for name, thread in threads.items():
            _gates[name][1].set()
            thread.join(30)
        gc.enable()


_LAYOUT_RACE = """
import pickle, sys, threading
import torch
import dask_monarch.protocol  # noqa: F401  (what a worker and a controller import before any session runs)

blob = pickle.dumps([torch.strided, torch.sparse_coo])
stop = False

def churn():  # what an import of a torch submodule does to torch.__dict__, as fast as it can
    i = 0
    while not stop:
        setattr(torch, f"_churn{i % 8}", i)
        i += 1
        if i % 8 == 0:
            for j in range(8):
                delattr(torch, f"_churn{j}")

thread = threading.Thread(target=churn)
sys.setswitchinterval(1e-6)
thread.start()
try:
    print(pickle.loads(blob))
finally:
    stop = True
    thread.join()
"""


def test_a_layout_unpickles_while_another_thread_changes_the_torch_module():
    """The first ``torch.layout`` unpickled in a process makes torch fill a cache by iterating ``torch.__dict__``;
    another thread importing a torch submodule meanwhile made that raise "dictionary changed size during
    iteration", and a worker's batch (a factory's layout) failed on it in CI. Importing dask_monarch fills the cache
    first (protocol/tensor_bytes.py). Without that, this script fails on every run."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _LAYOUT_RACE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[torch.strided, torch.sparse_coo]"
