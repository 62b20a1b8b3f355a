"""``SendTensor`` on the worker: the point-to-point copies behind ``to_mesh`` (spec §5 ``SendTensor``,
``BackendNetworkPointToPointInit``; §7; DESIGN.md "Decisions").

A ``SendTensor{result, from_ranks, to_ranks, tensor, factory, from_stream, to_stream}`` goes to the union of
both slices. Ranks pair by row-major index: this rank sends to ``to_ranks[from_ranks.index(me)]`` if it is a
sender and receives from ``from_ranks[to_ranks.index(me)]`` if it is a receiver; a rank paired with itself
copies (a deep copy: ``to_mesh`` always copies). A sender-only rank does not define ``result``; a receiver-only
rank never reads ``tensor``.

Where it runs: every transfer runs on the *from* stream's thread, in message order, over the ``(from_stream,
to_stream)`` communicator (``BackendNetworkPointToPointInit``: all ranks, gloo on CPU, NCCL on GPU). A rank that
sends and receives in one message does both at once (``torch.distributed.batch_isend_irecv``: one NCCL group), so
exchanges that form cycles (a mesh transposed onto itself) never deadlock. When ``to_stream`` differs from
``from_stream``, the received tensor is handed to the to stream (``Handoff``, with a CUDA event on GPU), which
stores it at its own place in its order. So, unlike Monarch, a rank may send and receive across two different
streams; and on every rank each communicator is used by one thread only, its ops in the same order everywhere.

Errors: an errored input is sent as ``zeros(factory)`` (the receiver never waits) and the sender's own copy, if
it has one, carries the dependent error; the controller marks the result failed on every rank (its dependency
graph). A sender whose input does not match ``factory`` (shape or dtype) sends zeros too and reports a root
failure under ``seq``. NCCL moves only CUDA tensors: a CPU tensor between two ranks of a GPU session is refused
on every rank alike (decided from ``factory``: nobody waits), as a value error. A transfer that fails or times
out (``comm_timeout``) fails the session, naming the peer.

In a recording (spec §7), the sending side's errored input becomes the recording's error; the transfer still
runs after a failure (``skip``), so that peers never wait for it.
"""

from __future__ import annotations

import queue
import time

import torch
import torch.distributed as dist

from ..protocol import WorkerError
from . import comm
from .borrow import SessionOver, _record
from .errors import FatalError, SeqError
from .steps import Failed
from .reduce import _mismatch

__all__ = ["Handoff", "Plan", "plan", "Exchange", "Take", "SendStep", "TakeStep"]

_MISSING = object()
_POLL = 0.2  # seconds between checks of the session's state while the to stream waits for the from stream


class Handoff:
    """The tensor a from stream received (or copied) for a to stream: a queue of ``(CUDA event or None, value)``,
    first in first out (a recording's replays use one handoff, in call order on both streams)."""

    __slots__ = ("_queue",)

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, stream, value) -> None:
        self._queue.put((_record(stream, value), value))

    def take(self, stream, plan: "Plan"):
        """On the to stream: wait (bounded by ``comm_timeout``; at once ``SessionOver`` if the session ends) for
        the value, make the CUDA stream wait for it, and return it."""
        tw = stream.tw
        timeout = tw.comms.timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                event, value = self._queue.get(timeout=_POLL)
                break
            except queue.Empty:
                pass
            if tw.failure is not None or tw.closed:
                raise SessionOver()
            if time.monotonic() >= deadline:
                peer = plan.from_stream
                raise FatalError(
                    f"SendTensor {plan.msg.result}: stream {peer.ref.id} did not hand over the received tensor "
                    f"within {timeout:g} s (comm_timeout); it is still running earlier work: {peer.applied} "
                    f"messages applied, {peer.backlog()} batches queued"
                )
        if event is not None:
            stream.cuda_stream.wait_event(event)
            value.record_stream(stream.cuda_stream)  # the allocator must not reuse it before our work is done
        return value


class Plan:
    """What this rank does for one ``SendTensor``: ``to_rank`` (it sends there) and/or ``from_rank`` (it
    receives from there), the streams, the communicator (None when it only copies), the ``Handoff`` to the to
    stream (None when ``result`` is stored by the from stream, or not at all), and ``refused`` (why the backend
    cannot move the tensor, or None)."""

    __slots__ = ("msg", "me", "to_rank", "from_rank", "from_stream", "to_stream", "group", "handoff", "refused",
                 "device")

    @property
    def defines_on_from(self) -> bool:
        """Whether the from stream stores ``result`` itself (this rank receives or copies, on one stream)."""
        return self.from_rank is not None and self.handoff is None


def _pair(mine, other, me: int):
    """``other[mine.index(me)]``, or None if ``me`` is not in ``mine``."""
    try:
        index = mine.index(me)
    except ValueError:
        return None
    return other.get(index)


def plan(tw, msg, what: str = "SendTensor") -> Plan:
    """This rank's part of ``msg`` (spec §5 "Pairing"). Fatal: slices of different sizes, a rank in neither, an
    unknown stream, or no communicator for the stream pair when this rank talks to another."""
    if len(msg.from_ranks) != len(msg.to_ranks):
        raise FatalError(
            f"{what} {msg.result}: from_ranks {msg.from_ranks} has {len(msg.from_ranks)} ranks but to_ranks "
            f"{msg.to_ranks} has {len(msg.to_ranks)}: they pair one to one"
        )
    me = tw.rank
    p = Plan()
    p.msg = msg
    p.me = me
    p.to_rank = _pair(msg.from_ranks, msg.to_ranks, me)
    p.from_rank = _pair(msg.to_ranks, msg.from_ranks, me)
    if p.to_rank is None and p.from_rank is None:
        raise FatalError(
            f"{what} {msg.result}: rank {me} is in neither from_ranks {msg.from_ranks} nor to_ranks {msg.to_ranks}"
        )
    p.from_stream = tw._stream(msg.from_stream, f"{what} {msg.result} from_stream")
    p.to_stream = tw._stream(msg.to_stream, f"{what} {msg.result} to_stream") if p.from_rank is not None else None
    p.handoff = Handoff() if p.to_stream is not None and p.to_stream is not p.from_stream else None
    p.group = None
    p.refused = None
    remote = p.to_rank not in (None, me) or p.from_rank not in (None, me)
    factory = msg.factory
    p.device = tw.device if factory.device.type == "cuda" else torch.device("cpu")
    if remote:
        key = (msg.from_stream.id, msg.to_stream.id)
        p.group = tw.p2p.get(key)
        if p.group is None:
            raise FatalError(
                f"{what} {msg.result}: could not find stream to stream comm for {key}: "
                "BackendNetworkPointToPointInit for those streams must come first"
            )
        if tw.comms.backend == "nccl" and factory.device.type != "cuda":
            p.refused = (f"nccl moves CUDA tensors between ranks, and this one is on {factory.device}: move it to "
                         "the GPU first (e.g. t.to('cuda'))")
    return p


def _root_error(stream, p: Plan, text: str) -> SeqError:
    """A root failure of ``p``'s message: reported as ``RemoteFunctionFailed{seq}`` when the controller gave the
    seq (raw messages without one only store it)."""
    text = f"SendTensor into {p.msg.result}: {text}"
    if p.msg.seq is None:
        return SeqError(-1, WorkerError(text, stream.tw.actor_id))
    return stream._root_error(p.msg.seq, text)


def exchange(stream, p: Plan):
    """On the from stream: send and/or receive (or copy) for ``p``, and store or hand over what this rank
    receives. Returns the error the sending side had (an errored or mismatched input, or a refusal), or None."""
    msg = p.msg
    factory = msg.factory
    env = stream.env
    error = None
    value = None
    if p.to_rank is not None:
        value = env.get(msg.tensor.id, _MISSING)
        if value is _MISSING:
            raise FatalError(f"SendTensor.tensor: ref not found: {msg.tensor} on stream {stream.ref.id}")
        if type(value) is SeqError:
            error, value = value, factory.zeros(p.device)
        else:
            problem = _mismatch(value, factory.size, factory.dtype)
            if problem is not None:
                error = _root_error(stream, p, (
                    f"the input {msg.tensor} {problem}; every rank must send a tensor of the shape and dtype the "
                    "controller computed (from the function's propagate), so this rank sent zeros"
                ))
                value = factory.zeros(p.device)
    if p.to_rank == p.me:  # paired with itself: a copy, or the input's error
        _store(stream, p, error if error is not None else value.clone(memory_format=torch.contiguous_format))
        return error
    buffer = factory.empty(device=p.device) if p.from_rank is not None else None
    if p.refused is not None:  # every rank refuses alike (the factory is the same): nobody waits
        refusal = _root_error(stream, p, p.refused)
        error = error or refusal
        if buffer is not None:
            _store(stream, p, refusal)
        return error
    _transfer(p, value, buffer, stream.tw.comms)
    if buffer is not None:
        _store(stream, p, buffer)
    return error


def _transfer(p: Plan, value, buffer, comms) -> None:
    """Send ``value`` to ``p.to_rank`` and/or receive into ``buffer`` from ``p.from_rank``, at once (one group
    of point-to-point ops), and wait. ``FatalError`` naming the peers if it fails or times out."""
    ops = []
    peers = []
    if value is not None:
        ops.append(dist.P2POp(dist.isend, value.contiguous(), group=p.group, group_peer=p.to_rank))
        peers.append(f"send to rank {p.to_rank}")
    if buffer is not None:
        ops.append(dist.P2POp(dist.irecv, buffer, group=p.group, group_peer=p.from_rank))
        peers.append(f"receive from rank {p.from_rank}")
    what = f"SendTensor into {p.msg.result} (" + " and ".join(peers) + ")"
    try:
        try:
            works = comms.post(what, lambda: dist.batch_isend_irecv(ops), p.group, pending=True)
        except comm.CommError:
            raise
        except Exception as e:
            raise comm.CommError(f"{what} could not start: {type(e).__name__}: {e}") from None
        try:
            for work in works:
                _wait(work, what, comms)
        finally:
            comms.done(works)
    except comm.CommError as e:
        raise FatalError(str(e)) from None


def _wait(work, what: str, comms) -> None:
    """Wait for a point-to-point ``work`` until it is done. Not in slices as ``comm._wait`` waits for
    collectives: a gloo receive whose wait times out closes its pair ("Application timeout caused pair
    closure"). The group's own timeout (``comm_timeout``) bounds it, and the session's end (``Comms.abort`` or
    ``shutdown``) ends it at once: it shuts the group's connections down and aborts the work (``gloo.abort_work``),
    whose ``wait()`` then returns False, also for a transfer that was under way when its peer died."""
    try:
        completed = work.wait()
    except Exception as e:
        if comms.stopped.is_set():
            raise comm.CommError(f"{what} abandoned: {comms.stop_reason}") from None
        if "imeout" in str(e) or "imed out" in str(e):
            raise comm.CommError(
                f"{what} did not complete within comm_timeout={comms.timeout:g} s: the peer did not reach it in time "
                f"(still busy with earlier work, stopped, or not at this transfer): {type(e).__name__}: {e}"
            ) from None
        raise comm.CommError(f"{what} failed: {type(e).__name__}: {e}") from None
    if completed is False:  # aborted (Comms.abort/shutdown): the session stopped
        raise comm.CommError(f"{what} abandoned: {comms.stop_reason}")


def _store(stream, p: Plan, value) -> None:
    """``result`` takes ``value`` (replacing what it held, as in Monarch: comm.rs send_tensor_local), here or,
    through the handoff, on the to stream."""
    if p.handoff is not None:
        p.handoff.put(stream, value)
    else:
        stream.env[p.msg.result.id] = value


def take(stream, p: Plan):
    """On the to stream: store what the from stream handed over under ``result``; returns it."""
    value = p.handoff.take(stream, p)
    stream.env[p.msg.result.id] = value
    return value


# --------------------------------------------------------------------------------------- eager queue items
class Exchange:
    """Queued on the from stream by the dispatcher (``TensorWorker.send_tensor``)."""

    __slots__ = ("plan",)

    def __init__(self, p: Plan):
        self.plan = p

    def run(self, stream) -> None:
        exchange(stream, self.plan)


class Take:
    """Queued on the to stream when it differs from the from stream and this rank receives."""

    __slots__ = ("plan",)

    def __init__(self, p: Plan):
        self.plan = p

    def run(self, stream) -> None:
        take(stream, self.plan)


# ----------------------------------------------------------------------------------------- recording steps
class SendStep:
    """A recorded ``SendTensor`` on the from stream's program (``worker/replay.py`` step protocol): runs like an
    eager one, also after the recording failed (peers wait for it); an errored input fails the recording."""

    __slots__ = ("plan", "index", "name")
    #: why a CUDA graph cannot hold it (``worker/graphs.py``)
    graph_refusal = "a to_mesh (SendTensor) cannot be captured in a CUDA graph"

    def __init__(self, p: Plan):
        self.plan = p
        self.index = p.msg.seq
        self.name = f"to_mesh into {p.msg.result} ({p.msg.from_ranks} -> {p.msg.to_ranks})"

    def prepare(self, tw) -> None:
        pass

    def run(self, stream, env, call) -> None:
        error = exchange(stream, self.plan)
        if error is not None:
            raise Failed(error)

    def failed(self, stream, env, error) -> SeqError:
        if type(error) is Failed:
            return error.error
        raise error

    def skip(self, stream, env, call, err) -> None:
        exchange(stream, self.plan)


class TakeStep:
    """A recorded ``SendTensor`` on the to stream's program: takes what the from stream handed over; after a
    failure it still takes it (the from stream always hands it over)."""

    __slots__ = ("plan", "index", "name")
    graph_refusal = SendStep.graph_refusal

    def __init__(self, p: Plan):
        self.plan = p
        self.index = None
        self.name = f"to_mesh into {p.msg.result} (from stream {p.msg.from_stream.id})"

    def prepare(self, tw) -> None:
        pass

    def run(self, stream, env, call) -> None:
        value = take(stream, self.plan)
        if type(value) is SeqError:
            raise Failed(value)

    def failed(self, stream, env, error) -> SeqError:
        if type(error) is Failed:
            return error.error
        raise error

    def skip(self, stream, env, call, err) -> None:
        take(stream, self.plan)
