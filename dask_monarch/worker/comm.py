"""Communicators of a session on one worker: ``torch.distributed`` process groups (gloo on CPU, NCCL on CUDA)
built from a store in the Dask scheduler, and the collectives of ``Reduce`` (spec §5; DESIGN.md "Comms").

No global default process group is used (two sessions in one worker process never collide): every group is a
``ProcessGroup`` object built directly from its own ``PrefixStore``. Ranks in a group are ordered by ascending
global rank, as NCCL's split does.
"""

from __future__ import annotations

import datetime
import functools
import threading

import torch
import torch.distributed as dist

from ..protocol import Reduction
from . import gloo
from .store import SchedulerStore

__all__ = ["CommError", "Comms", "reduce", "unsupported"]


class CommError(RuntimeError):
    """A communicator could not be built, or a collective failed or timed out; the text names the peers."""


_OPS = {
    Reduction.Sum: dist.ReduceOp.SUM,
    Reduction.Prod: dist.ReduceOp.PRODUCT,
    Reduction.Min: dist.ReduceOp.MIN,
    Reduction.Max: dist.ReduceOp.MAX,
    Reduction.Avg: dist.ReduceOp.AVG,
    Reduction.Band: dist.ReduceOp.BAND,
    Reduction.Bor: dist.ReduceOp.BOR,
    Reduction.Bxor: dist.ReduceOp.BXOR,
}


class Comms:
    """The process groups of one session on one worker.

    ``worker`` is the Dask worker (its scheduler connection carries the rendezvous store); ``rank`` and
    ``world_size`` are this session's; ``timeout`` (seconds) bounds every rendezvous and collective;
    ``device`` picks the backend (NCCL for CUDA, gloo otherwise).
    """

    def __init__(self, worker, rank: int, world_size: int, timeout: float, device: torch.device, key: str = ""):
        self.worker = worker
        #: the prefix of the store keys of groups built without ``BackendNetworkInit`` (the session id: the
        #: scheduler aborts a session's rendezvous by that prefix)
        self.key = key
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.unique_id: str | None = None
        self.world = None
        self.groups: list = []
        self._gloo_addresses: list = []  # per group of ``groups`` on gloo: (own listening address, the peers', its sockets)
        self._stores: list = []
        #: point-to-point works posted with ``post(..., pending=True)`` and not yet ``done``: aborted when the
        #: session stops (``gloo.abort_work``: a transfer under way when its pair closed waits for comm_timeout)
        self._pending: set = set()
        self._lock = threading.Lock()
        #: set by ``shutdown``/``abort``: a collective still waiting gives up at once
        self.stopped = threading.Event()
        self.stop_reason = "the session ended"

    def store(self, prefix: str) -> dist.Store:
        # keep the Python store alive: the C++ side holds it without its Python half otherwise (pybind11)
        inner = SchedulerStore(self.worker, self.timeout)
        self._stores.append(inner)
        return dist.PrefixStore(prefix + "/", inner)

    def _new_group(self, prefix: str, members: list[int]):
        """Build the process group of global ranks ``members`` (this rank among them) under store ``prefix``."""
        members = sorted(members)
        group_rank = members.index(self.rank)
        store = self.store(prefix)
        store.set(f"joined/{group_rank}", b"1")
        timeout = datetime.timedelta(seconds=self.timeout)
        try:
            if self.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                if hasattr(opts, "bound_device_id"):  # eager init on this worker's GPU (spec §5)
                    opts.bound_device_id = self.device
                group = dist.ProcessGroupNCCL(store, group_rank, len(members), opts)
                if hasattr(group, "eager_connect_single_device"):
                    group.eager_connect_single_device(self.device)
            else:
                opts = dist.ProcessGroupGloo._Options()
                device, address = gloo.create_device(_host(self.worker.address))
                opts._devices = [device]
                opts._timeout = timeout
                before = gloo.socket_fds()  # the group's sockets are the ones its constructor opens
                group = dist.ProcessGroupGloo(store, group_rank, len(members), opts)
                del opts, device
                addresses = _exchange(store, group_rank, len(members), address)
                addresses = (*addresses, gloo.group_sockets(*addresses, since=before))  # (own, peers, its sockets)
        except Exception as e:
            missing = [
                members[i] for i in range(len(members)) if not store.check([f"joined/{i}"])
            ] if _check_quietly(store) else []
            who = f"; ranks {missing} did not join" if missing else ""
            raise CommError(
                f"could not build the {self.backend} communicator of ranks {members} within {self.timeout:g} s{who}: "
                f"{type(e).__name__}: {e}"
            ) from None
        with self._lock:
            stopped = self.stopped.is_set()
            if not stopped:
                self.groups.append(group)
                if self.backend == "gloo":
                    self._gloo_addresses.append(addresses)
        if stopped:  # the session ended while this group was being built: it is not kept
            if self.backend == "gloo":
                _abort_gloo(addresses)
            else:
                _quietly(group.abort)
            raise CommError(f"the {self.backend} communicator of ranks {members} was abandoned: {self.stop_reason}")
        return group

    def init_world(self, unique_id: str, stream_ids=()) -> dict:
        """``BackendNetworkInit``: the world communicator, warmed up with an all-reduce of ``zeros([1])``, then one
        communicator over all ranks per stream of ``stream_ids``, built in ascending stream order (the same on
        every rank; spec §5). Returns ``{stream id: group}``."""
        self.unique_id = unique_id
        everyone = list(range(self.world_size))
        self.world = self._new_group(f"{unique_id}/world", everyone)
        warm = torch.zeros([1], device=self.device)
        _wait(self.world.allreduce([warm]), "warm-up all-reduce", f"all {self.world_size} ranks", self)
        return {sid: self._new_group(f"{unique_id}/stream{sid}", everyone) for sid in sorted(stream_ids)}

    def split(self, mesh_id: int, stream_id: int, dims: tuple, members: list[int]):
        """``SplitComm``: the communicator of ``(stream, dims)`` of mesh ``mesh_id`` over global ranks
        ``members``. Built only by members; the same key on every member makes the same group."""
        key = f"{self.unique_id}/split/m{mesh_id}/s{stream_id}/{','.join(dims)}/{','.join(map(str, sorted(members)))}"
        return self._new_group(key, members)

    def p2p(self, from_stream: int, to_stream: int):
        """``BackendNetworkPointToPointInit``: the send/recv communicator of stream pair ``(from_stream,
        to_stream)`` over all ranks (spec §5), built through the scheduler store; the world communicator is not
        needed."""
        return self._new_group(f"{self.key}/p2p/s{from_stream}-s{to_stream}", list(range(self.world_size)))

    def group(self, prefix: str, members: list[int]):
        """The communicator of global ranks ``members`` (this rank among them) under store key ``prefix``
        (which must start with ``key``); released with the session's others."""
        return self._new_group(prefix, members)

    def post(self, what: str, start, group=None, pending: bool = False):
        """``start()`` (which posts operations on the session's groups and returns their works), unless the session
        has stopped: then ``CommError``. With ``pending`` (``start`` returns a list of gloo point-to-point works),
        the works are kept until ``done`` and aborted if the session stops meanwhile (``shutdown``/``abort``), so
        that their ``wait()`` returns False at once (``gloo.abort_work``; ``send_tensor._wait``). Under the lock that ``shutdown``/``abort`` take to stop, so an operation is
        either refused or posted before the groups' connections are shut down (which then fails it): a gloo
        send posted on a pair already shut down would wait for ``comm_timeout``. With ``group`` (gloo), also
        ``CommError`` if gloo already closed one of its connections (a peer aborted or left): a send posted there
        after the peer's receive was announced waits for ``comm_timeout``, and no abort can wake it."""
        with self._lock:
            if self.stopped.is_set():
                raise CommError(f"{what} abandoned: {self.stop_reason}")
            if group is not None and self.backend == "gloo":
                for g, addresses in zip(self.groups, self._gloo_addresses):
                    if g is group and gloo.closed_sockets(addresses[2]):
                        raise CommError(f"{what} abandoned: a connection of its gloo group was closed (a peer "
                                        "aborted or left)")
            works = start()
            if pending and self.backend == "gloo":
                self._pending.update(works)
            return works

    def done(self, works) -> None:
        """The caller no longer waits on ``works`` (posted with ``post(..., pending=True)``)."""
        with self._lock:
            self._pending.difference_update(works)

    def release(self, group) -> None:
        """Release ``group`` now, before the session ends (its last user is done with it)."""
        with self._lock:
            for i, g in enumerate(self.groups):
                if g is group:
                    del self.groups[i]
                    if self.backend == "gloo":
                        del self._gloo_addresses[i]
                    break
            else:
                return
        if self.backend != "gloo":
            _quietly(group.shutdown)

    def shutdown(self, reason: str | None = None) -> None:
        """Release every process group now (the session ended cleanly: nothing is pending). A collective still
        waiting on another thread stops waiting and raises ``CommError`` with ``reason``."""
        self._release(reason, abort=False)

    def abort(self, reason: str | None = None) -> None:
        """Fail every pending collective of the session's groups at once and release them (the session failed):
        NCCL groups are aborted (``ProcessGroupNCCL.abort``, ``ncclCommAbort``), gloo groups have their
        connections shut down (``gloo.py``: gloo has no abort), so a collective waiting on a stopped or hung
        peer raises now, its threads end, and releasing the group does not wait for ``comm_timeout``."""
        self._release(reason, abort=True)

    def _release(self, reason: str | None, abort: bool) -> None:
        with self._lock:
            if reason and not self.stopped.is_set():
                self.stop_reason = reason
            self.stopped.set()
            groups, self.groups = self.groups, []
            addresses, self._gloo_addresses = self._gloo_addresses, []
            pending, self._pending = self._pending, set()
            self._stores = []
            self.world = None
        for i, group in enumerate(groups):
            if self.backend == "gloo":
                if abort:
                    _abort_gloo(addresses[i])
            else:
                _quietly(group.abort if abort else group.shutdown)
        for work in pending:  # after the connections: a transfer under way there never ends otherwise (gloo.py)
            gloo.abort_work(work)
        del pending
        # the last reference is dropped by whoever holds it last (a stream thread that was waiting in one): the
        # destructor joins the group's threads and closes its sockets, at once now that nothing is pending
        del groups


def _exchange(store, group_rank: int, size: int, address) -> list:
    """``(own address, [the peers' addresses])`` of a gloo group's listening sockets, exchanged through the
    group's store once every rank has built it (``gloo.shutdown_connections`` needs them to abort it)."""
    store.set(f"gloo-address/{group_rank}", "" if address is None else f"{address[0]} {address[1]}")
    peers = []
    for i in range(size):
        if i != group_rank:
            text = store.get(f"gloo-address/{i}").decode()
            if text:
                ip, port = text.rsplit(" ", 1)
                peers.append((ip, int(port)))
    return address, peers


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # a group whose peer is gone may refuse: it is dropped all the same
        pass


def _check_quietly(store) -> bool:
    try:
        store.check(["joined/0"])
        return True
    except Exception:
        return False


def _host(address: str) -> str:
    from distributed.comm import get_address_host

    return get_address_host(address)


_POLL = datetime.timedelta(seconds=0.5)


def _wait(work, what: str, among: str, comms: "Comms | None" = None) -> None:
    """Wait for collective ``work``. With ``comms`` on gloo, wait in slices so that ``comms.shutdown()`` or
    ``abort()`` (the session failed or was told to exit) ends the wait at once, even where the abort could not
    reach the op's connections (``gloo.py``). The group's own timeout still bounds the op. An op that fails
    because the session's groups were aborted reports the session's reason, not the connection it lost."""
    try:
        if comms is None or comms.backend != "gloo":
            work.wait()
            return
        while True:
            if comms.stopped.is_set() and not work.is_completed():
                raise CommError(f"{what} among {among} abandoned: {comms.stop_reason}")
            try:
                work.wait(_POLL)
                return
            except RuntimeError:
                if work.is_completed():
                    work.wait()  # the op's own outcome: its error, or nothing if it just finished
                    return
    except CommError:
        raise
    except Exception as e:
        if comms is not None and comms.stopped.is_set():
            raise CommError(f"{what} among {among} abandoned: {comms.stop_reason}") from None
        if comms is not None and "Timed out" in str(e):
            raise CommError(
                f"{what} did not complete within comm_timeout={comms.timeout:g} s: a peer did not reach it in time "
                f"(still busy with earlier work, stopped, or not at this collective): {type(e).__name__}: {e}"
            ) from None
        raise CommError(f"{what} among {among} failed: {type(e).__name__}: {e}") from None


_BITWISE = (Reduction.Band, Reduction.Bor, Reduction.Bxor)


@functools.lru_cache(maxsize=256)
def unsupported(backend: str, reduction: Reduction, dtype: torch.dtype, device: torch.device | None = None) -> str | None:
    """Why ``backend`` cannot run ``reduction`` over ``dtype`` tensors on ``device``, or None. Decided from the
    Reduce's factory, so every rank decides the same and they skip the collective together (gloo itself fails
    these on every rank only after the exchange, as 'result type Float can't be cast...' or 'Invalid scalar
    type'; NCCL refuses tensors that are not on a GPU)."""
    if backend == "nccl" and device is not None and device.type != "cuda":
        return (f"nccl reduces CUDA tensors, and this one is on {device}: move it to the GPU first "
                "(e.g. t.to('cuda'), or create it with device='cuda')")
    if reduction in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        why = f"{reduction.value} needs an integer or bool dtype"
    elif backend == "gloo" and reduction is Reduction.Avg and not (dtype.is_floating_point or dtype.is_complex):
        why = "avg needs a floating point or complex dtype (reduce with 'sum' and divide, or convert first)"
    elif backend == "gloo" and dtype.is_complex and reduction not in (Reduction.Sum, Reduction.Avg):
        why = "only sum and avg are supported for complex tensors"
    else:
        return None
    return f"{backend} cannot reduce {reduction.value!r} over {dtype} tensors: {why}"


@functools.lru_cache(maxsize=None)
def _allreduce_options(reduction: Reduction) -> dist.AllreduceOptions:
    """Options of an all-reduce with ``reduction``, built once (the process group copies what it needs)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = _OPS[reduction]
    return opts


def _post(comms: "Comms | None", group, what: str, start):
    """Post a collective on ``group`` through ``comms.post`` (refused once the session stopped, or once gloo closed
    one of the group's connections: an op posted on gloo connections already shut down or closed would keep the
    group's thread, and whoever releases the group, until ``comm_timeout``), or at once without ``comms``."""
    return start() if comms is None else comms.post(what, start, group)


def reduce(group, size: int, tensor: torch.Tensor, reduction: Reduction, scatter: bool, in_place: bool, out,
           comms: Comms | None = None):
    """Run one ``Reduce`` row of spec §5 on ``group`` (``size`` ranks) and return the output tensor.

    ``tensor`` is this rank's input (shape ``s``); ``out`` an optional output tensor of the exact output shape:
    stack -> ``[size, *s]`` (all-gather), stack+scatter -> ``s`` (all-to-all), op -> ``s`` (all-reduce),
    op+scatter -> ``s[1:]`` (reduce-scatter). Raises ``CommError`` for an unsupported combination, a backend
    refusal, or a timeout. ``comms`` (the session's) lets ``Comms.shutdown`` end a wait.
    """
    members = f"a group of {size} ranks"
    try:
        if reduction is Reduction.Stack:
            if scatter:
                src = tensor.contiguous()
                if in_place:
                    output, src = tensor, src.clone()
                else:
                    output = out if out is not None else torch.empty_like(src)
                _wait(_post(comms, group, "all-to-all", lambda: group.alltoall_base(output, src, [], [])), "all-to-all",
                      members, comms)
                return output
            if in_place:
                raise CommError("in-place, non-scatter not supported for stack reduce")
            output = out if out is not None else tensor.new_empty((size, *tensor.shape))
            if tensor.is_cuda and output.is_contiguous():  # NCCL gathers into one flat buffer
                work = _post(comms, group, "all-gather", lambda: group._allgather_base(output, tensor.contiguous()))
            else:
                work = _post(comms, group, "all-gather",
                             lambda: group.allgather([list(output.unbind(0))], [tensor.contiguous()]))
            _wait(work, "all-gather", members, comms)
            return output
        opts_op = _OPS[reduction]
        if scatter:
            if in_place:
                raise CommError("in-place, scatter not supported for reduce")
            output = out if out is not None else tensor.new_empty(tensor.shape[1:])
            flat = output if output.is_contiguous() else output.contiguous()
            opts = dist.ReduceScatterOptions()
            opts.reduceOp = opts_op
            src = tensor.contiguous()
            nan = _nan_mask(src, reduction)
            work = _post(comms, group, "reduce-scatter",
                         lambda: group._reduce_scatter_base(flat.view(-1), src.view(-1), opts))
            _wait(work, "reduce-scatter", members, comms)
            if nan is not None:
                _propagate_nan(group, members, comms, nan, flat, scatter=True)
            if flat is not output:
                output.copy_(flat)
            return output
        if in_place:
            output = tensor
        elif out is not None:
            output = out.copy_(tensor)
        else:
            output = tensor.clone()
        dense = output if output.is_contiguous() else output.contiguous()
        nan = _nan_mask(dense, reduction)
        _wait(_post(comms, group, "all-reduce", lambda: group.allreduce([dense], _allreduce_options(reduction))),
              "all-reduce", members, comms)
        if nan is not None:
            _propagate_nan(group, members, comms, nan, dense, scatter=False)
        if dense is not output:
            output.copy_(dense)
        return output
    except CommError:
        raise
    except Exception as e:
        backend = group.name() if hasattr(group, "name") else type(group).__name__
        raise CommError(f"{backend} refused {reduction.value} (scatter={scatter}): {type(e).__name__}: {e}") from None


def _nan_mask(tensor: torch.Tensor, reduction: Reduction) -> torch.Tensor | None:
    """Where this rank's input of a ``max``/``min`` reduce is NaN (a uint8 tensor of its shape), or None when the
    reduction or the dtype has no NaN to carry. Taken before the collective, which may write over the input."""
    if reduction not in (Reduction.Max, Reduction.Min) or not tensor.dtype.is_floating_point:
        return None
    return torch.isnan(tensor).to(torch.uint8)


def _propagate_nan(group, members: str, comms, nan: torch.Tensor, output: torch.Tensor, scatter: bool) -> None:
    """Make ``output`` (the result of a ``max``/``min`` all-reduce, or this rank's part of a reduce-scatter) NaN
    wherever any rank's input was NaN (``nan``: ``_nan_mask`` of this rank's input), as ``torch.maximum`` /
    ``torch.minimum`` do: gloo's and NCCL's max/min keep or drop a NaN depending on which rank holds it. Every rank
    first learns whether any rank holds a NaN (a one-element all-reduce); only then are the masks reduced (max over
    uint8, scattered like the data for a reduce-scatter). The same collectives in the same order on every rank."""
    any_nan = nan.amax().reshape(1) if nan.numel() else torch.zeros(1, dtype=torch.uint8, device=nan.device)
    _wait(_post(comms, group, "NaN check of a max/min reduce",
                lambda: group.allreduce([any_nan], _allreduce_options(Reduction.Max))),
          "NaN check of a max/min reduce", members, comms)
    if not any_nan.item():
        return
    if scatter:
        mask = torch.empty(output.shape, dtype=torch.uint8, device=output.device)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        work = _post(comms, group, "NaN mask of a max/min reduce-scatter",
                     lambda: group._reduce_scatter_base(mask.view(-1), nan.view(-1), opts))
    else:
        mask = nan
        work = _post(comms, group, "NaN mask of a max/min all-reduce",
                     lambda: group.allreduce([mask], _allreduce_options(Reduction.Max)))
    _wait(work, "NaN mask of a max/min reduce", members, comms)
    output.masked_fill_(mask.bool(), float("nan"))


def _abort_gloo(addresses) -> None:
    """Shut a gloo group's connections down (``gloo.py``): the sockets recorded when it was built, each only while its
    descriptor still refers to it. Not by address where descriptors tell what they are (Linux): a peer's gloo port
    may belong to another session's group by now (the port reused), whose connections must stay; elsewhere by
    address, the only way there."""
    own, peers, sockets = addresses
    if gloo.identities():
        gloo.shutdown_sockets(sockets)
    else:
        gloo.shutdown_connections(own, peers)
