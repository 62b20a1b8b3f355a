"""Borrows as raw worker messages on a CPU worker (spec §4 "Borrow protocol", §9 borrow.rs), through a real
one-rank session on a Dask ``LocalCluster`` worker process. On CPU the borrow's channels order the two stream
threads (host-side synchronization); ``test_gpu.py`` runs the CUDA-event versions."""

from __future__ import annotations

import pytest

import dask_monarch as dm
from dask_monarch.protocol import (
    BorrowCreate,
    BorrowDrop,
    BorrowFirstUse,
    BorrowLastUse,
    Cloudpickle,
    FunctionPath,
    RemoteFunctionFailed,
    StreamCreationMode,
    StreamRef,
    WireValue,
)
from test_bad_input import assert_cluster_serves, fails_fatally, worker_pids  # noqa: F401 (a fixture)
from test_worker_lib import ALLCLOSE, ONES, ST0, SUB_, ZEROS, call, create_stream, ctl_messages, get_refs, ok, refs

import cloudpickle

ST2 = StreamRef(2)
ST3 = StreamRef(3)
SUB_TENSOR_ = FunctionPath("torch.ops.aten.sub_.Tensor")
MISSING_OP = FunctionPath("torch.ops.aten.idont.exist")


def borrow(session, borrow_id, tensor, result, from_stream, to_stream, *, use=True, drop=True):
    """``BorrowCreate``, then (``use``) ``BorrowFirstUse``; with ``drop``, the caller's ops must come first, so
    this only creates and first-uses; ``end_borrow`` sends ``BorrowLastUse`` and ``BorrowDrop``."""
    session.send(BorrowCreate(result, borrow_id, tensor, from_stream, to_stream))
    if use:
        session.send(BorrowFirstUse(borrow_id))


def end_borrow(session, borrow_id):
    session.send(BorrowLastUse(borrow_id))
    session.send(BorrowDrop(borrow_id))


def udf(fn) -> Cloudpickle:
    return Cloudpickle(cloudpickle.dumps(fn))


# ------------------------------------------------------------------------------------------- borrow.rs
def test_borrow_cpu_mutation_is_visible_at_the_origin(mesh1):
    session = mesh1._session
    create_stream(session, ST3)
    r1, r4, r5, r6, r7, r8 = refs(session, 6)
    call(session, ONES, ([2, 3],), [r1], stream=ST0)
    call(session, ONES, ([2, 3],), [r4], stream=ST3)
    borrow(session, 0, r4, r5, ST3, ST0)
    call(session, SUB_TENSOR_, (r5, r1), [r6], mutates=[r5], stream=ST0)
    end_borrow(session, 0)
    call(session, ZEROS, ([2, 3],), [r7], stream=ST3)
    call(session, ALLCLOSE, (r4, r7), [r8], stream=ST3)
    (result, gone) = get_refs(session, (r8, ST3), (r5, ST0))
    assert ok(result, WireValue("Bool", True))  # r4 - 1 == 0: written through the borrow, seen on stream 3
    assert not gone.present  # BorrowLastUse removed the borrowed ref from the borrowing stream
    assert ctl_messages(session) == []


def test_borrow_errored_value_carries_the_error_without_a_second_report(mesh1):
    session = mesh1._session
    create_stream(session, ST2)
    r1, r3, r4, r5 = refs(session, 4)
    s0 = call(session, MISSING_OP, (), [r1], stream=ST0)
    borrow(session, 0, r1, r3, ST0, ST2)
    call(session, SUB_, (r3, 1), [r4], mutates=[r3], stream=ST2)
    call(session, ALLCLOSE, (r4, r4), [r5], stream=ST2)
    end_borrow(session, 0)
    (result,) = get_refs(session, (r5, ST2))
    assert result.present and "failed to resolve function" in result.error
    (message,) = ctl_messages(session)
    assert isinstance(message, RemoteFunctionFailed) and message.seq == s0


def test_same_stream_borrow_does_not_deadlock(mesh1):
    session = mesh1._session
    create_stream(session, ST2)
    r1, r2, r3, r4 = refs(session, 4)
    call(session, ONES, ([3],), [r1], stream=ST2)
    borrow(session, 5, r1, r2, ST2, ST2)
    call(session, SUB_, (r2, 1), [r3], mutates=[r2], stream=ST2)
    end_borrow(session, 5)
    call(session, ZEROS, ([3],), [r4], stream=ST2)
    r5 = session.new_ref()
    call(session, ALLCLOSE, (r1, r4), [r5], stream=ST2)
    (result,) = get_refs(session, (r5, ST2))
    assert ok(result, WireValue("Bool", True))
    assert ctl_messages(session) == []


def test_borrower_waits_for_the_lenders_earlier_work(mesh1):
    """The lender is still busy (a slow in-place fill) when the borrower reaches its first use: the borrower must
    see the filled value, not the tensor as it was before the fill."""

    def slow_fill(t):
        import time

        time.sleep(0.5)
        t.fill_(7.0)

    def equals_seven(t):
        return bool((t == 7.0).all())

    session = mesh1._session
    create_stream(session, ST2)
    r1, r2, r3 = refs(session, 3)
    call(session, ZEROS, ([4],), [r1], stream=ST0)
    call(session, udf(slow_fill), (r1,), [None], mutates=[r1], stream=ST0)
    borrow(session, 1, r1, r2, ST0, ST2)
    call(session, udf(equals_seven), (r2,), [r3], stream=ST2)
    end_borrow(session, 1)
    (result,) = get_refs(session, (r3, ST2))
    assert ok(result, WireValue("Bool", True))
    assert ctl_messages(session) == []


def test_lender_waits_for_the_borrowers_work_before_going_on(mesh1):
    """After ``BorrowDrop`` the lender's next op sees what the (slow) borrower wrote through the borrow."""

    def slow_fill(t):
        import time

        time.sleep(0.5)
        t.fill_(3.0)

    def equals_three(t):
        return bool((t == 3.0).all())

    session = mesh1._session
    create_stream(session, ST2)
    r1, r2, r3 = refs(session, 3)
    call(session, ZEROS, ([4],), [r1], stream=ST0)
    borrow(session, 2, r1, r2, ST0, ST2)
    call(session, udf(slow_fill), (r2,), [None], mutates=[r2], stream=ST2)
    end_borrow(session, 2)
    call(session, udf(equals_three), (r1,), [r3], stream=ST0)
    (result,) = get_refs(session, (r3, ST0))
    assert ok(result, WireValue("Bool", True))


# ------------------------------------------------------------------------------------------------ fatal
@pytest.mark.parametrize(
    "case, text",
    [
        ("unknown_id", "BorrowFirstUse: invalid borrow id: 9"),
        ("last_use_before_first_use", "BorrowLastUse: borrow 0"),
        ("drop_before_last_use", "needs it last_used"),
        ("duplicate_id", "BorrowCreate: duplicate borrow id 0"),
        ("missing_tensor", "ref not found"),
        ("unknown_to_stream", "unknown stream 42"),
        ("use_after_drop", "invalid borrow id: 0"),
    ],
)
def test_bad_borrow_fails_the_session_naming_the_problem(client1, worker_pids, case, text):
    with dm.attach(client1, dims={"workers": 1}, comm_timeout=60) as mesh:
        session = mesh._session
        r1, r2, r3 = refs(session, 3)
        call(session, ONES, ([2],), [r1], stream=ST0)
        messages = {
            "unknown_id": [BorrowFirstUse(9)],
            "last_use_before_first_use": [BorrowCreate(r2, 0, r1, ST0, ST0), BorrowLastUse(0)],
            "drop_before_last_use": [BorrowCreate(r2, 0, r1, ST0, ST0), BorrowFirstUse(0), BorrowDrop(0)],
            "duplicate_id": [BorrowCreate(r2, 0, r1, ST0, ST0), BorrowCreate(r3, 0, r1, ST0, ST0)],
            "missing_tensor": [BorrowCreate(r2, 0, r3, ST0, ST0)],
            "unknown_to_stream": [BorrowCreate(r2, 0, r1, ST0, StreamRef(42))],
            "use_after_drop": [
                BorrowCreate(r2, 0, r1, ST0, ST0), BorrowFirstUse(0), BorrowLastUse(0), BorrowDrop(0),
                BorrowFirstUse(0),
            ],
        }[case]
        error = fails_fatally(mesh, *messages)
        assert text in str(error)
    assert_cluster_serves(client1)


def test_borrow_wait_is_bounded_and_names_the_stream_that_did_not_answer(client1, worker_pids):
    """A lender stuck longer than ``comm_timeout`` fails the session with a message naming it, not a hang."""

    def stuck():
        import time

        time.sleep(4)

    with dm.attach(client1, dims={"workers": 1}, comm_timeout=1) as mesh:
        session = mesh._session
        create_stream(session, ST2, StreamCreationMode.CreateNewStream)
        r1, r2 = refs(session, 2)
        call(session, ONES, ([2],), [r1], stream=ST2)
        call(session, udf(stuck), (), [None], stream=ST2)
        error = fails_fatally(mesh, BorrowCreate(r2, 0, r1, ST2, ST0), BorrowFirstUse(0))
        assert "stream 2 did not lend r" in str(error) and "within 1 s" in str(error)
    assert_cluster_serves(client1)
