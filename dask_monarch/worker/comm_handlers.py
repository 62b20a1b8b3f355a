"""``CommHandlers``: the ``TensorWorker`` handlers of the messages that build communicators and move tensors
between ranks (spec §5): ``BackendNetworkInit``, ``SplitComm``, ``BackendNetworkPointToPointInit``, ``SendTensor``,
``CreateRemoteProcessGroup`` and ``SplitCommForProcessGroup``. A mixin of ``TensorWorker`` (``tensor_worker.py``),
whose state (``comms``, ``streams``, ``device_meshes``, ``p2p``, ``process_groups``) they use.
"""

from __future__ import annotations

from ..protocol import (
    BackendNetworkInit,
    BackendNetworkPointToPointInit,
    CreateRemoteProcessGroup,
    SendTensor,
    SplitComm,
    SplitCommForProcessGroup,
)
from .comm import CommError
from .device_mesh import MeshError
from .errors import FatalError
from .process_group import wrap
from .send_tensor import Exchange, Take, plan

__all__ = ["CommHandlers"]


class CommHandlers:
    """The communicator handlers of ``TensorWorker`` (see the module's docstring)."""

    def backend_network_init(self, msg: BackendNetworkInit) -> None:
        """Build the world communicator (gloo on CPU, NCCL on CUDA) through the scheduler store, and one
        communicator per existing stream in ascending stream order, handed to the streams (spec §5; as in Monarch,
        ``Reduce`` then uses the ``SplitComm`` communicators)."""
        if self.comms.world is not None:
            raise FatalError("BackendNetworkInit: the backend network is already initialized for this session")
        try:
            per_stream = self.comms.init_world(msg.unique_id, list(self.streams))
        except CommError as e:
            raise FatalError(f"BackendNetworkInit: {e}") from None
        for sid, group in per_stream.items():
            self.streams[sid].comm = group

    def split_comm(self, msg: SplitComm) -> None:
        """Build the communicator of ``(stream, sorted dims)``; no-op without a world comm or on a rank that is
        not in the mesh (spec §5)."""
        if self.comms.world is None:
            return
        mesh = self.device_meshes.get(msg.device_mesh.id)
        if mesh is None:
            return
        self._stream(msg.stream, "SplitComm")
        dims = tuple(sorted(msg.dims))
        key = (msg.stream.id, dims)
        if key in mesh.comms:
            raise FatalError(f"SplitComm: a comm already exists for stream {msg.stream.id} and dims {dims}")
        try:
            members = mesh.get_ranks_for_dim_slice(dims)
            group = self.comms.split(msg.device_mesh.id, msg.stream.id, dims, members) if len(members) else None
        except (MeshError, CommError) as e:
            raise FatalError(f"SplitComm: {e}") from None
        mesh.comms[key] = (len(members), group)

    def backend_network_point_to_point_init(self, msg: BackendNetworkPointToPointInit) -> None:
        """Build the send/recv communicator of ``(from_stream, to_stream)`` over all ranks (spec §5), through the
        scheduler store; ``SendTensor`` between those streams uses it (``worker/send_tensor.py``)."""
        self._stream(msg.from_stream, "BackendNetworkPointToPointInit from_stream")
        self._stream(msg.to_stream, "BackendNetworkPointToPointInit to_stream")
        key = (msg.from_stream.id, msg.to_stream.id)
        if key in self.p2p:
            raise FatalError(f"BackendNetworkPointToPointInit: a comm already exists for streams {key}")
        comms = self.comms
        try:
            backend = comms.p2p(*key)
        except CommError as e:
            raise FatalError(f"BackendNetworkPointToPointInit {key}: {e}") from None
        name = f"monarch/{self.session_id}/p2p/s{key[0]}-s{key[1]}/rank{self.rank}"
        everyone = list(range(self.world_size))
        self.p2p[key] = wrap(backend, comms.backend, comms.device, everyone, self.rank, name,
                             comms.store(f"{comms.key}/p2p/s{key[0]}-s{key[1]}/pg"))

    def send_tensor(self, msg: SendTensor) -> None:
        """``SendTensor``: this rank's transfer runs on the from stream; what it receives is stored by the to
        stream, in its order (spec §5; ``worker/send_tensor.py``)."""
        p = plan(self, msg)
        p.from_stream.enqueue(Exchange(p))
        if p.handoff is not None:
            p.to_stream.enqueue(Take(p))

    def create_remote_process_group(self, msg: CreateRemoteProcessGroup) -> None:
        """Remember a process group over ``dims`` of a mesh (spec §5; ``worker/process_group.py``)."""
        self.process_groups.create(msg)

    def split_comm_for_process_group(self, msg: SplitCommForProcessGroup) -> None:
        """Build this rank's ``torch.distributed`` ProcessGroup of a remote process group for one stream (spec §5;
        ``worker/process_group.py``)."""
        stream = self._stream(msg.stream, "SplitCommForProcessGroup")
        try:
            self.process_groups.split(msg, stream)
        except CommError as e:
            raise FatalError(f"SplitCommForProcessGroup {msg.remote_process_group}: {e}") from None
