"""Process groups for remote functions on a 2x2 mesh (host x gpu) of four CPU workers (spec §1 "UDF process
groups", §5 ``CreateRemoteProcessGroup``/``SplitCommForProcessGroup``; §9 test_controller sub_mesh_process_grop;
DESIGN.md "Decisions": a real ``torch.distributed`` ProcessGroup, non-members skipped cleanly)."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
import torch.distributed as dist

import dask_monarch as dm

TIMEOUT = 60


def fetch(t, **coords):
    return dm.fetch_shard(t, **coords).result(timeout=TIMEOUT)


def all_reduce(x, pg):
    y = x.clone()
    dist.all_reduce(y, group=pg)
    return y


def rank_value(h, g):
    return torch.tensor([1.0, 10.0]) * (2 * h + g + 1)


@pytest.fixture
def v(mesh2x2):
    """Rank (h, g) holds (2h + g + 1) * [1, 10]."""
    return dm.remote(rank_value)(mesh2x2.rank("host"), mesh2x2.rank("gpu"))


def value(h, g):
    return torch.tensor([1.0, 10.0]) * (2 * h + g + 1)


@pytest.mark.parametrize("dims", [("host",), ("gpu",), (), ("gpu", "host")])
def test_all_reduce_over_each_dimension(mesh2x2, v, dims):
    pg = mesh2x2.process_group(dims)
    total = dm.remote(all_reduce)(v, pg)
    along = set(dims or ("host", "gpu"))
    for h in range(2):
        for g in range(2):
            peers = [(a, b) for a in range(2) for b in range(2)
                     if (a == h or "host" in along) and (b == g or "gpu" in along)]
            assert torch.equal(fetch(total, host=h, gpu=g), sum(value(a, b) for a, b in peers)), (h, g)


def test_a_group_made_for_one_call_and_dropped_at_once_is_still_the_calls_group(mesh2x2, v):
    """The controller drops the temporary group right after the call (DeleteRefs): the call, queued before it,
    still gets the group, not NON_GROUP_MEMBER; a second call through the cached plan gets its own group too."""
    for _ in range(2):
        total = dm.remote(all_reduce)(v, mesh2x2.process_group(["gpu"]))
        assert torch.equal(fetch(total, host=1, gpu=0), value(1, 0) + value(1, 1))


def test_a_repeated_call_reuses_its_plan_and_still_passes_the_group(mesh2x2, v):
    pg = mesh2x2.process_group("host")
    f = dm.remote(all_reduce)
    first, second = f(v, pg), f(v * 2, pg)  # the second call's outputs come from the first one's plan
    assert mesh2x2._session.propagator.hits >= 1
    assert torch.equal(fetch(second, host=0, gpu=1), 2 * fetch(first, host=0, gpu=1))
    assert torch.equal(fetch(first, host=0, gpu=1), value(0, 1) + value(1, 1))


def collectives(x, pg, host):
    """all_gather, broadcast from a global rank, send/recv by global rank, and the group's own rank and size."""
    gathered = [torch.empty_like(x) for _ in range(pg.size())]
    dist.all_gather(gathered, x, group=pg)
    first = dist.get_global_rank(pg, 0)
    b = x.clone()
    dist.broadcast(b, src=first, group=pg)
    got = torch.zeros_like(x)
    peer = dist.get_global_rank(pg, 1 - pg.rank())
    if pg.rank() == 0:
        dist.send(x, dst=peer, group=pg)
        dist.recv(got, src=peer, group=pg)
    else:
        dist.recv(got, src=peer, group=pg)
        dist.send(x, dst=peer, group=pg)
    return torch.stack(gathered), b, got, torch.tensor([pg.rank(), pg.size()])


def test_all_gather_broadcast_send_recv_and_ranks_along_gpu(mesh2x2, v):
    pg = mesh2x2.process_group("gpu")
    gathered, b, got, place = dm.remote(collectives)(v, pg, mesh2x2.rank("host"))
    for h in range(2):
        for g in range(2):
            assert torch.equal(fetch(gathered, host=h, gpu=g), torch.stack([value(h, 0), value(h, 1)]))
            assert torch.equal(fetch(b, host=h, gpu=g), value(h, 0))
            assert torch.equal(fetch(got, host=h, gpu=g), value(h, 1 - g))
            assert fetch(place, host=h, gpu=g).tolist() == [g, 2]


def ring(x, group=None):
    """batch_isend_irecv around the group, the group passed as a keyword."""
    n, me = group.size(), group.rank()
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, group=group, group_peer=(me + 1) % n),
           dist.P2POp(dist.irecv, out, group=group, group_peer=(me - 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


def test_batch_isend_irecv_ring_with_the_group_as_a_keyword(mesh2x2, v):
    pg = mesh2x2.process_group(())
    shifted = dm.remote(ring)(v, group=pg)
    # ascending global rank = (h, g) row-major; each rank receives from the previous one
    order = [(0, 0), (0, 1), (1, 0), (1, 1)]
    for i, (h, g) in enumerate(order):
        assert torch.equal(fetch(shifted, host=h, gpu=g), value(*order[i - 1]))


def member_or_not(x, pg):
    if pg == dist.GroupMember.NON_GROUP_MEMBER:
        dist.all_reduce(x, group=pg)  # returns at once for a non-member
        return torch.tensor(-1.0)
    y = x.clone()
    dist.all_reduce(y, group=pg)
    return y.sum()


def test_sub_mesh_process_group(mesh2x2, v):
    """sub_mesh_process_grop: two groups of one sub-mesh are distinct and both work; ranks outside the sub-mesh
    get NON_GROUP_MEMBER, with which collectives do nothing."""
    h0 = mesh2x2.slice(host=0)
    pg0 = h0.process_group(("gpu",))
    pg1 = h0.process_group(("gpu",))
    assert pg0 != pg1 and pg0.ref != pg1.ref and pg0.size == 2
    out0 = dm.remote(member_or_not, propagate=lambda x, pg: torch.empty(()))(v, pg0)
    out1 = dm.remote(member_or_not, propagate=lambda x, pg: torch.empty(()))(v, pg1)
    for g in range(2):
        expected = (value(0, 0) + value(0, 1)).sum()
        assert torch.equal(fetch(out0, host=0, gpu=g), expected)
        assert torch.equal(fetch(out1, host=0, gpu=g), expected)
        assert fetch(out0, host=1, gpu=g).item() == -1.0


def test_groups_on_another_stream(mesh2x2):
    other = dm.Stream("other")
    pg = mesh2x2.process_group("host")
    with other.activate(), mesh2x2.activate():
        x = torch.ones(3) * (mesh2x2.rank("host") + 1)
        total = dm.remote(all_reduce)(x, pg)
    assert torch.equal(fetch(total, host=0, gpu=1), torch.full((3,), 3.0))
    with mesh2x2.activate():
        y = torch.ones(3)
        main_total = dm.remote(all_reduce)(y, pg)  # the main stream gets its own communicator
    assert torch.equal(fetch(main_total, host=1, gpu=0), torch.full((3,), 2.0))


def test_a_process_group_inside_a_compiled_function(mesh2x2, v):
    pg = mesh2x2.process_group("gpu")

    @dm.compile
    def step(x):
        return dm.remote(all_reduce)(x * 2, pg) + 1

    for k in range(3):
        out = step(v + k)
        assert torch.equal(fetch(out, host=1, gpu=0), 2 * (value(1, 0) + value(1, 1) + 2 * k) + 1)


def test_bad_dims_are_clear_errors(mesh2x2):
    with pytest.raises(KeyError, match="'tp' is not a dimension of the mesh; its dimensions are \\['host', 'gpu'\\]"):
        mesh2x2.process_group(("tp",))
    with pytest.raises(ValueError, match="duplicate dimensions"):
        mesh2x2.process_group(("host", "host"))
    with pytest.raises(TypeError, match="dims must be"):
        mesh2x2.process_group(3)


def _registered(dask_worker):
    from torch.distributed import distributed_c10d as c10d

    return sum(1 for name in c10d._world.pg_names.values() if "/pg" in name)


def test_a_dropped_group_is_released_on_the_workers(mesh2x2, v, client4):
    before = sum(client4.run(_registered).values())
    pg = mesh2x2.process_group("gpu")
    fetch(dm.remote(all_reduce)(v, pg))
    assert sum(client4.run(_registered).values()) == before + 4
    del pg
    gc.collect()
    fetch(v)  # a round trip: the DeleteRefs and the streams' release have run
    assert sum(client4.run(_registered).values()) == before


class _StepDict(dict):
    """A process group table that stops the thread ``stepped`` after each of its reads and writes until
    ``resume()``: the lookups of another thread can then be made between any two steps of an update."""

    def __init__(self, items, stepped: threading.Thread | None = None):
        super().__init__(items)
        self.stepped = stepped
        self.paused = threading.Event()
        self.go = threading.Event()

    def _step(self):
        if threading.current_thread() is self.stepped:
            self.paused.set()
            assert self.go.wait(TIMEOUT), "the test did not resume the stepped thread"
            self.go.clear()

    def resume(self):
        self.paused.clear()
        self.go.set()

    def get(self, *a):
        out = super().get(*a)
        self._step()
        return out

    def pop(self, *a):
        out = super().pop(*a)
        self._step()
        return out

    def __getitem__(self, key):
        out = super().__getitem__(key)
        self._step()
        return out

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._step()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._step()

    def __contains__(self, key):
        out = super().__contains__(key)
        self._step()
        return out


def test_a_call_looking_its_group_up_during_the_groups_delete_always_finds_it():
    """The dispatcher handles a group's ``DeleteRefs`` while a stream runs a call queued before it (the controller
    drops a temporary group right after the call). The stream's lookup (``ProcessGroups.for_call``), made between
    every two steps of the delete, gets the group: before the fix the delete moved the group from one table to
    another, and a lookup between the two steps found neither and handed the call ``NON_GROUP_MEMBER``, so that
    rank skipped its all-reduce and released the group under its peer ("Connection closed by peer" there; two
    sessions' stress loops on one cluster, 2026-12-06). Once the stream passes the delete, the group is gone."""
    import pickle

    from dask_monarch.protocol import (CreateDeviceMesh, CreateRemoteProcessGroup, CreateStream, Ref,
                                       RequestStatus, Slice, StreamCreationMode, StreamRef)
    from dask_monarch.worker.process_group import NON_MEMBER
    from dask_monarch.worker.tensor_worker import TensorWorker

    tw = TensorWorker(None, "test-pg-delete-lookup", 0, 1)
    try:
        tw.inbox.put(0, [pickle.dumps([CreateStream(StreamRef(0), StreamCreationMode.UseDefaultStream),
                                       CreateDeviceMesh(Ref(1), ["x"], Slice(0, [1], [1])),
                                       CreateRemoteProcessGroup(Ref(2), Ref(1), ["x"]),
                                       RequestStatus(3, False)])])
        tw.wait_status(3)
        assert tw.failure is None, tw.failure
        pgs = tw.process_groups
        group = object()  # stands for this rank's ProcessGroup of stream 0 (what SplitCommForProcessGroup builds)
        pgs.groups[2].per_stream[0] = (group, None)
        stream = tw.streams[0]
        deleter = threading.Thread(target=pgs.delete, args=(2,), name="dispatcher's delete")
        pgs.groups = table = _StepDict(pgs.groups, deleter)
        deleter.start()
        seen = []
        while True:
            while not table.paused.wait(0.05):
                if not deleter.is_alive():
                    break
            if not table.paused.is_set():
                break
            seen.append(pgs.for_call([Ref(2)], 0, "CallFunction 4")[2])
            table.resume()
        deleter.join(TIMEOUT)
        seen.append(pgs.for_call([Ref(2)], 0, "CallFunction 4")[2])
        assert seen and all(g is group for g in seen), seen
        stream.flush()  # the stream passes the delete (the dispatcher flushes its streams after each batch)
        deadline = time.monotonic() + TIMEOUT
        while 2 in dict.keys(table) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pgs.for_call([Ref(2)], 0, "CallFunction 5")[2] is NON_MEMBER
    finally:
        tw.close()
