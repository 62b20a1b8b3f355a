"""``fetch_shard`` and ``inspect``: bring one rank's value to the controller (spec §1 "Fetch").

A fetch sends ``SendValue`` (identity) to one rank, then ``RequestStatus`` to every rank; its future resolves
once every rank has passed it, so a failure on any rank that the value depends on is known by then. Tensors
arrive on CPU. A value that depends on a failed invocation raises ``RemoteException``.
"""

from __future__ import annotations

import operator

from torch.utils._pytree import tree_flatten, tree_unflatten

from ..exceptions import RemoteException
from ..protocol import ArgsKwargs, SendValue
from .coalescing import refuse_wait
from .mesh import DeviceMesh
from .remote import pack_leaves
from .future import MonarchFuture
from .stream import check_access
from .tensor import Tensor

__all__ = ["fetch_shard", "inspect"]


class _Done(MonarchFuture):
    futures = ()  # nothing to wait for

    def __init__(self, value):
        self._value = value

    def done(self) -> bool:
        return True

    def result(self, timeout=None):
        return self._value


def _rank_of(mesh: DeviceMesh, coords: dict) -> int:
    unknown = sorted(set(coords) - set(mesh.names))
    if unknown:
        raise KeyError(f"{unknown} are not dimensions of the mesh; its dimensions are {list(mesh.names)}")
    if not coords:
        return mesh.processes.get(0)
    missing = [d for d in mesh.names if d not in coords]
    if missing:
        raise ValueError(f"fetch_shard: give a coordinate for every dimension of the mesh; missing {missing}")
    index = []
    for name, size in zip(mesh.names, mesh.processes.sizes):
        c = coords[name]
        try:
            if isinstance(c, bool):
                raise TypeError
            c = operator.index(c)  # ints, and numpy's
        except TypeError:
            raise TypeError(f"fetch_shard: coordinate {name}={coords[name]!r} must be an int") from None
        if not 0 <= c < size:
            raise IndexError(f"fetch_shard: coordinate {name}={c!r} out of range for size {size}")
        index.append(c)
    return mesh.processes.location(index)


def fetch_shard(obj, shard: dict | None = None, **coords) -> MonarchFuture:
    """Fetch the value of ``obj`` (a remote ``Tensor`` or a pytree holding them) on one rank.

    The rank is given by ``shard`` (a dict dim -> coordinate) or keyword coordinates; by default the mesh's
    first rank, otherwise every dim must be given. Returns a future whose ``result(timeout=None)`` gives ``obj``
    with every remote tensor replaced by a CPU ``torch.Tensor``. Raises ``KeyError``/``ValueError``/
    ``IndexError`` for bad coordinates, ``TypeError`` (DROPPED) for a dropped tensor; the future raises ``RemoteException`` if the value depends on a failed
    invocation (on any rank), ``SessionError`` if the session failed.
    """
    if shard is not None and not isinstance(shard, dict):
        raise TypeError(f"fetch_shard: shard must be a dict of dimension -> coordinate, got {shard!r}")
    coords = {**(shard or {}), **coords}
    leaves, spec = tree_flatten(obj)
    tensors = [x for x in leaves if isinstance(x, Tensor)]
    if not tensors:
        return _Done(obj)
    for t in tensors:
        t.check_usable()  # TypeError DROPPED
    mesh = tensors[0].mesh
    for t in tensors[1:]:
        if t.mesh._session is not mesh._session:
            raise TypeError(
                f"WRONG_MESH: fetch_shard of tensors of another session ({t.ref} of session "
                f"{t.mesh._session.tag}, {tensors[0].ref} of session {mesh._session.tag})"
            )
        if t.mesh._rank_list != mesh._rank_list:
            raise TypeError("WRONG_MESH: fetch_shard of tensors on different meshes")
    rank = _rank_of(mesh, coords)
    refuse_wait(f"fetch_shard from rank {rank}")  # before the SendValue: a refused fetch leaves nothing in the block
    packed = pack_leaves(leaves, "fetch_shard")
    sent = obj if packed is None else tree_unflatten(packed, spec)
    session = mesh._session
    refs = [t.ref.id for t in tensors]
    stream = tensors[0].stream  # a fetch runs on its tensors' stream
    with session.lock:
        session.check_ok()
        check_access(stream, tensors, [])
        seq = session.new_seq()
        session.record(seq, defs=[], uses=tensors, what="fetch_shard")
        session.send(SendValue(seq, None, [], None, ArgsKwargs((sent,), {}), stream.ref_for(session)), [rank])

        def value():
            answer = session.take_fetch_result(seq)
            error = session.history.error_of(refs)
            if error is not None:
                session.history.consumed(error)
                raise error
            if answer is None:
                raise RuntimeError(f"fetch_shard: rank {rank} answered Status but no FetchResult for seq {seq}")
            if answer.error is not None:
                for error in list(session.history.unconsumed.values()):
                    if getattr(error, "seq", None) == seq:
                        session.history.consumed(error)
                        raise error
                raise RemoteException(seq, rank, session.workers[rank], answer.error.backtrace, "fetch_shard")
            return answer.value

        return session.sync(f"fetch_shard (seq {seq}) from rank {rank}", on_done=value, kind="fetch")


def inspect(obj, shard: dict | None = None, **coords):
    """``fetch_shard(obj, shard, **coords).result()`` (spec §1)."""
    return fetch_shard(obj, shard, **coords).result()
