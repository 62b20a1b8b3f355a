"""``to_mesh`` / ``slice_mesh`` and the ``SendTensor`` message on a 2x2 mesh (host x gpu) of four CPU workers,
through gloo (spec §1 "to_mesh", §5 ``SendTensor``; §9: comm.rs send_tensor and send_tensor_local, and
test_controller's broadcast_one, broadcast_two, to_mesh_cow, to_mesh_pytree, slice_mesh_pytree, movement,
to_mesh_aliasing, to_mesh_stream; DESIGN.md "Decisions": a rank may send and receive across two streams)."""

from __future__ import annotations

import pytest
import torch

import dask_monarch as dm
from dask_monarch.protocol import (
    ArgsKwargs,
    BackendNetworkPointToPointInit,
    CallFunction,
    Factory,
    GetRefUnitTestsOnly,
    SendTensor,
    SendValue,
    Slice,
)
from rawmsg import FULL, MISSING, ST0, sync

TIMEOUT = 60


def fetch(t, **coords):
    return dm.fetch_shard(t, **coords).result(timeout=TIMEOUT)


def per_rank(h, g):
    """Rank (h, g)'s tensor: 10h + g + [0, 0.1, 0.2]."""
    return 10.0 * h + g + torch.tensor([0.0, 0.1, 0.2])


def make_per_rank(h, g):
    return 10.0 * h + g + torch.tensor([0.0, 0.1, 0.2])


@pytest.fixture
def x(mesh2x2):
    return dm.remote(make_per_rank)(mesh2x2.rank("host"), mesh2x2.rank("gpu"))


# ------------------------------------------------------------------------------------------ raw messages
def _fetch_raw(session, ref, rank):
    seq = session.new_seq()
    session.send(SendValue(seq, None, [], None, ArgsKwargs((ref,), {}), ST0), [rank])
    sync(session)
    return session.take_fetch_result(seq)


def test_send_tensor_raw_messages(mesh2x2):
    """comm.rs send_tensor: rank 0 holds full(2.0) in r1; a SendTensor from [0] to [1] into r2 gives rank 1 the
    same tensor; the sender-only rank does not define r2."""
    session = mesh2x2._session
    r1, r2 = session.new_ref(), session.new_ref()
    session.send(CallFunction(session.new_seq(), [r1], [], FULL, ArgsKwargs(([2, 2], 2.0), {}), ST0, []), [0])
    session.send(BackendNetworkPointToPointInit(ST0, ST0))
    factory = Factory((2, 2), torch.float32)
    session.send(SendTensor(r2, Slice(0, [1], [1]), Slice(1, [1], [1]), r1, factory, ST0, ST0), [0, 1])
    got = _fetch_raw(session, r2, 1)
    assert got.error is None and torch.equal(got.value, torch.full((2, 2), 2.0))
    session.send(GetRefUnitTestsOnly(r2, ST0), [0])
    sync(session)
    (rank, reply), = session.get_ref_results
    assert rank == 0 and not reply.present


def test_send_tensor_local_copies_into_the_result(mesh2x2):
    """comm.rs send_tensor_local: r1 = full 2, r2 = full 4 on rank 0; SendTensor from [0] to [0] into r2 makes r2
    a copy of r1 (no communicator needed)."""
    session = mesh2x2._session
    r1, r2 = session.new_ref(), session.new_ref()
    for ref, value in ((r1, 2.0), (r2, 4.0)):
        session.send(CallFunction(session.new_seq(), [ref], [], FULL, ArgsKwargs(([3], value), {}), ST0, []), [0])
    session.send(SendTensor(r2, Slice(0, [1], [1]), Slice(0, [1], [1]), r1, Factory((3,), torch.float32), ST0, ST0),
                 [0])
    got = _fetch_raw(session, r2, 0)
    assert torch.equal(got.value, torch.full((3,), 2.0))


def test_send_tensor_with_an_errored_input_sends_zeros_and_its_local_copy_carries_the_error(mesh2x2):
    """Spec §3/§5 and send_tensor_in_recording, eagerly: rank 0's input failed (s0); in a swap between ranks 0 and
    1 rank 0 still sends (zeros), so rank 1 does not wait, and receives real data from rank 1; rank 0's copy to
    itself (a self-copy) carries the dependent error."""
    session = mesh2x2._session
    r1, r2, r3 = session.new_ref(), session.new_ref(), session.new_ref()
    session.send(CallFunction(session.new_seq(), [r1], [], MISSING, ArgsKwargs(), ST0, []), [0])
    session.send(CallFunction(session.new_seq(), [r1], [], FULL, ArgsKwargs(([2], 3.0), {}), ST0, []), [1])
    session.send(BackendNetworkPointToPointInit(ST0, ST0))
    factory = Factory((2,), torch.float32)
    # the swap: two one-rank SendTensors in opposite directions, each sent to both ranks
    session.send(SendTensor(r2, Slice(0, [1], [1]), Slice(1, [1], [1]), r1, factory, ST0, ST0), [0, 1])
    session.send(SendTensor(r2, Slice(1, [1], [1]), Slice(0, [1], [1]), r1, factory, ST0, ST0), [0, 1])
    session.send(SendTensor(r3, Slice(0, [1], [1]), Slice(0, [1], [1]), r1, factory, ST0, ST0), [0])
    assert torch.equal(_fetch_raw(session, r2, 1).value, torch.zeros(2))  # rank 0 sent zeros
    assert torch.equal(_fetch_raw(session, r2, 0).value, torch.full((2,), 3.0))  # rank 1's real data
    session.send(GetRefUnitTestsOnly(r3, ST0), [0])
    sync(session)
    (rank, reply), = session.get_ref_results
    assert rank == 0 and reply.present and "failed to resolve function" in reply.error


def test_send_tensor_without_its_communicator_is_a_clear_fatal_error(client4):
    mesh = dm.attach(client4, dims={"host": 2, "gpu": 2}, comm_timeout=60)
    session = mesh._session
    r1, r2 = session.new_ref(), session.new_ref()
    session.send(CallFunction(session.new_seq(), [r1], [], FULL, ArgsKwargs(([2], 1.0), {}), ST0, []), [0])
    session.send(SendTensor(r2, Slice(0, [1], [1]), Slice(1, [1], [1]), r1, Factory((2,), torch.float32), ST0, ST0),
                 [0, 1])
    with pytest.raises(dm.SessionError, match="could not find stream to stream comm.*BackendNetworkPointToPointInit"):
        sync(session)
    try:
        mesh.exit()
    except Exception:
        pass


# --------------------------------------------------------------------------------------- test_controller
def test_movement(mesh2x2, x):
    sm0, sm1 = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    with sm0.activate():
        y = torch.ones(3) * 7 + mesh2x2.rank("gpu")
    moved = y.to_mesh(sm1)
    assert moved.mesh is sm1 and tuple(moved.shape) == (3,)
    b = x.slice_mesh(host=0)
    b0, b1 = b.to_mesh(sm0), b.to_mesh(sm1)
    for g in range(2):
        assert torch.equal(fetch(moved, gpu=g), torch.full((3,), 7.0 + g))
        assert torch.equal(fetch(b0, gpu=g), per_rank(0, g))
        assert torch.equal(fetch(b1, gpu=g), per_rank(0, g))


@pytest.mark.parametrize("dim", ["host", "gpu"])
def test_broadcast_one(mesh2x2, dim):
    subset = mesh2x2.slice(**{dim: 1})
    with subset.activate():
        x = torch.rand(3)
    with pytest.warns(UserWarning, match=f"broadcasting along \\['{dim}'\\]"):
        y = x.to_mesh(mesh2x2)
    a = dm.inspect(x)
    b = dm.inspect(y.reduce(dim, reduction="stack"))
    assert torch.equal(a.expand(2, -1), b)


def test_broadcast_two(mesh2x2):
    subset = mesh2x2.slice(host=1, gpu=1)
    with subset.activate():
        x = torch.rand(3)
    with pytest.warns(UserWarning, match="broadcasting along \\['host', 'gpu'\\]"):
        y = x.to_mesh(mesh2x2)
    a = dm.inspect(x)
    b = dm.inspect(y.reduce("host", reduction="stack").reduce("gpu", reduction="stack"))
    assert torch.equal(a.expand(2, 2, -1), b)


def test_to_mesh_cow(mesh2x2):
    with mesh2x2.activate():
        t = torch.zeros(())
        t2 = t.to_mesh(mesh2x2)
        t.add_(1)
    assert dm.inspect(t2).item() == 0
    assert dm.inspect(t).item() == 1


def test_to_mesh_pytree(mesh2x2):
    host0, host1 = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    with host0.activate():
        tensors = {"a": torch.zeros((1,)), "b": torch.ones((1,)), "n": 5}
    moved = dm.to_mesh(tensors, host1)
    assert moved["n"] == 5 and moved["a"].mesh is host1
    with host1.activate():
        moved["a"].add_(1)
        moved["b"].add_(1)
    assert torch.equal(dm.inspect(moved["a"]), torch.tensor([1.0]))
    assert torch.equal(dm.inspect(moved["b"]), torch.tensor([2.0]))
    assert torch.equal(dm.inspect(tensors["a"]), torch.tensor([0.0]))  # a copy


def test_slice_mesh_pytree(mesh2x2):
    with mesh2x2.activate():
        a = mesh2x2.rank("host") + torch.zeros((1,))
        b = mesh2x2.rank("host") + torch.ones((1,))
    tensors = {"a": a, "b": b}
    host0, host1 = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    host0_tensors = dm.to_mesh(dm.slice_mesh(tensors, host=0), host0)
    host1_tensors = dm.to_mesh(dm.slice_mesh(tensors, host=1), host1)
    dm.reduce_(host0_tensors, dims="gpu", reduction="sum")
    dm.reduce_(host1_tensors, dims="gpu", reduction="sum")
    assert torch.equal(fetch(host0_tensors["a"]), torch.tensor([0.0]))
    assert torch.equal(fetch(host0_tensors["b"]), torch.tensor([2.0]))
    assert torch.equal(fetch(host1_tensors["a"]), torch.tensor([2.0]))
    assert torch.equal(fetch(host1_tensors["b"]), torch.tensor([4.0]))


def test_to_mesh_aliasing(mesh2x2):
    """A borrowed tensor sent from its borrower's stream; the copy borrowed back onto the main stream."""
    p2p_stream = dm.Stream("p2p_stream")
    ppmesh = mesh2x2.flatten("all").split(all=("dp", "pp"), pp=2)
    pp_meshes = [ppmesh.slice(pp=i) for i in range(2)]
    with ppmesh.activate():
        with pp_meshes[0].activate():
            x = torch.arange(9.0).reshape(3, 3) + 100 * pp_meshes[0].rank("dp")
            x_borrowed, x_borrow = p2p_stream.borrow(x)
            with p2p_stream.activate():
                y = x_borrowed.to_mesh(pp_meshes[1])
        with pp_meshes[1].activate():
            x_borrow.drop()
            y_main, y_borrow = dm.get_active_stream().borrow(y)
            got = [fetch(y_main, dp=dp) for dp in range(2)]
            y_borrow.drop()
    for dp in range(2):
        assert torch.equal(got[dp], torch.arange(9.0).reshape(3, 3) + 100 * dp)


def test_to_mesh_stream(mesh2x2):
    other = dm.Stream("other")
    m0, m1 = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    with m0.activate():
        t = torch.rand(3, 4)
        t2 = t.to_mesh(m1, stream=other)
    assert t2.stream is other
    with m1.activate(), other.activate():
        doubled = dm.inspect(t2 + t2)
    assert torch.equal(doubled, 2 * dm.inspect(t))


# ------------------------------------------------------------------------------- beyond Monarch, errors
@pytest.mark.parametrize("to_stream", ["same", "other"])
def test_a_rank_sends_and_receives_in_one_to_mesh_across_streams(mesh2x2, x, to_stream):
    """The mesh transposed onto itself: rank 1 sends to rank 2 and receives from it, rank 2 likewise (a cycle);
    with ``stream=other`` each sends from the main stream and receives on another (Monarch panics there)."""
    other = dm.Stream("other") if to_stream == "other" else None
    transposed = mesh2x2.rename(host="gpu", gpu="host")  # same ranks, the dims swapped
    y = x.to_mesh(transposed, stream=other)
    for h in range(2):
        for g in range(2):
            # rank (host=h, gpu=g) of the destination sits where the source has host=g, gpu=h
            assert torch.equal(fetch(y, host=h, gpu=g), per_rank(h, g))
    assert y.stream is (other or dm.main_stream)


def test_a_chain_where_middle_ranks_send_and_receive_on_two_streams(mesh2x2):
    other = dm.Stream("other")
    flat = mesh2x2.flatten("r")
    src, dst = flat.slice(r=slice(0, 3)), flat.slice(r=slice(1, 4))
    with src.activate():
        t = torch.ones(4) * flat.rank("r")
    moved = t.to_mesh(dst, stream=other)
    for r in range(3):
        assert torch.equal(fetch(moved, r=r), torch.full((4,), float(r)))  # dst rank r + 1 holds src rank r's


def test_to_mesh_errors_name_the_bad_dimension(mesh2x2, x):
    host0 = mesh2x2.slice(host=0)
    with pytest.raises(ValueError, match=r"does not have dimensions \['host'\]"):
        x.to_mesh(host0)
    narrow = mesh2x2.slice(gpu=slice(0, 1))
    with pytest.raises(ValueError, match="'gpu' has size 1 in the destination .* but size 2 in the source"):
        x.to_mesh(narrow)
    with pytest.raises(KeyError, match="nope"):
        x.slice_mesh(nope=0)
    with pytest.raises(TypeError, match="mesh must be a dask_monarch.DeviceMesh"):
        x.to_mesh("host")
    with mesh2x2.activate():
        w = torch.ones(3, requires_grad=True)
    with pytest.raises(TypeError, match="REQUIRES_GRAD"):
        w.to_mesh(mesh2x2)
    with torch.no_grad():
        assert torch.equal(fetch(w.to_mesh(mesh2x2)), torch.ones(3))  # allowed without grad, as in Monarch
    x.drop()
    with pytest.raises(TypeError, match="DROPPED"):
        x.to_mesh(mesh2x2)


def test_pytree_forms_refuse_local_tensors_and_slices_chain(mesh2x2, x):
    with pytest.raises(TypeError, match="LOCAL_TENSOR: to_mesh got a local torch.Tensor"):
        dm.to_mesh({"a": x, "b": torch.ones(2)}, mesh2x2)
    with pytest.raises(TypeError, match="LOCAL_TENSOR: slice_mesh got a local torch.Tensor"):
        dm.slice_mesh([torch.ones(2)], host=0)
    # a slice of a slice: host 1, gpu 0 only, broadcast to every rank of host 0
    one = x.slice_mesh(host=1).slice_mesh(gpu=0)
    with pytest.warns(UserWarning, match="broadcasting along \\['gpu'\\]"):
        moved = one.to_mesh(mesh2x2.slice(host=0))
    for g in range(2):
        assert torch.equal(fetch(moved, gpu=g), fetch(x, host=1, gpu=0))


def fails_on_host0(h):
    if int(h) == 0:
        raise RuntimeError("boom on host 0")
    return torch.ones(2) * h


def test_a_failure_upstream_reaches_a_fetch_downstream(mesh2x2):
    host0, host1 = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    with host0.activate():
        bad = dm.remote(fails_on_host0, propagate=lambda h: torch.empty(2))(mesh2x2.rank("host"))
    moved = bad.to_mesh(host1)
    with host1.activate():
        later = moved * 3
    with pytest.raises(dm.RemoteException, match="boom on host 0"):
        fetch(later)
    with host1.activate():
        fine = torch.ones(2)
    assert torch.equal(fetch(fine.to_mesh(host0)), torch.ones(2))  # the session goes on


def uneven(t, h):
    if int(h) == 1:
        t.resize_(4).fill_(1)  # in place: the controller still believes t has shape (3,)


def test_a_sender_whose_tensor_differs_from_the_controllers_shape_sends_zeros_and_fails_the_result(mesh2x2):
    host0, host1 = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    with mesh2x2.activate():
        t = torch.ones(3)
        dm.remote(uneven, propagate=lambda t, h: None)(t, mesh2x2.rank("host"))
    moved = t.slice_mesh(host=1).to_mesh(host0)  # host 1's tensors have 4 elements, the controller expects 3
    with pytest.raises(dm.RemoteException, match="has shape \\[4\\].*expects shape \\[3\\].*sent zeros"):
        fetch(moved)
    assert torch.equal(fetch(t.slice_mesh(host=0).to_mesh(host1)), torch.ones(3))


def test_to_mesh_of_another_sessions_mesh_is_wrong_mesh(mesh2x2, client4, x):
    with dm.attach(client4, dims={"all": 4}, comm_timeout=60) as other:
        with pytest.raises(TypeError, match="WRONG_MESH"):
            x.to_mesh(other.rename(all="host").split(host=("host", "gpu"), gpu=2))


# ------------------------------------------------------------------------------------------ compiled
def test_to_mesh_inside_a_compiled_function(mesh2x2):
    host0, host1 = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    other = dm.Stream("other")

    @dm.compile
    def step(a):
        moved = (a * 2).to_mesh(host1)
        with host1.activate():
            out = moved + 1
        back = out.to_mesh(host0, stream=other)  # received on another stream
        with host0.activate(), other.activate():
            return out, back * 10

    for k in range(4):
        with host0.activate():
            a = torch.ones(2) * k + host0.rank("gpu")
        out, back = step(a)
        for g in range(2):
            assert torch.equal(fetch(out, gpu=g), torch.full((2,), 2.0 * (k + g) + 1))
            assert torch.equal(fetch(back, gpu=g), torch.full((2,), 10 * (2.0 * (k + g) + 1)))
    assert step.recordings == 2  # recorded, and recorded again to verify (verify=True); replayed since


def test_a_compiled_to_mesh_of_a_failed_input_fails_its_result_and_the_next_call_works(mesh2x2):
    host0, host1 = mesh2x2.slice(host=0), mesh2x2.slice(host=1)

    @dm.compile
    def step(a):
        return (a + 1).to_mesh(host1)

    with host0.activate():
        good = torch.ones(2)
    step(good)
    step(good)  # recorded
    with host0.activate():
        bad = dm.remote(fails_on_host0, propagate=lambda h: torch.empty(2))(mesh2x2.rank("host"))
    with pytest.raises(dm.RemoteException, match="boom on host 0"):
        fetch(step(bad))
    assert torch.equal(fetch(step(good), gpu=1), torch.full((2,), 2.0))


def slow_ones():
    import time

    time.sleep(1.5)
    return torch.ones(3)


def test_a_receiver_waits_for_a_slow_sender(mesh2x2):
    """The receiver posts its receive long before the sender sends (gloo would close the pair of a receive whose
    timed wait expires: the wait is whole, bounded by comm_timeout)."""
    host0, host1 = mesh2x2.slice(host=0), mesh2x2.slice(host=1)
    with host0.activate():
        t = dm.remote(slow_ones, propagate=lambda: torch.empty(3))()
    assert torch.equal(fetch(t.to_mesh(host1), gpu=1), torch.ones(3))
