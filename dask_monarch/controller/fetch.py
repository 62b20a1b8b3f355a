"""``fetch_shard`` and ``inspect``: bring one rank's value to the controller (spec §1 "Fetch"); ``show``: display it;
the values of a remote function: ``call_on_shard_and_fetch`` (one rank's) and ``remote(f).call`` (every rank's, as a
``ValueMesh``).

A fetch sends ``SendValue`` (identity, or the function to call) to the ranks asked, then ``RequestStatus`` to every
rank; its future resolves once every rank has passed it, so a failure on any rank that the value depends on is known
by then. Tensors arrive on CPU. A value that depends on a failed invocation raises ``RemoteException``, as does a
function that raised.
"""

from __future__ import annotations

import operator

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from ..exceptions import RemoteException
from ..protocol import ArgsKwargs, SendValue
from .coalescing import refuse_wait
from .mesh import DeviceMesh, frontend, no_mesh
from .process_group import RemoteProcessGroup
from .remote import Remote, _mesh_of, pack_leaves, remote, sendable
from .future import MonarchFuture
from .stream import check_access, get_active_stream
from .table import display, grid, tensor_table
from .tensor import Tensor
from .value_mesh import ValueMesh

__all__ = ["call_on_shard_and_fetch", "collect", "fetch_call", "fetch_shard", "inspect", "show"]


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


def collect(session, seq: int, ranks: tuple, refs: list, what: str) -> list:
    """The values of fetch ``seq`` from ``ranks`` (in that order), once every rank has passed it (a future's
    ``on_done``): raises the failure the fetched refs ``refs`` depend on, or the ``RemoteException`` of a rank whose
    answer is an error (what the function raised), naming ``what``."""
    answers = session.take_fetch_results(seq)
    error = session.history.error_of(refs)
    if error is not None:
        session.history.consumed(error)
        raise error
    values = []
    for rank in ranks:
        answer = answers.get(rank)
        if answer is None:
            raise RuntimeError(f"{what}: rank {rank} answered Status but no FetchResult for seq {seq}")
        if answer.error is not None:
            for error in list(session.history.unconsumed.values()):
                if getattr(error, "seq", None) == seq:
                    session.history.consumed(error)
                    raise error
            raise RemoteException(seq, rank, session.workers[rank], answer.error.backtrace, what)
        values.append(answer.value)
    return values


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
            return collect(session, seq, (rank,), refs, "fetch_shard")[0]

        return session.sync(f"fetch_shard (seq {seq}) from rank {rank}", on_done=value, kind="fetch")


def inspect(obj, shard: dict | None = None, **coords):
    """``fetch_shard(obj, shard, **coords).result()`` (spec §1)."""
    return fetch_shard(obj, shard, **coords).result()


def show(obj, shard: dict | None = None, **coords) -> None:
    """Fetch ``obj`` from one rank and display it (Monarch's ``show``): ``inspect(obj, shard, **coords)``, so the
    rank is the mesh's first unless ``shard`` or keyword coordinates (``show(t, gpu=1)``) name another, and then
    each tensor in it is shown as a table of its values (floats to four decimals; more than 1000 elements as torch
    prints them), headed by where it sits in ``obj``, the rank's coordinates, its dtype and shape; other values as
    Python prints them. A ``ValueMesh`` (``remote(f).call(...).get()``) is shown as a table of every rank's value
    laid out over its dimensions. Inside a notebook kernel the tables are HTML (IPython's ``display``), elsewhere
    text on stdout. Returns None. Monarch draws tensors as images with the ``torchshow`` package; here they are
    tables, on a terminal too, with no extra dependency. Raises what ``fetch_shard`` raises."""
    if isinstance(obj, ValueMesh):
        display(grid(obj.names, list(obj.sizes.values()), [str(v) for v in obj.values()], "value of each rank"))
        return
    value = inspect(obj, shard, **coords)
    where = _coords_text(obj, {**(shard or {}), **coords})
    with no_mesh.activate():  # the fetched values are local tensors: local torch, even under mesh.activate()
        for path, leaf in tree_flatten_with_path(value)[0]:
            title = f"{where}{keystr(path)}"
            if isinstance(leaf, torch.Tensor):
                display(tensor_table(leaf, title))
            else:
                display(grid([], [], [repr(leaf)], title))


def _coords_text(obj, coords: dict) -> str:
    """``"rank 3 (host=1, gpu=1)"``: the rank ``show`` fetched ``obj`` from."""
    tensors = [x for x in tree_flatten(obj)[0] if isinstance(x, Tensor)]
    if not tensors:
        return "local value"
    mesh = tensors[0].mesh
    rank = _rank_of(mesh, coords)
    shown = ", ".join(f"{n}={c}" for n, c in zip(mesh.names, mesh.processes.coordinates(rank)))
    return f"rank {rank} ({shown})" if shown else f"rank {rank}"


def fetch_call(fn: Remote, args: tuple, kwargs: dict, shard: dict | None, every: bool) -> MonarchFuture:
    """Run remote function ``fn`` on ranks of the mesh of its arguments (else the active mesh) and fetch the values:
    every rank's as a ``ValueMesh`` (``every``), the rank at ``shard`` (a dict dim -> coordinate; ``{}``: the mesh's
    first rank), or, with ``shard`` None, the only rank of a one-rank mesh. One ``SendValue`` of the function on
    the active stream; the inputs ``fn``'s ``propagate`` writes (if it is a function) are its ``mutates``.

    Raises at the call ``ValueError`` (no mesh, or ``shard`` None on a mesh of several ranks), ``KeyError``/
    ``IndexError``/``TypeError`` for bad coordinates, ``TypeError`` for a process group among the arguments and
    the client checks (LOCAL_TENSOR, WRONG_MESH, WRONG_STREAM, DROPPED), ``RuntimeError`` inside ``coalescing()`` or
    a compiled function; the future raises ``RemoteException`` if the function raised on a rank (or an input
    depends on a failure) and ``SessionError`` if the session failed."""
    name = fn.__name__
    leaves, spec = tree_flatten((args, kwargs))
    mesh = _mesh_of(leaves)
    if any(isinstance(x, RemoteProcessGroup) for x in leaves):
        raise TypeError(f"{name}: a process group among the arguments of a fetched call; its collectives need a "
                        "call that stays on the mesh (call the function, then fetch its result)")
    if every:
        ranks = mesh._rank_list
    elif shard is None:
        if len(mesh._rank_list) != 1:
            raise ValueError(f"{name}.call_one on a mesh of {len(mesh._rank_list)} ranks {mesh.sizes}: it needs a "
                             "mesh of one rank (mesh.slice(...)); use call() or call_on_shard_and_fetch(shard=...)")
        ranks = mesh._rank_list
    else:
        if not isinstance(shard, dict):
            raise TypeError(f"call_on_shard_and_fetch: shard must be a dict of dimension -> coordinate, got {shard!r}")
        ranks = (_rank_of(mesh, shard),)
    refuse_wait(f"{name} fetched from {len(ranks)} rank(s)")  # before anything is sent
    inputs, sent_args, sent_kwargs = sendable(leaves, spec, args, kwargs, name)
    written = fn.writes(args, kwargs)
    session = mesh._session
    stream = get_active_stream()
    with session.lock:
        session.check_ok()
        stream_ref = stream.ref_for(session)
        check_access(stream, inputs, written)
        mutates = session.aliases_of(written)
        session.follow_default_dtype(stream_ref)
        seq = session.new_seq()
        session.record(seq, defs=mutates, uses=inputs, what=name)
        session.send(SendValue(seq, None, [t.ref for t in mutates], fn.function,
                               ArgsKwargs(tuple(sent_args), dict(sent_kwargs)), stream_ref), ranks)
        refs = [t.ref.id for t in inputs]

        def value():
            values = collect(session, seq, ranks, refs, name)
            return ValueMesh(mesh.names, mesh.processes.sizes, values) if every else values[0]

        return session.sync(f"{name} (seq {seq}) on {len(ranks)} rank(s)", on_done=value, kind="fetch")


def call_on_shard_and_fetch(fn, *args, shard: dict | None = None, **kwargs) -> MonarchFuture:
    """Run ``fn`` on one rank and fetch its value (Monarch's ``call_on_shard_and_fetch``): a ``MonarchFuture`` whose
    ``result()``/``get()`` is what the function returned there, tensors as CPU copies. ``fn`` is a ``remote(...)``
    function or anything ``remote`` takes (a function, a dotted path); ``shard`` a dict of dimension -> coordinate
    (default: the mesh's first rank; otherwise give every dimension). Without a ``propagate`` function no
    argument is taken to be written (Monarch's rule). Errors as ``fetch_call``'s."""
    if not isinstance(fn, Remote):
        fn = remote(fn)
    return fetch_call(fn, args, kwargs, {} if shard is None else shard, False)


frontend.fetch_call = fetch_call
