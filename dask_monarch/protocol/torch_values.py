"""Values of torch's own types pickle by their torch name, whatever the import order (issue 25 item 1).

``torch.memory_format`` and ``torch.qscheme`` values (``torch.preserve_format``, ``torch.channels_last``,
``torch.per_tensor_affine``, ...) have no ``__module__``: their ``__reduce__`` gives a bare name
(``"torch.preserve_format"``, ``"per_tensor_affine"``), and pickle then looks for a module in ``sys.modules`` that
holds that name. The C pickler (``_pickle.whichmodule``, which cloudpickle's pickler uses too) skips ``__main__``
but not ``__mp_main__``, the alias of ``__main__`` that ``import multiprocessing`` adds. A program that imports
dask (which imports multiprocessing) before torch has ``__mp_main__`` ahead of ``torch`` in ``sys.modules``, and
its ``__main__`` has ``torch`` as a global, so ``torch.preserve_format`` pickles as
``__mp_main__.torch.preserve_format``: a name no other process can load (a worker's ``__main__`` is the
``dask worker`` command). Every ``clone()`` and every backward pass sends one. (``from torch import
per_tensor_affine`` in the program does the same to a qscheme.)

Importing this module (``protocol/__init__`` does, on the controller and on every worker) registers a ``copyreg``
reducer for those types: a value pickles as ``pkgutil.resolve_name("torch.<name>")``, which any process with
torch loads (no dask_monarch needed), by plain pickle, cloudpickle and every pickler that reads ``copyreg``'s
table. ``torch.dtype`` (it has ``__module__``), ``torch.device`` (its class has) and ``torch.layout`` (torch
registers a reducer, ``torch.serialization._get_layout``) already pickle by their torch names.
"""

from __future__ import annotations

import copyreg
import pkgutil

import torch

__all__ = ["TYPES", "reduce_by_name"]

#: the types whose values pickle by name here
TYPES = (torch.memory_format, torch.qscheme)


def reduce_by_name(value):
    """``copyreg`` reducer of a value of ``TYPES``: ``(pkgutil.resolve_name, ("torch.<name>",))``, the name being
    the one the value's own ``__reduce__`` gives, under ``torch``."""
    name = value.__reduce__()
    return pkgutil.resolve_name, (name if name.startswith("torch.") else f"torch.{name}",)


for _kind in TYPES:
    copyreg.pickle(_kind, reduce_by_name)
