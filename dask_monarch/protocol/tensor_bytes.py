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
"""

from __future__ import annotations

import io
import pickle

import torch

__all__ = ["dumps", "rebuild"]


def _fill_layout_cache() -> None:
    import torch.serialization

    get_layout = getattr(torch.serialization, "_get_layout", None)
    if get_layout is not None and isinstance(getattr(get_layout, "cache", None), dict):
        get_layout(str(torch.strided))


_fill_layout_cache()


def rebuild(data: bytes, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A CPU tensor of ``dtype`` and ``shape`` holding a copy of ``data``."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _plain(t) -> bool:
    return (type(t) is torch.Tensor and t.layout is torch.strided and t.device.type == "cpu" and not t.requires_grad
            and t.numel() > 0 and t.is_contiguous() and not t.is_quantized and not t.is_conj() and not t.is_neg())


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if type(obj) is torch.Tensor and _plain(obj):
            data = obj.reshape(-1).view(torch.uint8).numpy().tobytes()
            return rebuild, (data, obj.dtype, tuple(obj.shape))
        return NotImplemented


def dumps(obj) -> bytes:
    """``pickle.dumps(obj, protocol=5)``, with plain CPU tensors as their bytes (see the module's docstring)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=5).dump(obj)
    return buffer.getvalue()
