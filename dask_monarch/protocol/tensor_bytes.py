"""How a fetched CPU tensor travels in an answer: its bytes, dtype and shape (issue 13: a fetch in under 1 ms).

Pickling a ``torch.Tensor`` the default way (its storage through ``torch.save``) costs 60-80 us to dump and as much
to load, twice what the rest of a small fetch's answer costs. ``dumps`` pickles a contiguous, dense CPU tensor
that does not require grad as ``(rebuild, (bytes, dtype, shape))`` instead, and everything else as pickle does;
``pickle.loads`` rebuilds it (``rebuild`` is importable on both sides).

Every other tensor still unpickles through torch's own reducers, and the first ``torch.layout`` that any thread
unpickles fills a cache by iterating ``torch.__dict__`` (``torch.serialization._get_layout``): a thread that imports
a torch submodule meanwhile makes that iteration raise "dictionary changed size during iteration" (a worker's
batch failed on it while a stream thread ran torch code). ``_fill_layout_cache`` fills that cache once, at import,
before any session's threads run.

A tensor of ``OUT_OF_BAND`` bytes or more (issue 26 item 4: a fetch costs the tensor, not three times it) is not
copied at all: it is pickled as ``(rebuild, (PickleBuffer(its memory), dtype, shape))`` out of band, and ``dumps``
returns an ``OutOfBand`` (the small pickle and the tensors' buffers) instead of bytes. An answer socket writes those
buffers from the tensor's memory and the controller reads each into one buffer that becomes the fetched tensor
(``protocol/frames.py``); Dask's comms and task results, which pickle with protocol 5 and take buffers out of band
too, carry it the same way; and ``pickle.loads`` of any of them gives the ``(chunk, messages)`` itself.
"""

from __future__ import annotations

import io
import pickle

import torch

__all__ = ["OUT_OF_BAND", "OutOfBand", "dumps", "loads", "rebuild"]

#: tensors of at least this many bytes travel as their own memory, out of band (smaller ones as a copy, in band)
OUT_OF_BAND = 1 << 20


def _fill_layout_cache() -> None:
    import torch.serialization

    get_layout = getattr(torch.serialization, "_get_layout", None)
    if get_layout is not None and isinstance(getattr(get_layout, "cache", None), dict):
        get_layout(str(torch.strided))


_fill_layout_cache()


def rebuild(data, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A CPU tensor of ``dtype`` and ``shape`` over ``data`` (a bytes-like object): its memory itself when it is
    writable (a ``bytearray``, a buffer received out of band), else a copy of it."""
    if memoryview(data).readonly:
        data = bytearray(data)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)


def _plain(t) -> bool:
    return (type(t) is torch.Tensor and t.layout is torch.strided and t.device.type == "cpu" and not t.requires_grad
            and t.numel() > 0 and t.is_contiguous() and not t.is_quantized and not t.is_conj() and not t.is_neg())


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if type(obj) is torch.Tensor and _plain(obj):
            data = obj.reshape(-1).view(torch.uint8).numpy()
            if data.nbytes >= OUT_OF_BAND:
                return rebuild, (pickle.PickleBuffer(data), obj.dtype, tuple(obj.shape))
            return rebuild, (data.tobytes(), obj.dtype, tuple(obj.shape))
        return NotImplemented


def loads(head: bytes, *buffers):
    """The object that ``dumps`` gave as ``OutOfBand(head, buffers)``; the buffers become its tensors' memory."""
    return pickle.loads(head, buffers=buffers)


class OutOfBand:
    """What ``dumps`` returns for an object with large tensors: ``head`` (the pickle, protocol 5) and ``buffers``
    (the tensors' memory, ``pickle.PickleBuffer``, in the order ``head`` refers to them). It pickles (protocol 5)
    as ``loads(head, *buffers)``, the buffers out of band where the pickler has a ``buffer_callback`` (Dask's
    comms, ``frames.send_frame``), so that unpickling it gives the object itself; with protocol 4 (a task result
    gathered through the scheduler, whose comms use it) the buffers are copied in band. ``nbytes``: the bytes of
    both."""

    __slots__ = ("head", "buffers")

    def __init__(self, head: bytes, buffers: list):
        self.head = head
        self.buffers = buffers

    @property
    def nbytes(self) -> int:
        return len(self.head) + sum(b.raw().nbytes for b in self.buffers)

    def __reduce_ex__(self, protocol):
        if protocol < 5:  # no out-of-band buffers: copies (the scheduler's comms use protocol 4)
            return loads, (self.head, *(b.raw().tobytes() for b in self.buffers))
        return loads, (self.head, *self.buffers)


def dumps(obj):
    """``pickle.dumps(obj, protocol=5)``, with plain CPU tensors as their bytes (see the module's docstring); an
    ``OutOfBand`` instead of bytes if a tensor has ``OUT_OF_BAND`` bytes or more."""
    buffer = io.BytesIO()
    buffers: list = []
    _Pickler(buffer, protocol=5, buffer_callback=buffers.append).dump(obj)
    head = buffer.getvalue()
    return OutOfBand(head, buffers) if buffers else head
