"""``Storage``: one storage of remote tensors as the controller knows it (issue 13: an op whose shapes are cached
makes no fake tensor).

Every remote ``Tensor`` views a ``Storage``: its size in bytes and the live tensors that view it (its aliases: an
in-place op on one mutates them all, ``Session.aliases_of``; a borrow lends them all). The fake tensor a tensor
has for propagation on the controller (spec §1: "Output shapes come from FakeTensors") is made from it only when
something needs it (``Tensor._fake``): then the storage gets a storage on the meta device, shared by the fakes of
all its tensors, so that fake ops see the same aliasing as the workers' tensors. ``storage_of`` finds the
``Storage`` of a fake made elsewhere (by fake ops, or ``torch.empty`` under the fake mode).
"""

from __future__ import annotations

import weakref
from weakref import ref as _ref

import torch

__all__ = ["Storage", "storage_of"]

#: the ``Storage`` of each meta storage made or met so far, by its ``_cdata``; an entry goes with its ``Storage``,
#: which holds the meta storage (so the key cannot be reused meanwhile)
_by_meta: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class Storage:
    """A storage of ``nbytes`` bytes; ``meta`` is its meta-device storage if one exists already."""

    __slots__ = ("nbytes", "_meta", "_aliases", "_prune_at", "__weakref__")

    def __init__(self, nbytes: int, meta=None):
        self.nbytes = nbytes
        self._meta = meta
        # weak references to the tensors viewing it, made with the first; plain ``weakref.ref``s without callbacks
        # (a ``WeakSet`` cost each new tensor of an op whose shapes are cached about 0.5 us more), the dead ones
        # dropped when the list has doubled
        self._aliases = None
        self._prune_at = 8
        if meta is not None:
            _by_meta[meta._cdata] = self

    def meta(self):
        """Its meta-device ``UntypedStorage`` (made on first use)."""
        meta = self._meta
        if meta is None:
            with torch._C._DisableTorchDispatch():  # local meta tensors, also under mesh.activate()
                meta = torch.empty(self.nbytes, dtype=torch.uint8, device="meta").untyped_storage()
            self._meta = meta
            _by_meta[meta._cdata] = self
        return meta

    def add(self, tensor) -> None:
        """``tensor`` views this storage."""
        aliases = self._aliases
        if aliases is None:
            self._aliases = [_ref(tensor)]
            return
        aliases.append(_ref(tensor))
        if len(aliases) >= self._prune_at:
            aliases[:] = [r for r in aliases if r() is not None]
            self._prune_at = max(8, 2 * len(aliases))

    def discard(self, tensor) -> None:
        """``tensor`` no longer views it (``t.data = other``); compared by identity (``==`` is a remote op)."""
        if self._aliases is not None:
            self._aliases = [r for r in self._aliases if r() is not tensor and r() is not None]

    def aliases(self) -> list:
        """The live tensors viewing it."""
        aliases = self._aliases
        if aliases is None:
            return []
        return [t for r in aliases if (t := r()) is not None]

    def __repr__(self) -> str:
        return f"<Storage {self.nbytes} bytes at {id(self):#x}>"


def storage_of(fake) -> Storage:
    """The ``Storage`` of fake (or meta) tensor ``fake``'s storage: the one whose meta storage it views, else a new
    one for it."""
    meta = fake.untyped_storage()
    storage = _by_meta.get(meta._cdata)
    if storage is None:
        storage = Storage(meta.nbytes(), meta)
    return storage
