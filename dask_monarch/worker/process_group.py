"""Process groups for remote functions (spec §1 "UDF process groups", §5 ``CreateRemoteProcessGroup``,
``SplitCommForProcessGroup``; DESIGN.md "Decisions": a remote function receives a real ``torch.distributed``
ProcessGroup for the named dims, and non-members are skipped cleanly).

``CreateRemoteProcessGroup{result, device_mesh, dims}`` (to the mesh's ranks) remembers the mesh and the sorted
dims under ``result``. ``SplitCommForProcessGroup{remote_process_group, stream}`` (to the same ranks, once per
stream, before the first call that uses the group on that stream) builds this rank's group: its peers along the
dims (``DeviceMesh.get_ranks_for_dim_slice``), a gloo (CPU) or NCCL (GPU) communicator bootstrapped through the
scheduler store like the others (``Comms.group``), wrapped in a ``torch.distributed.ProcessGroup`` and
registered with ``torch.distributed`` so that its functions take it: ``dist.all_reduce(t, group=pg)``,
``all_gather``, ``broadcast(t, src=..., group=pg)``, ``send``/``recv``, ``batch_isend_irecv``. ``src``/``dst``
are the session's global ranks; the group rank of a member is its position among the members in ascending
global order (``pg.rank()``, ``pg.size()``). There is no default group on a worker (two sessions may share its
process), so ``dist.get_rank(pg)`` is not available: use ``pg.rank()``.

A ``CallFunction`` lists the groups among its arguments in ``remote_process_groups``; each such ref resolves to
the group of the call's stream, or, on a rank that is not in the group's mesh, to
``torch.distributed.GroupMember.NON_GROUP_MEMBER``, with which ``torch.distributed`` functions return at once
(skipped cleanly, as for a rank outside a ``new_group``). A member whose group has no communicator for the
call's stream is a fatal error (the controller always sends the split first).

A group lives until the ``DeleteRefs`` of its ref has passed every stream (calls queued before it still use it)
or the session ends (``TensorWorker.close``); then its communicators are released and it is unregistered from
``torch.distributed``. The dispatcher marks a group deleted where it lies (``groups``), and the last stream to pass
the delete takes it out: a stream thread looking a group up meanwhile always finds it. (It was moved from one table
to another before, and a call running on its stream between the two steps found it in neither and was handed
``NON_GROUP_MEMBER``: that rank skipped the collective and released the group, and its peer's collective failed
with gloo's "Connection closed by peer"; seen with two sessions' stress loops on one cluster, 2026-12-06.)
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .device_mesh import MeshError
from .errors import FatalError

__all__ = ["ProcessGroups", "NON_MEMBER", "wrap", "unregister"]

#: what a rank outside a group's mesh receives for it (``torch.distributed`` functions skip it)
NON_MEMBER = dist.GroupMember.NON_GROUP_MEMBER


def wrap(backend, backend_name: str, device: torch.device, members: list[int], me: int, name: str, store):
    """A ``torch.distributed.ProcessGroup`` over ``backend`` (a gloo or NCCL backend of ranks ``members``, this
    rank ``me`` among them), named ``name`` and registered with ``torch.distributed`` with the global ranks
    ``members`` (ascending order = group ranks), as ``new_group`` registers its groups."""
    members = sorted(members)
    pg = dist.ProcessGroup(store, members.index(me), len(members))
    kind = dist.ProcessGroup.BackendType.NCCL if backend_name == "nccl" else dist.ProcessGroup.BackendType.GLOO
    pg._set_default_backend(kind)
    pg._register_backend(torch.device(device.type), kind, backend)
    if backend_name == "nccl":
        pg.bound_device_id = device
    pg._set_group_name(name)
    pg._set_group_desc(name)
    world = c10d._world
    world.pg_map[pg] = (backend_name, store)
    world.pg_names[pg] = name
    world.pg_group_ranks[pg] = {g: i for i, g in enumerate(members)}
    world.pg_backend_config[pg] = f"{device.type}:{backend_name}"
    try:
        c10d._register_process_group(name, pg)  # found by name too (functional collectives, DTensor)
    except Exception:
        pass
    return pg


def unregister(pg) -> None:
    """Forget ``pg`` in ``torch.distributed``'s tables (``wrap``); its backend is released by ``Comms``."""
    world = c10d._world
    name = world.pg_names.pop(pg, None)
    world.pg_map.pop(pg, None)
    world.pg_group_ranks.pop(pg, None)
    world.pg_backend_config.pop(pg, None)
    world.pg_coalesce_state.pop(pg, None)
    if name is not None:
        try:
            c10d._unregister_process_group(name)
        except Exception:
            pass


class _Group:
    """The worker's state of one remote process group: its mesh, its sorted dims, per stream id the
    ``(ProcessGroup, backend)`` built by ``SplitCommForProcessGroup``, and whether its ref was deleted (it stays
    until every stream has passed the ``DeleteRefs``)."""

    __slots__ = ("ref_id", "mesh", "dims", "per_stream", "deleted")

    def __init__(self, ref_id: int, mesh, dims: tuple):
        self.ref_id = ref_id
        self.mesh = mesh
        self.dims = dims
        self.per_stream: dict = {}
        self.deleted = False


class _Release:
    """Queued on every stream at the ``DeleteRefs`` of a group: the last stream to reach it releases the group,
    so that the calls queued before the delete still find it."""

    __slots__ = ("remaining", "lock", "release")

    def __init__(self, count: int, release):
        self.remaining = count
        self.lock = threading.Lock()
        self.release = release

    def run(self, stream) -> None:
        with self.lock:
            self.remaining -= 1
            done = self.remaining == 0
        if done:
            self.release()


class ProcessGroups:
    """The remote process groups of one session on one worker (``TensorWorker.process_groups``)."""

    def __init__(self, tw):
        self.tw = tw
        #: every group of the session here, by ref id, deleted ones included until their release (``delete``):
        #: written by the dispatcher and by the stream that releases a group, read by the streams' calls
        self.groups: dict[int, _Group] = {}

    def create(self, msg) -> None:
        """``CreateRemoteProcessGroup``: remember ``(mesh, sorted dims)`` under ``msg.result`` (spec §5). Fatal for
        an unknown mesh, a ref that exists, or a dim the mesh does not have."""
        mesh = self.tw.device_meshes.get(msg.device_mesh.id)
        if mesh is None:
            raise FatalError(
                f"CreateRemoteProcessGroup {msg.result}: invalid device mesh id: {msg.device_mesh} (known meshes: "
                f"{sorted(self.tw.device_meshes)})"
            )
        if msg.result.id in self.groups:
            raise FatalError(f"CreateRemoteProcessGroup: remote process group {msg.result} already created")
        dims = tuple(sorted(msg.dims))
        unknown = [d for d in dims if d not in mesh.dims]
        if unknown or not dims:
            raise FatalError(
                f"CreateRemoteProcessGroup {msg.result}: dims {list(msg.dims)} must be dimensions of the mesh, "
                f"which has {mesh.names}"
            )
        self.groups[msg.result.id] = _Group(msg.result.id, mesh, dims)

    def split(self, msg, stream) -> None:
        """``SplitCommForProcessGroup``: build this rank's group of ``msg.remote_process_group`` for ``stream``
        (a ``StreamWorker``), in message order on every member. Fatal for an unknown group (the controller sends
        it only to the group's mesh) or a second split for the same stream."""
        group = self.groups.get(msg.remote_process_group.id)
        if group is None or group.deleted:
            raise FatalError(
                f"SplitCommForProcessGroup: invalid remote process group id: {msg.remote_process_group} "
                "(CreateRemoteProcessGroup must come first, on the ranks of its mesh)"
            )
        sid = stream.ref.id
        if sid in group.per_stream:
            raise FatalError(
                f"SplitCommForProcessGroup: comm already exists for remote process group {msg.remote_process_group} "
                f"on stream {sid}"
            )
        tw = self.tw
        comms = tw.comms
        try:
            members = group.mesh.get_ranks_for_dim_slice(group.dims)
        except MeshError as e:
            raise FatalError(f"SplitCommForProcessGroup: {e}") from None
        key = f"{comms.key}/pg/r{group.ref_id}/s{sid}/{','.join(map(str, sorted(members)))}"
        backend = comms.group(key, members)  # CommError: the caller names the message
        name = f"monarch/{tw.session_id}/pg{group.ref_id}/s{sid}/rank{tw.rank}"
        pg = wrap(backend, comms.backend, comms.device, members, tw.rank, name, comms.store(key + "/pg"))
        group.per_stream[sid] = (pg, backend)

    def for_call(self, refs, stream_id: int, what: str) -> dict:
        """``{ref id: ProcessGroup or NON_MEMBER}`` for the ``remote_process_groups`` of a call on stream
        ``stream_id`` (``what`` names it in errors)."""
        found = {}
        for ref in refs:
            # a group deleted after this call was sent (the controller dropped it, e.g. a temporary
            # mesh.process_group(...) argument) is still there until every stream has passed its DeleteRefs
            group = self.groups.get(ref.id)
            if group is None:  # not in the group's mesh: skipped cleanly
                found[ref.id] = NON_MEMBER
                continue
            entry = group.per_stream.get(stream_id)
            if entry is None:
                raise FatalError(
                    f"{what}: no comm found for remote process group {ref} on stream {stream_id} "
                    "(SplitCommForProcessGroup for that stream must come first)"
                )
            found[ref.id] = entry[0]
        return found

    def delete(self, ref_id: int) -> None:
        """``DeleteRefs`` of a group's ref: release it once every stream has run what was queued before. It stays
        in ``groups`` (marked deleted) until then, so that a call queued before the delete finds it whenever its
        stream runs it (see the module's docstring)."""
        group = self.groups.get(ref_id)
        if group is None or group.deleted:
            return
        group.deleted = True
        if not group.per_stream:  # never split here: no call can use it
            self.groups.pop(ref_id, None)
            return
        streams = list(self.tw.streams.values())
        release = _Release(len(streams), lambda: self._release(group))
        if not streams:
            release.release()
        for stream in streams:
            stream.enqueue(release)

    def _release(self, group: _Group) -> None:
        self.groups.pop(group.ref_id, None)
        entries, group.per_stream = list(group.per_stream.values()), {}
        for pg, backend in entries:
            unregister(pg)
            self.tw.comms.release(backend)

    def close(self) -> None:
        """The session ended: unregister every group (``Comms`` releases or aborts their backends)."""
        groups = list(self.groups.values())
        self.groups = {}
        for group in groups:
            for pg, _ in group.per_stream.values():
                unregister(pg)
            group.per_stream = {}
