"""Spec §7 and the recording cases of §9 (stream.rs, the removed pre-Dec-2025 stream tests) as raw worker messages
on real one- and two-rank sessions: ``DefineRecording`` chunks, the fatal errors of defining mode with Monarch's
texts, formals and results, replays, borrows and reduces inside recordings, and a failure reported once."""

from __future__ import annotations

import pytest
import torch

import dask_monarch as dm
from dask_monarch.protocol import (
    BackendNetworkInit,
    BorrowCreate,
    BorrowDrop,
    BorrowFirstUse,
    BorrowLastUse,
    CallRecording,
    CreateDeviceMesh,
    DefineRecording,
    DeleteRefs,
    GetRefUnitTestsOnly,
    Factory,
    RecordingFormal,
    RecordingResult,
    Reduce,
    Reduction,
    RemoteFunctionFailed,
    RequestStatus,
    SetRefUnitTestsOnly,
    Slice,
    SplitComm,
    WireValue,
)
from rawmsg import (
    ADD,
    ADD_,
    MUL,
    ST0,
    ST1,
    TENSOR,
    call_message,
    create_stream,
    failures,
    fetch,
    get_refs,
    ok,
    refs,
    sync,
)


@pytest.fixture
def session(mesh1):
    create_stream(mesh1._session, ST1)
    return mesh1._session


def define(session, rec, commands, nresults=0, nformals=0, chunk=1000, ranks=None):
    """Send ``commands`` as ``DefineRecording`` chunks of at most ``chunk`` commands."""
    chunks = [commands[i:i + chunk] for i in range(0, len(commands), chunk)] or [[]]
    for index, part in enumerate(chunks):
        session.send(DefineRecording(rec, nresults, nformals, part, len(chunks), index), ranks)


def fatal(session, match: str) -> dm.SessionError:
    """The ``SessionError`` the next wait raises; its text must contain ``match``."""
    with pytest.raises(dm.SessionError, match=match) as info:
        sync(session)
    return info.value


def tensor_ref(session, value, stream=ST1):
    (r,) = refs(session, 1)
    session.send(call_message(session, TENSOR, (value,), [r], stream=stream))
    return r


# -------------------------------------------------------------------------------------- stream.rs: basic call
def test_basic_call_recording(session):
    """f(x, y) = (y, x): formals r1 <- argument 1, r2 <- argument 0, results r1 -> 0, r2 -> 1."""
    rec, r1, r2 = refs(session, 3)
    define(session, rec, [
        RecordingFormal(r1, 1, ST1), RecordingFormal(r2, 0, ST1),
        RecordingResult(r1, 0, ST1), RecordingResult(r2, 1, ST1),
    ], nresults=2, nformals=2)
    r3 = tensor_ref(session, [1, 2, 3])
    r4 = tensor_ref(session, [4, 5])
    r5, r6 = refs(session, 2)
    session.send(CallRecording(session.new_seq(), rec, [r5, r6], [r3, r4]))
    a, b = fetch(session, [r5, r6])
    assert torch.equal(a, torch.tensor([4, 5])) and torch.equal(b, torch.tensor([1, 2, 3]))
    formal1, formal2, actual = get_refs(session, (r1, ST1), (r2, ST1), (r3, ST1))
    assert not formal1.present and not formal2.present  # formals are deleted after the replay
    assert ok(actual)
    assert failures(session) == []


def test_replay_computes_with_captures_and_frees_intermediates(session):
    """w = x * c + c with c captured; replayed three times with different actuals; intermediates freed."""
    c = tensor_ref(session, [10.0, 20.0])
    rec, x, w0, w = refs(session, 4)
    define(session, rec, [
        RecordingFormal(x, 0, ST1),
        call_message(session, MUL, (x, c), [w0], seq=0),
        call_message(session, ADD, (w0, c), [w], seq=1),
        DeleteRefs([w0]),
        RecordingResult(w, 0, ST1),
    ], nresults=1, nformals=1)
    outs = []
    for k in range(3):
        actual = tensor_ref(session, [float(k), 1.0])
        (out,) = refs(session, 1)
        session.send(CallRecording(session.new_seq(), rec, [out], [actual]))
        outs.append(out)
    values = fetch(session, outs)
    for k, v in enumerate(values):
        assert torch.equal(v, torch.tensor([10.0 * k + 10.0, 40.0]))
    gone = get_refs(session, (x, ST1), (w0, ST1), (w, ST1))
    assert not any(reply.present for reply in gone)
    assert failures(session) == []


def test_definition_in_chunks(session):
    """1,001 commands in chunks of 1,000 (spec §7): index 0 then 1; the recording exists after the last."""
    rec, x = refs(session, 2)
    chain = refs(session, 1000)
    commands = [RecordingFormal(x, 0, ST1)]
    prev = x
    for i, r in enumerate(chain):
        commands.append(call_message(session, ADD, (prev, 1), [r], seq=i))
        prev = r
    commands.append(RecordingResult(prev, 0, ST1))
    define(session, rec, commands, nresults=1, nformals=1)
    actual = tensor_ref(session, [0.0])
    (out,) = refs(session, 1)
    session.send(CallRecording(session.new_seq(), rec, [out], [actual]))
    (value,) = fetch(session, [out])
    assert torch.equal(value, torch.tensor([1000.0]))


# ------------------------------------------------------------------------------------------- chunk order
def test_first_chunk_must_have_index_0(session):
    (rec,) = refs(session, 1)
    session.send(DefineRecording(rec, 0, 0, [], 2, 1))
    fatal(session, "index 1 > 0 for a previously unseen recording")


def test_chunks_must_come_in_order(session):
    (rec,) = refs(session, 1)
    session.send(DefineRecording(rec, 0, 0, [], 3, 0))
    session.send(DefineRecording(rec, 0, 0, [], 3, 2))
    fatal(session, "got index 2, but the last index seen for it is 0")


def test_define_recording_already_defined(session):
    (rec,) = refs(session, 1)
    define(session, rec, [])
    define(session, rec, [])
    fatal(session, "already defined")


def test_define_recording_other_recording_active(session):
    rec0, rec1 = refs(session, 2)
    session.send(DefineRecording(rec0, 0, 0, [], 2, 0))
    session.send(DefineRecording(rec1, 0, 0, [], 1, 0))
    fatal(session, "different recording already active")


def test_call_recording_other_recording_active(session):
    rec0, rec1 = refs(session, 2)
    define(session, rec1, [])
    session.send(DefineRecording(rec0, 0, 0, [], 2, 0))
    session.send(CallRecording(session.new_seq(), rec1, [], []))
    fatal(session, "cannot call recording while another recording is active")


def test_call_recording_not_found(session):
    (rec,) = refs(session, 1)
    session.send(CallRecording(session.new_seq(), rec, [], []))
    fatal(session, "not found")


# ------------------------------------------------------------------------------------ defining-mode errors
def test_recording_formal_outside_recording(session):
    (r,) = refs(session, 1)
    session.send(RecordingFormal(r, 0, ST1))
    fatal(session, "recording_formal called outside of recording")


def test_recording_result_outside_recording(session):
    (r,) = refs(session, 1)
    session.send(RecordingResult(r, 0, ST1))
    fatal(session, "recording_result called outside of recording")


def test_request_status_in_recording(session):
    (rec,) = refs(session, 1)
    define(session, rec, [RequestStatus(session.new_seq(), False)])
    fatal(session, "request_status not allowed in recording")


def test_init_comm_in_recording(session):
    (rec,) = refs(session, 1)
    define(session, rec, [BackendNetworkInit("x")])
    fatal(session, "init_comm not allowed in recording")


def test_borrow_create_duplicate_borrow(session):
    rec, t, b1, b2 = refs(session, 4)
    session.send(SetRefUnitTestsOnly(t, WireValue("Int", 1), ST0))
    define(session, rec, [BorrowCreate(b1, 7, t, ST0, ST1), BorrowCreate(b2, 7, t, ST0, ST1)])
    fatal(session, "duplicate borrow create in recording")


def test_borrow_drop_borrow_not_defined(session):
    (rec,) = refs(session, 1)
    define(session, rec, [BorrowDrop(7)])
    fatal(session, "borrow drop for borrow not defined in recording")


def test_borrow_not_dropped_before_finalize(session):
    rec, t, b = refs(session, 3)
    define(session, rec, [BorrowCreate(b, 7, t, ST0, ST1), BorrowFirstUse(7)])
    fatal(session, "all borrows created within recording must be dropped within recording")


def test_recording_formal_too_few_arguments(session):
    rec, r1 = refs(session, 2)
    define(session, rec, [RecordingFormal(r1, 0, ST1)], nformals=1)
    session.send(CallRecording(session.new_seq(), rec, [], []))
    fatal(session, "recording_formal called with too few arguments")


def test_recording_result_too_few_results(session):
    rec, r1 = refs(session, 2)
    r0 = tensor_ref(session, [1])
    define(session, rec, [RecordingFormal(r1, 0, ST1), RecordingResult(r1, 0, ST1)], nresults=1, nformals=1)
    session.send(CallRecording(session.new_seq(), rec, [], [r0]))
    fatal(session, "recording_result called with too few results")


def test_fatal_error_leaves_other_sessions_working(session, client1):
    """A recording error fails its session only; a new session on the same worker works."""
    (rec,) = refs(session, 1)
    session.send(CallRecording(session.new_seq(), rec, [], []))
    fatal(session, "not found")
    with dm.attach(client1, dims={"w": 1}) as mesh, mesh.activate():
        assert dm.inspect(torch.ones(2) + 1).tolist() == [2.0, 2.0]


# --------------------------------------------------------------------------------- errors inside a replay
def _failing_recording(session):
    """call_function_in_recording: w = x + y; z.add_(1) (captured, mutated); return w + z. Returns the refs."""
    rec, x, y, w, z1, out = refs(session, 6)
    z = tensor_ref(session, [1.0, 1.0])
    define(session, rec, [
        RecordingFormal(x, 0, ST1), RecordingFormal(y, 1, ST1),
        call_message(session, ADD, (x, y), [w], seq=0),
        call_message(session, ADD_, (z, 1), [None], mutates=[z], seq=1),
        call_message(session, ADD, (w, z), [out], seq=2),
        RecordingResult(out, 0, ST1),
    ], nresults=1, nformals=2)
    return rec, z


def test_call_function_in_recording_failure_reported_once(session):
    rec, z = _failing_recording(session)
    x = tensor_ref(session, [1.0, 2.0])
    y = tensor_ref(session, [1.0, 2.0, 3.0])  # shapes do not broadcast: operation 0 fails
    (result,) = refs(session, 1)
    seq = session.new_seq()
    session.send(CallRecording(seq, rec, [result], [x, y]))
    sync(session)
    (report,) = failures(session)
    assert isinstance(report, RemoteFunctionFailed) and report.seq == seq
    assert report.controller_frame_index == 0
    assert "recording" in report.error.backtrace and "operation 0" in report.error.backtrace
    assert "torch.ops.aten.add.Tensor" in report.error.backtrace
    res, zz, xx, yy = get_refs(session, (result, ST1), (z, ST1), (x, ST1), (y, ST1))
    assert res.present and res.error and "must match the size" in res.error
    assert zz.error == res.error  # the mutated capture carries the error
    assert ok(xx) and ok(yy)  # unmutated inputs stay valid

    # a later call with the errored capture: dependent errors, no report
    x2 = tensor_ref(session, [1.0, 2.0])
    y2 = tensor_ref(session, [3.0, 4.0])
    (result2,) = refs(session, 1)
    session.send(CallRecording(session.new_seq(), rec, [result2], [x2, y2]))
    (res2,) = get_refs(session, (result2, ST1))
    assert res2.error == res.error
    assert len(failures(session)) == 1


def test_replay_after_success_mutates_capture(session):
    rec, z = _failing_recording(session)
    outs = []
    for _ in range(2):
        x = tensor_ref(session, [1.0, 2.0])
        y = tensor_ref(session, [10.0, 20.0])
        (out,) = refs(session, 1)
        session.send(CallRecording(session.new_seq(), rec, [out], [x, y]))
        outs.append(out)
    first, second, zv = fetch(session, outs + [z])
    assert torch.equal(first, torch.tensor([13.0, 24.0]))  # z became 2 before the add
    assert torch.equal(second, torch.tensor([14.0, 25.0]))  # and 3 in the second replay
    assert torch.equal(zv, torch.tensor([3.0, 3.0]))
    assert failures(session) == []


# ---------------------------------------------------------------------------------------- borrow_in_recording
def test_borrow_in_recording(session):
    """x lent by stream 0 to stream 1 inside the recording; stream 1 computes xb + c (c captured there)."""
    rec, x, xb, out = refs(session, 4)
    c = tensor_ref(session, [4.0, 5.0, 6.0])
    define(session, rec, [
        RecordingFormal(x, 0, ST0),
        BorrowCreate(xb, 3, x, ST0, ST1),
        BorrowFirstUse(3),
        call_message(session, ADD, (xb, c), [out], seq=0),
        BorrowLastUse(3),
        BorrowDrop(3),
        RecordingResult(out, 0, ST1),
    ], nresults=1, nformals=1)
    values = []
    for k in range(2):
        actual = tensor_ref(session, [1.0, 2.0, 3.0], stream=ST0)
        (result,) = refs(session, 1)
        session.send(CallRecording(session.new_seq(), rec, [result], [actual]))
        values.append(result)
    a, b = fetch(session, values)
    assert a.tolist() == [5.0, 7.0, 9.0] and b.tolist() == [5.0, 7.0, 9.0]
    assert failures(session) == []

    # a failure on the borrower: reported once ("recording ... failed"), by the borrower's stream
    bad = tensor_ref(session, [1.0, 2.0], stream=ST0)
    (result,) = refs(session, 1)
    seq = session.new_seq()
    session.send(CallRecording(seq, rec, [result], [bad]))
    (res,) = get_refs(session, (result, ST1))
    (report,) = failures(session)
    assert report.seq == seq and "failed at operation 0" in report.error.backtrace
    assert res.error and "recording" in res.error

    # an errored input: a dependent error, no report
    (broken,) = refs(session, 1)
    session.send(call_message(session, MUL, (bad, c), [broken], stream=ST0))  # fails: wrong stream for c
    sync(session)
    reports = len(failures(session))
    (result2,) = refs(session, 1)
    session.send(CallRecording(session.new_seq(), rec, [result2], [broken]))
    (res2,) = get_refs(session, (result2, ST1))
    assert res2.error and "ref not found" in res2.error
    assert len(failures(session)) == reports


# ---------------------------------------------------------------------------------------- reduce_in_recording
def _get_ref(session, rank, ref, stream=ST0):
    session.send(GetRefUnitTestsOnly(ref, stream), [rank])
    sync(session)
    replies = [msg for r, msg in session.get_ref_results if r == rank and msg.ref == ref]
    session.get_ref_results.clear()
    (reply,) = replies
    return reply


def test_reduce_in_recording(client2):
    """Two ranks (gloo): an in-place reduce of formal 0, then a reduce of formal 1 into formal 2 (``out``). A rank
    whose input 0 is errored takes part with zeros; there input 0, input 2 and the result carry the same error,
    input 1 is untouched, and nothing is reported for the dependent error."""
    mesh = dm.attach(client2, dims={"x": 2}, comm_timeout=60, record_answers=True)
    try:
        session = mesh._session
        mesh_ref, rec, a, b, o, s1, s2 = refs(session, 7)
        session.send(CreateDeviceMesh(mesh_ref, ["x"], Slice(0, [2], [1])))
        session.send(BackendNetworkInit(f"{session.id}/net"))
        session.send(SplitComm(["x"], mesh_ref, ST0))
        factory = Factory((2,), torch.float32)
        define(session, rec, [
            RecordingFormal(a, 0, ST0), RecordingFormal(b, 1, ST0), RecordingFormal(o, 2, ST0),
            Reduce(s1, a, factory, mesh_ref, ST0, ["x"], Reduction.Sum, False, True, None, 0),
            Reduce(s2, b, factory, mesh_ref, ST0, ["x"], Reduction.Sum, False, False, o, 1),
            RecordingResult(s2, 0, ST0),
        ], nresults=1, nformals=3)
        ia, ib, io = (tensor_ref(session, v, ST0) for v in ([1.0, 2.0], [10.0, 20.0], [0.0, 0.0]))
        (res,) = refs(session, 1)
        session.send(CallRecording(session.new_seq(), rec, [res], [ia, ib, io]))
        out, reduced, buffer = fetch(session, [res, ia, io], stream=ST0)
        assert out.tolist() == [20.0, 40.0] and reduced.tolist() == [2.0, 4.0] and buffer.tolist() == [20.0, 40.0]
        assert failures(session) == []

        # input 0 errored on rank 1 only (its producer failed there)
        ib, io = (tensor_ref(session, v, ST0) for v in ([10.0, 20.0], [0.0, 0.0]))
        (ea,) = refs(session, 1)
        session.send(call_message(session, TENSOR, ([1.0, 2.0],), [ea], stream=ST0), [0])
        session.send(call_message(session, TENSOR, ("not a list of numbers",), [ea], stream=ST0), [1])
        sync(session)
        reports = failures(session)
        assert len(reports) == 1  # the eager failure on rank 1
        (res,) = refs(session, 1)
        session.send(CallRecording(session.new_seq(), rec, [res], [ea, ib, io]))
        (value,) = fetch(session, [res], stream=ST0, rank=0)
        assert value.tolist() == [20.0, 40.0]
        assert fetch(session, [ea], stream=ST0, rank=0)[0].tolist() == [1.0, 2.0]  # + rank 1's zeros
        assert len(failures(session)) == 1  # none new
        e_input0, e_input2, e_result = (_get_ref(session, 1, r) for r in (ea, io, res))
        assert e_input0.error and e_input0.error == e_input2.error == e_result.error
        assert ok(_get_ref(session, 1, ib), None)
        with pytest.raises(dm.RemoteException, match="invalid data type"):  # the eager failure, never fetched
            mesh.exit()
    finally:
        if not session.closed:
            mesh.exit()


def test_delete_refs_during_a_definition(session):
    """A DeleteRefs among a recording's commands is appended to the streams already in the recording, and runs
    on the others when the definition completes (the commands are taken then; spec §7 note); one sent between
    two chunks runs at once everywhere."""
    rec, x, y, gone0, gone1, between = refs(session, 6)
    session.send(SetRefUnitTestsOnly(gone0, WireValue("Int", 1), ST0))  # stream 0 is not in the recording
    session.send(SetRefUnitTestsOnly(between, WireValue("Int", 2), ST1))
    session.send(DefineRecording(rec, 1, 1, [
        RecordingFormal(x, 0, ST1),
        call_message(session, ADD, (x, 1), [y], seq=0),
        DeleteRefs([gone0, x]),  # x is the recording's formal: freed inside each replay
    ], 2, 0))
    (before,) = get_refs(session, (gone0, ST0))
    assert before.present  # the commands wait for the last chunk
    session.send(DeleteRefs([between]))  # between the chunks: an ordinary DeleteRefs
    (mid,) = get_refs(session, (between, ST1))
    assert not mid.present
    session.send(DefineRecording(rec, 1, 1, [RecordingResult(y, 0, ST1)], 2, 1))
    (after,) = get_refs(session, (gone0, ST0))
    assert not after.present  # ran on stream 0, outside the recording, once the definition was complete
    actual = tensor_ref(session, [1.0])
    (out,) = refs(session, 1)
    session.send(CallRecording(session.new_seq(), rec, [out], [actual]))
    (value,) = fetch(session, [out])
    assert value.tolist() == [2.0]
    assert failures(session) == []


def test_cuda_graph_recording_replays_plainly_on_cpu(session):
    rec, x, y = refs(session, 3)
    session.send(DefineRecording(rec, 1, 1, [
        RecordingFormal(x, 0, ST1), call_message(session, ADD, (x, x), [y], seq=0), RecordingResult(y, 0, ST1),
    ], 1, 0, True))
    outs = []
    for k in range(3):
        actual = tensor_ref(session, [float(k)])
        (out,) = refs(session, 1)
        session.send(CallRecording(session.new_seq(), rec, [out], [actual]))
        outs.append(out)
    assert [v.tolist() for v in fetch(session, outs)] == [[0.0], [2.0], [4.0]]


def test_missing_capture_is_a_value_error_of_the_call(session):
    """A captured ref that no longer exists fails the call (reported once, "ref not found"), not the session."""
    rec, x, y = refs(session, 3)
    c = tensor_ref(session, [5.0])
    define(session, rec, [RecordingFormal(x, 0, ST1), call_message(session, ADD, (x, c), [y], seq=0),
                          RecordingResult(y, 0, ST1)], nresults=1, nformals=1)
    session.send(DeleteRefs([c]))
    actual = tensor_ref(session, [1.0])
    (out,) = refs(session, 1)
    seq = session.new_seq()
    session.send(CallRecording(seq, rec, [out], [actual]))
    (res,) = get_refs(session, (out, ST1))
    assert res.error and f"ref not found: r{c.id}" in res.error
    (report,) = failures(session)
    assert report.seq == seq
    assert fetch(session, [actual])[0].tolist() == [1.0]  # the session lives on


def test_failure_inside_a_run_of_fast_steps_names_its_operation(session):
    """Consecutive simple ops replay as one compiled block (worker/blocks.py): a failure in the middle is reported
    for that operation, the ops after it are skipped, and the next replay with good inputs works."""
    rec, x, a, b, c = refs(session, 5)
    y = tensor_ref(session, [1.0, 2.0])
    define(session, rec, [
        RecordingFormal(x, 0, ST1),
        call_message(session, ADD, (x, x), [a], seq=0),
        call_message(session, MUL, (a, y), [b], seq=1),
        DeleteRefs([a]),
        call_message(session, ADD, (b, 1), [c], seq=2),
        RecordingResult(c, 0, ST1),
    ], nresults=1, nformals=1)
    bad = tensor_ref(session, [1.0, 2.0, 3.0])
    (out,) = refs(session, 1)
    session.send(CallRecording(session.new_seq(), rec, [out], [bad]))
    (res,) = get_refs(session, (out, ST1))
    (report,) = failures(session)
    assert report.controller_frame_index == 1
    assert "operation 1 (<function \"torch.ops.aten.mul.Tensor\">)" in report.error.backtrace
    assert "must match the size" in res.error
    good = tensor_ref(session, [1.0, 1.0])
    (out2,) = refs(session, 1)
    session.send(CallRecording(session.new_seq(), rec, [out2], [good]))
    assert fetch(session, [out2])[0].tolist() == [3.0, 5.0]
    leftovers = get_refs(session, (a, ST1), (b, ST1), (c, ST1), (x, ST1))
    assert not any(reply.present for reply in leftovers)
