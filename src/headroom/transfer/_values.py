"""The values of the ``meta`` tensors of a dry run that stand for known data.

A dry run has no values, but a training step's integer inputs (token ids, attention masks,
labels, position ids) and what is computed from them alone (a padding mask, a bucketed position)
are known and small; models read them (``.item()``, ``.all()``, boolean indexing) to choose
their path. `to_meta` keeps a CPU copy of each such input beside its ``meta`` stand-in, and the
estimator's dispatch mode computes the values of what follows from known values alone. The
``meta`` tensor stays what the memory is counted from; its values are only read. See
[Note: known values in a dry run] (`headroom.fit._dryrun`).
"""

from __future__ import annotations

import weakref

import torch

# NOTE: values are kept for tensors up to this size: a mask of B x 1 x L x L for long sequences
# can be larger than the whole dry run should cost, and the common models read the values of
# the 2-D masks it is built from, not of it.
MAX_KNOWN_BYTES = 16 << 20


class KnownValues:
    """``meta`` tensor -> a CPU tensor of its values, for as long as the ``meta`` tensor lives.

    A write into a ``meta`` storage whose new values are not known (`forget`) drops the values
    of every tensor on that storage, so a value read later is never stale.
    """

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
        """Record ``values`` (a CPU tensor of ``meta``'s shape and dtype) as ``meta``'s (or,
        for other ones, none)."""
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
        """``meta``'s storage was written with values that are not known: drop the values of
        every tensor on it."""
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
    """Whether `to_meta` keeps ``t``'s values: integer and boolean tensors (ids, masks, labels)
    of at most `MAX_KNOWN_BYTES`, whose values models read to choose their path."""
    return (not t.dtype.is_floating_point and not t.dtype.is_complex
            and t.device.type != "meta" and t.layout == torch.strided
            and t.numel() * t.element_size() <= MAX_KNOWN_BYTES)
