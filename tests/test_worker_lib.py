"""Spec §9 "lib.rs" acceptance cases 1-7, as raw worker messages sent through a real one-rank session (world 1,
rank 0) on a Dask ``LocalCluster`` worker process. "ctl messages" are the controller messages the worker sent,
other than ``Status`` and the ``GetRefResult`` replies of the test-only ``GetRefUnitTestsOnly``."""

from __future__ import annotations

import cloudpickle
import pytest
import torch

from dask_monarch.protocol import (
    CreateDeviceMesh,
    DeleteRefs,
    FunctionPath,
    Cloudpickle,
    RemoteFunctionFailed,
    RequestStatus,
    SetRefUnitTestsOnly,
    Slice,
    Status,
    StreamCreationMode,
    WireValue,
)
from rawmsg import ALLCLOSE, MISSING, ONES, ST0, ST1, SUB_, ZEROS, call, create_stream, ctl_messages, fetch, get_refs
from rawmsg import ok, refs, sync


@pytest.fixture
def session(mesh1):
    return mesh1._session


# ------------------------------------------------------------------------------------------------ cases
def test_basic_worker(session):
    create_stream(session, ST1, StreamCreationMode.UseDefaultStream)
    r0, r2, r3, r4 = refs(session, 4)
    call(session, ONES, ([2, 3],), [r0])
    call(session, SUB_, (r0, 1), [r2], mutates=[r0])
    call(session, ZEROS, ([2, 3],), [r3])
    call(session, ALLCLOSE, (r0, r3), [r4])
    (reply,) = get_refs(session, (r4, ST1))
    assert ok(reply, WireValue("Bool", True))
    assert ctl_messages(session) == []


def test_error_sends_response(session):
    create_stream(session, ST1)
    (r0,) = refs(session, 1)
    s0 = call(session, FunctionPath("torch.ops.aten.rand.default"), (), [r0])
    sync(session)
    first = ctl_messages(session)[0]
    assert isinstance(first, RemoteFunctionFailed)
    assert first.seq == s0
    assert "aten::rand() is missing value for argument 'size'" in first.error.backtrace


def test_mutated_refs_are_updated_with_error(session):
    create_stream(session, ST1)
    r0, r2 = refs(session, 2)
    session.send(SetRefUnitTestsOnly(r0, WireValue("Int", 1), ST1))
    (before,) = get_refs(session, (r0, ST1))
    assert ok(before, WireValue("Int", 1))
    call(session, MISSING, (), [r2], mutates=[r0])
    after, result = get_refs(session, (r0, ST1), (r2, ST1))
    assert after.present and "failed to resolve function" in after.error
    assert result.present and result.error == after.error
    (message,) = ctl_messages(session)
    assert isinstance(message, RemoteFunctionFailed)


def test_accessing_errored_dependency(session):
    create_stream(session, ST1)
    r0, r1 = refs(session, 2)
    s0 = call(session, MISSING, (), [r0])
    call(session, SUB_, (r0, 1), [r1])
    root, dependent = get_refs(session, (r0, ST1), (r1, ST1))
    messages = ctl_messages(session)
    assert len(messages) == 1
    assert isinstance(messages[0], RemoteFunctionFailed) and messages[0].seq == s0
    # the dependent stores the root's error (the same failure), and was not reported
    assert "failed to resolve function" in root.error
    assert dependent.error == root.error


def test_py_remote_function_calls(session):
    def identity(value):  # local, so cloudpickle sends it by value: workers need not import this test module
        return value

    create_stream(session, ST1)
    r = refs(session, 14)
    udf = Cloudpickle(cloudpickle.dumps(identity))
    call(session, FunctionPath("os.path.split"), ("/fbs/fbc/foo/bar",), [r[0], r[2]])
    call(session, FunctionPath("builtins.sorted"), ([65, 34, 79, 1, 5],), [r[4], None, None, None, None])
    session.send(CreateDeviceMesh(r[5], ["x"], Slice(0, [2], [1])))
    call(session, FunctionPath("dask_monarch.worker.device_mesh.mesh_rank"), (r[5], "x"), [r[6]])
    call(session, udf, (torch.float32,), [r[7]])
    call(session, udf, (torch.strided,), [r[8]])
    call(session, udf, (None,), [r[9]])
    call(session, Cloudpickle(cloudpickle.dumps(lambda: None)), (), [None])  # a None result matches [None]
    call(session, udf, (torch.device("cuda:1"),), [r[10]])
    call(session, udf, (torch.contiguous_format,), [r[11]])
    call(session, ONES, ([2, 3],), [r[12]])
    call(session, FunctionPath("torch.ops.aten.stack.default"), ([r[12], r[12]],), [r[13]])

    replies = get_refs(session, *[(r[i], ST1) for i in (0, 2, 4, 6, 7, 8, 9, 10, 11, 12, 13)])
    got = dict(zip((0, 2, 4, 6, 7, 8, 9, 10, 11, 12, 13), replies))
    assert ok(got[0], WireValue("String", "/fbs/fbc/foo"))
    assert ok(got[2], WireValue("String", "bar"))
    assert ok(got[4], WireValue("Int", 1))
    assert ok(got[6], WireValue("Int", 0))
    assert ok(got[9], WireValue("None"))
    for i in (7, 8, 10, 11, 12, 13):
        assert ok(got[i]), (i, got[i])
    assert ctl_messages(session) == []

    dtype, layout, device, memory_format, stacked = fetch(session, [r[7], r[8], r[10], r[11], r[13]])
    assert dtype is torch.float32
    assert layout is torch.strided
    assert device == torch.device("cuda", 1)
    assert memory_format is torch.contiguous_format
    assert torch.equal(stacked, torch.ones(2, 2, 3))


def test_delete_refs(session):
    create_stream(session, ST1)
    r2, r3, r4 = refs(session, 3)
    session.send(SetRefUnitTestsOnly(r2, WireValue("Bool", False), ST0))
    session.send(SetRefUnitTestsOnly(r3, WireValue("Bool", True), ST0))
    session.send(SetRefUnitTestsOnly(r4, WireValue("Int", 0), ST1))
    before = get_refs(session, (r2, ST0), (r4, ST1))
    assert all(ok(reply) for reply in before)
    session.send(DeleteRefs([r2, r4]))
    kept, gone2, gone4 = get_refs(session, (r3, ST0), (r2, ST0), (r4, ST1))
    assert ok(kept, WireValue("Bool", True))
    assert not gone2.present
    assert not gone4.present
    assert ctl_messages(session) == []


def test_request_status(session):
    create_stream(session, ST1)
    results = refs(session, 100)
    for i, ref in enumerate(results):
        call(session, ONES, ([2, 3],), [ref], stream=(ST0, ST1)[i % 2])
    status_seq = session.new_seq()
    session.send(RequestStatus(status_seq, False))
    sync_seq = sync(session)
    answers = [msg for _, msg in session.answers]
    assert [(type(m), m.seq) for m in answers] == [(Status, status_seq + 1), (Status, sync_seq + 1)]
    assert answers[0].controller is False
    # every call ran before the Status: all 100 results exist on their streams
    replies = get_refs(session, *[(ref, (ST0, ST1)[i % 2]) for i, ref in enumerate(results)])
    assert all(ok(reply) for reply in replies)
