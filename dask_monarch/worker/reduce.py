"""The ``Reduce`` handler of a stream (spec §5 table; seed ``Reduce``): all-reduce, reduce-scatter, all-gather
(``stack``) and all-to-all over mesh dimensions, on the communicator that ``SplitComm`` made for the stream.

``ReduceHandler`` is a base of ``StreamWorker`` (``stream.py``): its method runs on the stream's thread, with the
stream's ref table.
"""

from __future__ import annotations

import torch

from ..protocol import Reduction, WorkerError
from . import comm
from .errors import FatalError, SeqError

__all__ = ["ReduceHandler"]

_MISSING = object()


def _mismatch(value, shape, dtype, layout=torch.strided) -> str | None:
    """Why ``value`` cannot stand for a tensor of ``shape``, ``dtype`` and ``layout`` in a collective, or None if it
    can."""
    if not isinstance(value, torch.Tensor):
        return f"is a {type(value).__name__}, not a tensor"
    if value.layout != layout:  # gloo fails a sparse one only after the exchange, and the session with it
        return (f"has layout {value.layout}, but the controller expects {layout} (collectives take dense tensors: "
                "t.to_dense())")
    if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
        return (
            f"has shape {list(value.shape)} and dtype {value.dtype}, but the controller expects shape "
            f"{list(shape)} and dtype {dtype}"
        )
    return None


def _reduce_shape(shape, reduction, scatter: bool, size: int) -> tuple:
    """The output shape of a ``Reduce`` of input ``shape`` over ``size`` ranks (spec §5 table)."""
    shape = tuple(shape)
    if reduction is Reduction.Stack:
        return shape if scatter else (size, *shape)
    return shape[1:] if scatter else shape


class ReduceHandler:
    """``StreamWorker.reduce``; the stream supplies ``tw``, ``ref``, ``env``, ``current`` and ``_root_error``."""

    def reduce(self, msg) -> None:
        """``Reduce`` (spec §5 table). An errored input or ``out`` takes part as zeros, so peers never deadlock,
        and the result carries the error (DESIGN.md "Decisions")."""
        self.current = msg
        mesh = self.tw.device_meshes.get(msg.mesh.id)
        if mesh is None:
            raise FatalError(f"Reduce: unknown device mesh {msg.mesh}")
        dims = tuple(sorted(msg.dims))
        for d in dims:
            if d not in mesh.dims:
                raise FatalError(f"Reduce: unknown mesh dimension {d!r}; mesh {msg.mesh} has dims {mesh.names}")
        entry = mesh.comms.get((self.ref.id, dims))
        if entry is None:
            raise FatalError(
                f"Reduce: no comm found for stream {self.ref.id} and dims {dims} of mesh {msg.mesh}:"
                " SplitComm (and BackendNetworkInit) must come first"
            )
        size, group = entry
        env = self.env
        error = None
        value = env.get(msg.tensor.id, _MISSING)
        if value is _MISSING:
            raise FatalError(f"Reduce.tensor: ref not found: {msg.tensor}")
        device = self.tw.device
        factory = msg.factory
        if type(value) is SeqError:
            error, value = value, factory.zeros(device)
        else:
            problem = _mismatch(value, factory.size, factory.dtype, factory.layout)
            if problem is not None:
                # every rank must hand the collective the controller's shape and dtype, or the peers wait for
                # bytes that never come (gloo: until comm_timeout): take part with zeros, fail the result
                error = self._reduce_error(msg, dims, f"the input {msg.tensor} {problem}")
                value = factory.zeros(device)
        out = None
        if msg.out is not None:
            out = env.get(msg.out.id, _MISSING)
            if out is _MISSING:
                raise FatalError(f"Reduce.out: ref not found: {msg.out}")
            if type(out) is SeqError:
                error, out = error or out, None
            else:
                problem = _mismatch(out, _reduce_shape(factory.size, msg.reduction, msg.scatter, size), factory.dtype)
                if problem is not None:
                    error, out = error or self._reduce_error(msg, dims, f"out {msg.out} {problem}"), None
        refused = comm.unsupported(self.tw.comms.backend, msg.reduction, factory.dtype, factory.device)
        try:
            if refused is not None:  # every rank refuses alike (the factory is the same): nobody waits
                output = None
                error = error or self._reduce_error(msg, dims, refused, took_part=False)
            else:
                output = comm.reduce(group, size, value, msg.reduction, msg.scatter, msg.in_place, out, self.tw.comms)
        except comm.CommError as e:
            try:
                members = f" among ranks {mesh.get_ranks_for_dim_slice(dims)}"
            except Exception:
                members = ""
            raise FatalError(f"Reduce over {dims}{members} (result {msg.result}): {e}") from None
        if msg.result.id in env and msg.result.id not in (msg.tensor.id, getattr(msg.out, "id", None)):
            raise FatalError(f"Reduce: Duplicate write to reference {msg.result}")
        env[msg.result.id] = error if error is not None else output
        if error is not None:  # what the reduce wrote into is not a valid value either (spec §3: mutates)
            if msg.in_place:
                env[msg.tensor.id] = error
            if msg.out is not None:
                env[msg.out.id] = error

    def _reduce_error(self, msg, dims, problem: str, took_part: bool = True) -> SeqError:
        """A root failure of ``Reduce`` ``msg``: reported as ``RemoteFunctionFailed{msg.seq}`` when the
        controller gave the seq (raw messages without one only store it)."""
        if took_part:
            problem += (
                "; every rank must reduce tensors of the shape and dtype the controller computed (from the "
                "function's propagate), so this rank took part with zeros"
            )
        text = f"Reduce over {dims} into {msg.result}: {problem}"
        if msg.seq is None:
            return SeqError(-1, WorkerError(text, self.tw.actor_id))
        return self._root_error(msg.seq, text)
