"""The values of the ``meta`` tensors of a dry run that stand for known data.

A training step's integer inputs (token ids, masks, labels) and what is computed from them
alone are known and small; models read them (``.item()``, boolean indexing) to choose their
path. `to_meta` keeps a CPU copy of each beside its ``meta`` stand-in, and the estimator
computes what follows from known values alone. See [Note: known values in a dry run]
(`headroom.fit._dryrun`).
"""

from __future__ import annotations

import weakref

import torch

# NOTE: a B x 1 x L x L mask for long sequences can cost more than the whole dry run should;
# models read the 2-D masks it is built from, not it.
MAX_KNOWN_BYTES = 16 << 20


class KnownValues:
    """``meta`` tensor -> a CPU tensor of its values, for as long as the ``meta`` tensor lives.
    `forget` drops the values of every tensor on a storage, so none read later is stale."""

    def __init__(self, max_bytes: int = MAX_KNOWN_BYTES) -> None:
        self.max_bytes = max_bytes  # larger values are not kept
        self._by_id: dict[int, tuple[weakref.ref, torch.Tensor, int]] = {}
        self._by_storage: dict[int, set[int]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def get(self, t: torch.Tensor) -> torch.Tensor | None:
        """The values of ``t``, or ``None`` when they are not known."""
        entry = self._by_id.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry[1]

    def put(self, meta: torch.Tensor, values: torch.Tensor) -> None:
        """Record ``values`` (a CPU tensor of ``meta``'s shape and dtype) as ``meta``'s."""
        if values.shape != meta.shape or values.dtype != meta.dtype \
                or values.device.type != "cpu" or values.is_sparse \
                or values.untyped_storage().nbytes() > self.max_bytes:
            self.forget(meta)
            return
        key = id(meta)
        self._drop(key)
        st = meta.untyped_storage()._cdata
        self._by_id[key] = (weakref.ref(meta, lambda _r, k=key: self._drop(k)), values, st)
        self._by_storage.setdefault(st, set()).add(key)

    def forget(self, meta: torch.Tensor) -> None:
        """``meta``'s storage was written with unknown values: drop those of every tensor on it."""
        try:
            st = meta.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return
        for key in list(self._by_storage.get(st, ())):
            self._drop(key)

    def _drop(self, key: int) -> None:
        entry = self._by_id.pop(key, None)
        if entry is None:
            return
        keys = self._by_storage.get(entry[2])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_storage[entry[2]]


known_values = KnownValues()


def keeps_values(t: torch.Tensor) -> bool:
    """Whether `to_meta` keeps ``t``'s values: integer or boolean, at most `MAX_KNOWN_BYTES`."""
    return (not t.dtype.is_floating_point and not t.dtype.is_complex
            and t.device.type != "meta" and t.layout == torch.strided
            and t.numel() * t.element_size() <= MAX_KNOWN_BYTES)
