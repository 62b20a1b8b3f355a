"""``to_mesh`` and ``slice_mesh``: copy remote tensors from one mesh of a session to another (spec §1
"to_mesh", §5 ``SendTensor``; Monarch's ``Tensor.to_mesh``, ``Tensor.slice_mesh``, ``monarch.to_mesh``,
``monarch.slice_mesh``).

``t.to_mesh(mesh, stream=None)`` returns a new tensor on ``mesh`` (on ``stream``, default ``t``'s stream) that
holds, on each rank of ``mesh``, a copy of ``t`` from the rank of ``t``'s mesh with the same coordinates along
the dims they share. Every dim of the source must exist in the destination with the same size; a destination
dim the source lacks is *broadcast* (every source rank sends once per coordinate of it; a ``UserWarning`` says
so). ``t.slice_mesh(host=0)`` restricts the source to a sub-mesh first (then only ``.to_mesh`` works on it):
``t.slice_mesh(host=0).to_mesh(t.mesh)`` broadcasts host 0's values to every host. It is always a copy, also
to the same mesh (a later in-place write to ``t`` does not show in the copy), contiguous, with ``t``'s shape
and dtype.

Messages: ``BackendNetworkPointToPointInit(from stream, to stream)`` to every rank, once per stream pair of the
session; then one ``SendTensor`` per destination slice (one without broadcast) to the union of the sending and
receiving ranks. The result depends on ``t`` in the controller's dependency graph: if ``t`` failed (or fails
later), fetching the result raises that failure (the workers send zeros in its place, so no peer waits).
"""

from __future__ import annotations

import itertools
import warnings
import weakref

import torch
from torch.utils._pytree import tree_map

from ..protocol import BackendNetworkPointToPointInit, Factory, SendTensor, Slice
from .local import propagating
from .mesh import DeviceMesh, frontend
from .stream import Stream, check_access
from .tensor import Tensor

__all__ = ["MeshSliceTensor", "to_mesh", "slice_mesh", "send"]

#: per session: the ``(from stream id, to stream id)`` pairs whose communicator was asked for
_p2p_pairs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class MeshSliceTensor:
    """Remote tensor ``tensor`` restricted to ``slicing``, a sub-mesh of its mesh (``Tensor.slice_mesh``): the
    source of a ``to_mesh``, and nothing else."""

    def __init__(self, tensor: Tensor, slicing: DeviceMesh):
        self.tensor = tensor
        self.slicing = slicing

    def to_mesh(self, mesh: DeviceMesh, stream: Stream | None = None) -> Tensor:
        """Copy to ``mesh``; see the module docstring (spec §1 "to_mesh")."""
        return send(self.tensor, self.slicing, mesh, stream)

    def slice_mesh(self, **selection) -> "MeshSliceTensor":
        """The same tensor restricted further, to ``self.slicing.slice(**selection)``."""
        return MeshSliceTensor(self.tensor, self.slicing.slice(**selection))

    def __repr__(self) -> str:
        return f"MeshSliceTensor({self.tensor!r} on {self.slicing!r})"


def _from_ranks(slicing: DeviceMesh, mesh: DeviceMesh) -> tuple[Slice, list]:
    """The source ranks in the destination's dim order (``from_ranks``), and the destination dims the source
    lacks (broadcast). ``ValueError`` for a source dim missing in the destination or of another size."""
    sizes, strides, broadcast = [], [], []
    src_sizes = slicing.sizes
    for name, size in zip(mesh.names, mesh.processes.sizes):
        if name not in src_sizes:
            broadcast.append(name)
            continue
        if src_sizes[name] != size:
            raise ValueError(
                f"to_mesh: dimension {name!r} has size {size} in the destination mesh {mesh!r} but size "
                f"{src_sizes[name]} in the source {slicing!r}; the dimensions they share must have the same sizes"
            )
        sizes.append(size)
        strides.append(slicing.processes.strides[slicing.names.index(name)])
    missing = [n for n in slicing.names if n not in mesh.sizes]
    if missing:
        raise ValueError(
            f"to_mesh: the destination mesh {mesh!r} does not have dimensions {missing} of the source {slicing!r} "
            f"(slice them away first: t.slice_mesh({missing[0]}=0).to_mesh(...))"
        )
    return Slice(slicing.processes.offset, sizes, strides), broadcast


def send(tensor: Tensor, slicing: DeviceMesh, mesh: DeviceMesh, stream: Stream | None = None) -> Tensor:
    """Copy ``tensor`` (restricted to ``slicing``, its mesh or a sub-mesh of it) to ``mesh`` on ``stream``
    (default: the tensor's stream) and return the copy (spec §1 "to_mesh").

    Raises ``TypeError`` for a non-remote tensor, a non-mesh ``mesh``, a non-``Stream`` stream, a dropped tensor
    (DROPPED), a mutably borrowed one (BORROWED), one that requires grad while grad is enabled (REQUIRES_GRAD;
    ``.detach()`` it, and send its gradient back with another ``to_mesh``), or a mesh of another session
    (WRONG_MESH); ``ValueError`` for dims that do not match (see ``_from_ranks``)."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"to_mesh needs a remote dask_monarch.Tensor, got {type(tensor).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"to_mesh: mesh must be a dask_monarch.DeviceMesh, got {type(mesh).__name__}")
    if stream is not None and not isinstance(stream, Stream):
        raise TypeError(f"to_mesh: stream must be a dask_monarch.Stream or None, got {type(stream).__name__}")
    tensor.check_usable()
    session = tensor.mesh._session
    if mesh._session is not session:
        raise TypeError(
            f"WRONG_MESH: to_mesh: the destination {mesh!r} belongs to another session than the tensor "
            f"{tensor.ref!r} ({tensor.mesh!r})"
        )
    if torch.is_grad_enabled() and tensor.requires_grad:
        raise TypeError(
            f"REQUIRES_GRAD: to_mesh of tensor {tensor.ref!r}, which requires grad, is not supported (autograd "
            "does not cross meshes): send t.detach(), call requires_grad_() on the copy, and send its .grad back "
            "with to_mesh"
        )
    from_ranks, broadcast = _from_ranks(slicing, mesh)
    if broadcast:
        warnings.warn(
            f"to_mesh is broadcasting along {broadcast}: every source rank sends its tensor once per coordinate of "
            f"{'that dimension' if len(broadcast) == 1 else 'those dimensions'}",
            UserWarning, stacklevel=3,
        )
        coords = itertools.product(*(range(mesh.sizes[d]) for d in broadcast))
        destinations = [mesh.slice(**dict(zip(broadcast, c))).processes for c in coords]
    else:
        destinations = [mesh.processes]
    stream = stream or tensor.stream
    fake = tensor._fake
    with session.lock:
        session.check_ok()
        check_access(tensor.stream, [tensor], [])  # borrows: BORROWED, and a borrowed tensor's first use
        from_ref = tensor.stream.ref_for(session)
        to_ref = stream.ref_for(session)
        pairs = _p2p_pairs.setdefault(session, set())
        if (from_ref.id, to_ref.id) not in pairs:
            pairs.add((from_ref.id, to_ref.id))
            session.send(BackendNetworkPointToPointInit(from_ref, to_ref))
        with propagating(), session.fake_mode:  # a local fake, also under mesh.activate() (dispatch.py)
            copy_fake = torch.empty(fake.shape, dtype=fake.dtype, device=fake.device)
        result = Tensor(session.new_ref(), copy_fake, mesh, stream)
        seq = session.new_seq()
        session.record(seq, defs=[result], uses=[tensor], what=f"to_mesh({tensor.ref!r} -> {mesh!r})")
        factory = Factory.from_tensor(fake)
        senders = set(from_ranks)
        for to_ranks in destinations:
            session.send(
                SendTensor(result.ref, from_ranks, to_ranks, tensor.ref, factory, from_ref, to_ref, seq),
                sorted(senders | set(to_ranks)),
            )
    return result


def _local(what: str, x) -> TypeError:
    return TypeError(
        f"LOCAL_TENSOR: {what} got a local torch.Tensor (shape {list(x.shape)}) among its leaves; it moves remote "
        "tensors between meshes: make it on the mesh first (e.g. under mesh.activate()), or keep it out of the tree"
    )


def _leaf_to_mesh(mesh, stream):
    def move(x):
        if isinstance(x, (Tensor, MeshSliceTensor)):
            return x.to_mesh(mesh, stream)
        if isinstance(x, torch.Tensor):
            raise _local("to_mesh", x)
        return x

    return move


def to_mesh(tensors, mesh: DeviceMesh, stream: Stream | None = None):
    """``to_mesh`` of every remote tensor (or ``MeshSliceTensor``) of the pytree ``tensors``; other leaves (not
    tensors) are kept. Returns the same structure (spec §1 "to_mesh", pytree form). Raises as ``Tensor.to_mesh``
    does, and ``TypeError`` (LOCAL_TENSOR) for a local ``torch.Tensor`` leaf."""
    return tree_map(_leaf_to_mesh(mesh, stream), tensors)


def _leaf_slice(selection):
    def cut(x):
        if isinstance(x, (Tensor, MeshSliceTensor)):
            return x.slice_mesh(**selection)
        if isinstance(x, torch.Tensor):
            raise _local("slice_mesh", x)
        return x

    return cut


def slice_mesh(tensors, **selection):
    """``t.slice_mesh(**selection)`` of every remote tensor of the pytree ``tensors`` (``MeshSliceTensor``s, for
    ``to_mesh``); other leaves (not tensors) are kept. ``selection`` is as for ``DeviceMesh.slice`` (``KeyError``
    for an unknown dim, ``IndexError`` out of range); ``TypeError`` (LOCAL_TENSOR) for a local ``torch.Tensor``
    leaf."""
    return tree_map(_leaf_slice(selection), tensors)


frontend.to_mesh = send
frontend.slice_mesh = MeshSliceTensor
