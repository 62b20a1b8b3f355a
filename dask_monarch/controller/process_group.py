"""``RemoteProcessGroup``: a ``torch.distributed`` process group over named mesh dims, for remote functions
(spec §1 "UDF process groups", §5; DESIGN.md "Decisions"; Monarch's ``mesh.process_group(dims)``).

``pg = mesh.process_group(("tp",))`` sends ``CreateRemoteProcessGroup`` to the mesh's ranks. Passed to a remote
function (``dm.remote(f)(x, pg)``), it arrives on each rank as a real ``torch.distributed.ProcessGroup`` over that
rank's peers along the dims (gloo on CPU workers, NCCL on GPU workers), usable with
``dist.all_reduce(t, group=pg)``, ``all_gather``, ``broadcast(t, src=global rank, group=pg)``, ``send``/``recv``;
``pg.rank()`` and ``pg.size()`` give this rank's place (``worker/process_group.py``). A rank of the call's mesh
that is not in ``pg``'s mesh gets ``torch.distributed.GroupMember.NON_GROUP_MEMBER``, with which those
functions do nothing. The first call that uses ``pg`` on a stream sends ``SplitCommForProcessGroup`` first (the
group's communicator for that stream is built then, on every member, in the same order). Two
``process_group`` calls give two groups.

While the controller learns the function's output shapes (``propagate=None`` runs it on fake tensors), ``pg`` is
a stand-in with the first rank's ``rank()`` and ``size()`` whose collectives do nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..protocol import CreateRemoteProcessGroup, Ref, SplitCommForProcessGroup
from .dynamo_skip import skip_dynamo

__all__ = ["RemoteProcessGroup"]


def mesh_dims(mesh, dims, what: str) -> tuple:
    """``dims`` (a dimension name, a tuple of names, or ``()`` for all) as a tuple of ``mesh``'s dimension names,
    for ``what`` (``"reduce"``, ``"process_group"``: the errors start with it). Raises ``TypeError`` for anything
    but a name or an iterable of names, ``KeyError`` for a name not of the mesh, ``ValueError`` for duplicates."""
    if isinstance(dims, str):
        dims = (dims,)
    try:
        dims = tuple(dims)
    except TypeError:
        raise TypeError(f"{what}: dims must be a dimension name or a tuple of names, got {dims!r}") from None
    if not dims:
        return tuple(mesh.names)
    for d in dims:
        if d not in mesh.names:
            raise KeyError(f"{what}: {d!r} is not a dimension of the mesh; its dimensions are {list(mesh.names)}")
    if len(set(dims)) != len(dims):
        raise ValueError(f"{what}: duplicate dimensions in {dims}")
    return dims


def _stand_in(members: list, me: int):
    """A ``ProcessGroup`` of rank ``me`` among ``members`` whose collectives do nothing (torch's
    ``FakeProcessGroup``), registered with ``members`` as its global ranks; or NON_GROUP_MEMBER."""
    from torch._C._distributed_c10d import FakeProcessGroup

    members = sorted(members)
    if me not in members:
        return dist.GroupMember.NON_GROUP_MEMBER
    rank = members.index(me)
    backend = FakeProcessGroup._create_internal(rank, len(members))
    pg = dist.ProcessGroup(dist.HashStore(), rank, len(members))
    kind = dist.ProcessGroup.BackendType.CUSTOM
    pg._set_default_backend(kind)
    for device in ("cpu", "cuda", "meta"):
        try:
            pg._register_backend(torch.device(device), kind, backend)
        except Exception:  # a build without that device type
            pass
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(members)}
    return pg


class RemoteProcessGroup:
    """A process group over ``dims`` of ``mesh`` (``mesh.process_group(dims)``); ``dims`` as given, ``size`` the
    number of ranks in each rank's group. It pickles as its ``Ref``; when it is garbage-collected the workers
    release its communicators (after the calls already queued)."""

    def __init__(self, mesh, dims=()):
        self.mesh = mesh
        self.dims = mesh_dims(mesh, dims, "process_group")
        self._stand_in = None
        self._streams: set = set()
        session = mesh._session
        with session.lock:
            session.check_ok()
            mesh_ref = mesh.define_remotely()
            self.ref = session.new_ref()
            session.send(CreateRemoteProcessGroup(self.ref, mesh_ref, sorted(self.dims)), mesh._rank_list)

    @property
    def size(self) -> int:
        """Ranks per group: the product of the dims' sizes."""
        return self.mesh.size(self.dims)

    def ensure_split(self, stream_ref) -> None:
        """Send ``SplitCommForProcessGroup`` for ``stream_ref`` to the mesh's ranks, once per stream (called under
        the session lock, before the first call that uses the group on that stream)."""
        if stream_ref.id not in self._streams:
            self._streams.add(stream_ref.id)
            self.mesh._session.send(SplitCommForProcessGroup(self.ref, stream_ref), self.mesh._rank_list)

    def seen_from(self):
        """The stand-in ``ProcessGroup`` a function gets while the controller runs it on fake tensors: that of
        the mesh's first rank (``mesh.seen_from()``), whose collectives do nothing."""
        if self._stand_in is None:
            view = self.mesh.seen_from()
            self._stand_in = _stand_in(view.get_ranks_for_dim_slice(sorted(self.dims)), view.me)
        return self._stand_in

    def propagation_key(self) -> tuple:
        """What the output shapes of a call may depend on (``propagation.call_key``): not the object itself, which
        the cache would keep alive."""
        return ("process group", self.mesh.names, tuple(self.mesh._rank_list), tuple(sorted(self.dims)))

    def __monarch_ref__(self) -> int:
        return self.ref.id

    def __reduce_ex__(self, protocol):
        return (Ref, (self.ref.id,))

    def __repr__(self) -> str:
        return f"RemoteProcessGroup({self.ref!r}, dims={self.dims}, size={self.size}, mesh={self.mesh!r})"

    @skip_dynamo  # the collector may run it inside a torch.compile'd function (dynamo_skip.py)
    def __del__(self):
        try:
            stand_in = self._stand_in
            if stand_in is not None:
                c10d._world.pg_group_ranks.pop(stand_in, None)
            self.mesh._session.drop_ref(self.ref.id, self.mesh._rank_list)
        except Exception:
            pass
