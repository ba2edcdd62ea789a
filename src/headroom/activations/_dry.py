"""`hr.offload_activations` in a dry run: what it keeps on the device, on ``meta`` tensors.

The estimator (`headroom.fit`) runs the step with this keeper instead of the feature's own: the
copy to the store is taken as done at once, so a saved storage leaves the device as soon as the
forward drops it, and comes back for backward with the feature's refill-ahead budget. The
options and their defaults are the feature's.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from headroom.activations._offload import DEFAULT_MIN_BYTES, DEFAULT_PREFETCH

__all__ = ["OffloadedActivations"]


class _RestingStorage:
    """One saved storage whose bytes rest in the store (see `OffloadedActivations`)."""

    __slots__ = ("nbytes", "storage", "packs", "dead")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.storage: torch.UntypedStorage | None = None  # refilled for backward
        self.packs = 0
        self.dead = False


class _Dropped:
    """What autograd keeps instead of a saved tensor: its view of an entry's storage."""

    __slots__ = ("owner", "entry", "dtype", "shape", "stride", "offset", "__weakref__")

    def __init__(self, owner: OffloadedActivations, entry: _RestingStorage,
                 t: torch.Tensor) -> None:
        self.owner = owner
        self.entry = entry
        self.dtype = t.dtype
        self.shape = t.shape
        self.stride = t.stride()
        self.offset = t.storage_offset()
        entry.packs += 1

    def __del__(self) -> None:
        self.owner._release(self.entry)


class OffloadedActivations:
    """A saved-tensor keeper for the dry run that keeps saved storages off the device.

    What `hr.offload_activations` does, as the device sees it, with its options and defaults
    (``min_bytes``, ``prefetch``, ``modules``: the modules of the dry run's model whose forward
    saves what moves): a saved storage of at least
    ``min_bytes`` (not a parameter's) is no longer held by autograd, so its device memory goes
    once the forward drops it (the copy to the store is taken as done at once); backward gets a
    new storage of the same size, once per storage (views of one storage share it), when it
    first needs one, and refills storages saved before it, newest first, while the refilled
    storages still alive stay within ``prefetch`` bytes. A storage goes when autograd lets go of
    the last tensor saved on it.

    ``moved`` counts the bytes sent to the store (each comes back once for backward).
    """

    def __init__(self, model: nn.Module, min_bytes: int = DEFAULT_MIN_BYTES,
                 prefetch: int = DEFAULT_PREFETCH,
                 modules: Iterable[nn.Module] | None = None) -> None:
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.moved = 0
        # as the feature: with ``modules``, only what is saved inside their forward
        modules = list(modules) if modules else None
        self._depth = 0 if modules is not None else 1
        self._handles = []
        for m in modules or ():
            self._handles.append(m.register_forward_pre_hook(self._enter_module))
            self._handles.append(m.register_forward_hook(self._leave_module, always_call=True))
        self._params = {p.untyped_storage()._cdata for p in model.parameters()}
        self._entries: dict[int, _RestingStorage] = {}  # live device storage -> its entry
        self._order: list[_RestingStorage] = []  # live entries, in the order they were saved
        self._restored = 0

    def _enter_module(self, module, args) -> None:
        self._depth += 1

    def _leave_module(self, module, args, output) -> None:
        self._depth -= 1

    def close(self) -> None:
        """No new tensors (the hooks of ``modules`` go)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def pack(self, t: torch.Tensor) -> Any:
        if self._depth <= 0 or t.device.type != "meta" or isinstance(t, nn.Parameter) \
                or isinstance(t._base, nn.Parameter):
            return t
        st = t.untyped_storage()
        if st.nbytes() < self.min_bytes or st._cdata in self._params:
            return t
        entry = self._entries.get(st._cdata)
        if entry is None or entry.dead:
            entry = self._entries[st._cdata] = _RestingStorage(st.nbytes())
            self._order.append(entry)
            self.moved += entry.nbytes
            # the entry is keyed by a storage that autograd no longer holds: forget the key
            # when that storage goes, as a new storage may then get the same one
            weakref.finalize(st, self._entries.pop, st._cdata, None)
        return _Dropped(self, entry, t)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Dropped):
            return packed
        e = packed.entry
        self._refill(e)
        i = self._order.index(e) if e in self._order else 0
        for prev in reversed(self._order[:i]):
            if self._restored + prev.nbytes > self.prefetch:
                break
            self._refill(prev)
        out = torch.empty(0, dtype=packed.dtype, device="meta")
        return out.set_(e.storage, packed.offset, packed.shape, packed.stride)

    def _refill(self, e: _RestingStorage) -> None:
        if e.storage is None:
            e.storage = torch.empty(e.nbytes, dtype=torch.uint8,
                                    device="meta").untyped_storage()
            self._restored += e.nbytes

    def _release(self, e: _RestingStorage) -> None:
        e.packs -= 1
        if e.packs or e.dead:
            return
        e.dead = True
        if e in self._order:
            self._order.remove(e)
        if e.storage is not None:
            self._restored -= e.nbytes
            e.storage = None
