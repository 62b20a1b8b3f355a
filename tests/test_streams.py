"""Streams and borrows through the controller API on a 2x2 mesh of CPU workers (spec §1 "Streams and borrows",
§4; §9 test_controller errors/mutate, test_remote_functions streams_run_parallel)."""

from __future__ import annotations

import gc
import uuid
import warnings

import pytest
import torch

import dask_monarch as dm
from dask_monarch.protocol import BorrowCreate, BorrowDrop, BorrowFirstUse, BorrowLastUse, CallFunction, CreateStream

TIMEOUT = 60


@pytest.fixture
def sends(mesh2x2, monkeypatch) -> list:
    """Every ``(targets, message)`` the session of ``mesh2x2`` is asked to send from now on."""
    session = mesh2x2._session
    log = []
    send = session.send

    def recording(message, ranks=None):
        log.append((session._all if ranks is None else tuple(ranks), message))
        return send(message, ranks)

    monkeypatch.setattr(session, "send", recording)
    return log


def of(log, kind) -> list:
    """The messages of type ``kind`` in ``log``, in order."""
    return [m for _, m in log if isinstance(m, kind)]


def values(t) -> list:
    """Rank 0's value of remote ``t`` as a list (compared as plain Python: under ``mesh.activate()`` a
    ``torch.tensor`` literal would be remote)."""
    return dm.inspect(t).tolist()


def wait_at_barrier(key: str):
    """Runs on a worker: both calls (one per stream) must be inside at the same time, or the barrier breaks."""
    import sys
    import threading

    barrier = sys.modules["threading"].__dict__.setdefault(key, threading.Barrier(2, timeout=30))
    barrier.wait()
    return torch.ones(1)


# ------------------------------------------------------------------------------------------------ streams
def test_streams_run_parallel(mesh2x2):
    side = dm.Stream("side")
    key = f"dask_monarch_test_barrier_{uuid.uuid4().hex}"
    barrier_op = dm.remote(wait_at_barrier, propagate=lambda key: torch.empty(1))
    with mesh2x2.activate():
        on_main = barrier_op(key)
        with side.activate():
            on_side = barrier_op(key)
            side_value = dm.inspect(on_side)
        main_value = dm.inspect(on_main)
    assert main_value.tolist() == side_value.tolist() == [1.0]


def test_first_use_of_a_stream_creates_it_on_every_rank_once(mesh2x2, sends):
    side = dm.Stream("side")
    with mesh2x2.slice(host=0).activate(), side.activate():  # on a sub-mesh: still created on every rank
        torch.ones(2)
        torch.zeros(2)
    (create,) = of(sends, CreateStream)
    calls = of(sends, CallFunction)
    assert create.id.id != 0 and [c.stream for c in calls] == [create.id, create.id]
    assert [targets for targets, m in sends if m is create] == [mesh2x2._session._all]


def test_tensor_used_on_another_stream_is_wrong_stream(mesh2x2):
    side = dm.Stream("side")
    with mesh2x2.activate():
        x = torch.ones(3)
        with side.activate():
            with pytest.raises(TypeError, match="WRONG_STREAM: tensor r.* is on Stream\\('main'"):
                torch.add(x, 1)
            y = torch.ones(3)
        with pytest.raises(TypeError, match="WRONG_STREAM"):
            torch.mul(y, 2)
        with pytest.raises(TypeError, match="WRONG_STREAM"):
            _reduce_on(side, x)


def _reduce_on(stream, t):
    with stream.activate():
        return t.reduce("gpu")


def test_reduce_on_a_side_stream_uses_that_streams_comm(mesh2x2):
    side = dm.Stream("side")
    with mesh2x2.activate(), side.activate():
        x = torch.full((2,), 3.0)
        total = x.reduce("gpu")
    assert total.stream is side
    assert values(total) == [6.0, 6.0]


# ------------------------------------------------------------------------------------------------ borrows
def test_read_borrow_values_and_messages(mesh2x2, sends):
    side = dm.Stream("side")
    with mesh2x2.activate():
        x = torch.arange(4.0)
        xs, borrow = side.borrow(x)
        (create,) = of(sends, BorrowCreate)
        assert (create.tensor, create.result, create.from_stream.id, create.borrow) == (
            x.ref, xs.ref, 0, borrow.id
        )
        assert of(sends, BorrowFirstUse) == []  # not before the first use
        with side.activate():
            doubled = xs * 2
            again = xs + 1
        assert [m.borrow for m in of(sends, BorrowFirstUse)] == [borrow.id]  # once
        assert xs.stream is side and doubled.stream is side
        assert values(doubled) == [0.0, 2.0, 4.0, 6.0]  # fetched on the borrowed tensor's stream
        assert values(x + 0) == [0.0, 1.0, 2.0, 3.0]  # the origin stays readable
        borrow.drop()
        assert [type(m) for m in of(sends, (BorrowLastUse, BorrowDrop))] == [BorrowLastUse, BorrowDrop]
        assert values(again) == [1.0, 2.0, 3.0, 4.0]
        with pytest.raises(TypeError, match="DROPPED"):
            with side.activate():
                torch.neg(xs)


def test_mutate(mesh2x2):
    """test_controller ``mutate``: a live read borrow forbids writing the origin; after the drop it is allowed; a
    mutable borrow may be written."""
    side = dm.Stream("side")
    with mesh2x2.activate():
        x = torch.full((3,), -2.0)
        xs, borrow = side.borrow(x)
        with pytest.raises(TypeError, match="would be mutated"):
            x.abs_()
        with side.activate(), pytest.raises(TypeError, match="MUTATING_BORROW.*borrowed read-only"):
            xs.abs_()
        borrow.drop()
        x.abs_()
        assert values(x) == [2.0, 2.0, 2.0]
        xm, mutable = side.borrow(x, mutable=True)
        with side.activate():
            xm.abs_()
            xm.add_(1)
        mutable.drop()
        assert values(x) == [3.0, 3.0, 3.0]  # the writes are visible at the origin


def test_origin_of_a_mutable_borrow_cannot_be_used(mesh2x2):
    side = dm.Stream("side")
    with mesh2x2.activate():
        x = torch.ones(2)
        view = x[0:1]
        xm, borrow = side.borrow(x, mutable=True)
        with pytest.raises(TypeError, match="BORROWED: tensor .* is mutably borrowed"):
            torch.add(x, 1)
        with pytest.raises(TypeError, match="BORROWED"):
            torch.add(view, 1)  # an alias of the origin is the origin
        with pytest.raises(TypeError, match="BORROWED"):
            dm.fetch_shard(x)
        with borrow:  # leaving the block drops it
            pass
        assert values(torch.add(x, 1)) == [2.0, 2.0]


def test_mutable_borrow_of_a_borrowed_tensor_is_a_runtime_error(mesh2x2):
    side, other = dm.Stream("side"), dm.Stream("other")
    with mesh2x2.activate():
        x = torch.ones(2)
        _, read = side.borrow(x)
        with pytest.raises(RuntimeError, match="already borrowed"):
            other.borrow(x, mutable=True)
        _, read_again = other.borrow(x)  # two read borrows are fine
        read.drop()
        read_again.drop()
        _, mutable = other.borrow(x, mutable=True)
        mutable.drop()


def test_borrow_of_a_failed_tensor_carries_the_error(mesh2x2):
    def fail():
        raise ValueError("no tensor for you")

    side = dm.Stream("side")
    with mesh2x2.activate():
        bad = dm.remote(fail, propagate=lambda: torch.empty(2))()
        bs, borrow = side.borrow(bad)
        with side.activate():
            dependent = bs + 1
        with pytest.raises(dm.RemoteException, match="no tensor for you"):
            dm.inspect(dependent)
        borrow.drop()


def test_failure_through_a_mutable_borrow_reaches_the_origin(mesh2x2):
    def fail_in_place(t):
        raise ValueError("write failed")

    side = dm.Stream("side")
    with mesh2x2.activate():
        x = torch.ones(2)
        xm, borrow = side.borrow(x, mutable=True)
        with side.activate():
            dm.remote(fail_in_place, propagate=lambda t: (t.add_(0), None)[1])(xm)
        borrow.drop()
        with pytest.raises(dm.RemoteException, match="write failed"):
            dm.inspect(x)


def test_undropped_borrow_warns_and_drops_itself(mesh2x2, sends):
    side = dm.Stream("side")
    with mesh2x2.activate():
        x = torch.ones(2)
        _, borrow = side.borrow(x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del borrow, _
            gc.collect()
        # a category Python's default filters show (spec §1: "an undropped borrow warns")
        assert any("was not dropped" in str(w.message) and issubclass(w.category, UserWarning) for w in caught)
        x.abs_()  # no borrow is live any more: the collected one was dropped before this op was sent
        kinds = [type(m).__name__ for _, m in sends]
        assert kinds[-4:] == ["BorrowFirstUse", "BorrowLastUse", "BorrowDrop", "CallFunction"]
        assert values(x) == [1.0, 1.0]


def test_borrow_rejects_a_local_tensor():
    with pytest.raises(TypeError, match="remote dask_monarch.Tensor"):
        dm.Stream("side").borrow(torch.ones(2))
    with pytest.raises(TypeError, match="non-empty str"):
        dm.Stream("")


def test_borrow_of_a_borrowed_tensor_not_used_yet(mesh2x2):
    """Borrowing a borrowed tensor is a use of it on its stream: its ``BorrowFirstUse`` goes out before the
    nested ``BorrowCreate``, so the lender finds it there (instead of failing the session "ref not found")."""
    side, other = dm.Stream("side"), dm.Stream("other")
    with mesh2x2.activate():
        x = torch.arange(3.0)
        xs, outer = side.borrow(x)
        xo, inner = other.borrow(xs)  # xs not used on side yet
        with other.activate():
            assert values(xo + 1) == [1.0, 2.0, 3.0]
        inner.drop()
        outer.drop()
        assert values(x * 2) == [0.0, 2.0, 4.0]


def test_nested_borrows_keep_the_permissions(mesh2x2):
    """A read-only borrowed tensor cannot be lent on mutably (that would write the origin, which is read-borrowed);
    a mutably lent-on borrowed tensor cannot be used on its own stream until the nested borrow is dropped."""
    side, other = dm.Stream("side"), dm.Stream("other")
    with mesh2x2.activate():
        x = torch.ones(2)
        xs, outer = side.borrow(x)
        with pytest.raises(TypeError, match="MUTATING_BORROW: tensor .* borrowed read-only"):
            other.borrow(xs, mutable=True)
        outer.drop()
        xm, outer = side.borrow(x, mutable=True)
        xo, inner = other.borrow(xm, mutable=True)
        with side.activate(), pytest.raises(TypeError, match="BORROWED: tensor .* is mutably borrowed"):
            torch.add(xm, 1)
        with other.activate():
            xo.add_(1)
        inner.drop()
        with side.activate():
            xm.add_(1)
        outer.drop()
        assert values(x) == [3.0, 3.0]


@pytest.mark.parametrize("dropped", ["borrowed", "view"])
def test_dropping_the_borrowed_tensor_ends_the_borrow(mesh2x2, dropped):
    """``xs.drop()`` (or a view's) frees every alias of the borrowed tensor: that is its last use, so the borrow
    ends there; before, its ``DeleteRefs`` overtook ``BorrowLastUse`` and failed the session ("ref not found")."""
    side = dm.Stream("side")
    with mesh2x2.activate():
        x = torch.ones(4)
        xs, borrow = side.borrow(x)
        with side.activate():
            view = xs[0:2]
            assert values(view + 1) == [2.0, 2.0]
        (xs if dropped == "borrowed" else view).drop()
        assert borrow.dropped
        with side.activate(), pytest.raises(TypeError, match="DROPPED"):
            torch.neg(xs)
        x.add_(1)  # writable again: no borrow is live
        assert values(x) == [2.0, 2.0, 2.0, 2.0]
        borrow.drop()  # a no-op now
        assert values(x) == [2.0, 2.0, 2.0, 2.0]


def test_python_operators_raise_the_client_checks(mesh2x2):
    """torch turns a ``TypeError`` inside ``+``, ``+=``, ``==``, ... into ``NotImplemented``: the client checks must
    still reach the user. ``x += 1`` on a read-borrowed tensor used to rebind ``x`` to a new tensor silently."""
    side = dm.Stream("side")
    with mesh2x2.activate():
        x = torch.ones(2)
        xs, borrow = side.borrow(x)
        before = x
        with pytest.raises(TypeError, match="MUTATING_BORROW"):
            x += 1
        assert x is before
        with pytest.raises(TypeError, match="WRONG_STREAM"):
            xs * 2
        with pytest.raises(TypeError, match="WRONG_STREAM"):
            2 - xs
        borrow.drop()
        with side.activate(), pytest.raises(TypeError, match="DROPPED"):
            xs + 1
        with pytest.raises(TypeError, match="unsupported operand"):
            x + "text"  # not a client check: Python's own error, as before
        assert values(x == 1) == [True, True] and len({x, xs}) == 2  # still hashable


def test_borrow_rejects_a_mutable_that_is_not_a_bool(mesh2x2):
    """``mutable="no"`` used to give a mutable borrow (``bool("no")``)."""
    with mesh2x2.activate():
        x = torch.ones(2)
        for bad in ("no", None, 1):
            with pytest.raises(TypeError, match=f"mutable must be a bool, got {bad!r}"):
                dm.Stream("side").borrow(x, mutable=bad)
        x.add_(1)  # no borrow was made
        assert values(x) == [2.0, 2.0]


def _fetch_in_another_thread(t) -> list:
    """``inspect(t)`` from another thread (outside the caller's coalescing block): it flushes the session."""
    import threading

    got = []
    thread = threading.Thread(target=lambda: got.append(values(t)))
    thread.start()
    thread.join(TIMEOUT)
    return got


@pytest.mark.parametrize("dropped", ["borrow", "tensor"])
def test_drop_inside_coalescing_is_sent_after_the_block(mesh2x2, dropped):
    """A drop inside ``coalescing()`` frees the refs after the block's held messages, which may still use them,
    even when the session flushes meanwhile (another thread fetches): before, the ``DeleteRefs`` went out first
    and ``BorrowLastUse`` (or the op using the tensor) failed the session with "ref not found"."""
    side = dm.Stream("side")
    with mesh2x2.activate():
        x = torch.ones(2)
        xs, borrow = side.borrow(x)
        with side.activate():
            xs + 0  # the borrowed tensor is on the side stream now
        other = torch.zeros(1)
        if dropped == "tensor":
            borrow.drop()
        with dm.coalescing():
            if dropped == "borrow":
                borrow.drop()
            y = x * 3
            if dropped == "tensor":
                x.drop()
            assert _fetch_in_another_thread(other) == [[0.0]]
        assert values(y) == [3.0, 3.0]


def test_dropping_a_borrow_drops_the_borrows_of_its_tensor_first(mesh2x2):
    """The borrowed tensor lent on (a nested borrow) shares the origin's memory: dropping the outer borrow ends the
    nested one first, so the origin is never writable while another stream still uses its memory."""
    side, other = dm.Stream("side"), dm.Stream("other")
    with mesh2x2.activate():
        x = torch.ones(2)
        xs, outer = side.borrow(x)
        xo, inner = other.borrow(xs)
        outer.drop()
        assert inner.dropped
        with other.activate(), pytest.raises(TypeError, match="DROPPED"):
            torch.neg(xo)
        x.add_(1)
        assert values(x) == [2.0, 2.0]


def test_backend_network_init_gives_every_existing_stream_a_communicator(mesh2x2):
    """spec §5: after the world communicator, one communicator over all ranks per existing stream, in ascending
    stream order, handed to the streams (kept, as in Monarch; ``Reduce`` uses the ``SplitComm`` ones)."""
    side = dm.Stream("side")
    with mesh2x2.activate():
        with side.activate():
            torch.ones(1)  # the side stream exists before the first reduce
        total = torch.ones(2).reduce("gpu")
    assert values(total) == [2.0, 2.0]
    session_id = mesh2x2._session.id

    def comm_sizes(dask_worker):
        streams = dask_worker.plugins["dask-monarch"].sessions[session_id].streams
        return {sid: stream.comm.size() for sid, stream in streams.items()}

    sizes = mesh2x2._session.client.run(comm_sizes)
    assert sorted(map(str, sizes.values())) == ["{0: 4, 1: 4}"] * 4
