"""Handles: the small immutable names a store hands out for the tensors it keeps."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Handle", "check_rows", "row_count"]


@dataclass(frozen=True)
class Handle:
    """A tensor kept in a store: its ``key`` (unique within the store), shape, dtype, size in
    bytes, and the ``store`` that issued it (not part of equality)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    store: Any = field(default=None, compare=False, repr=False)

    @staticmethod
    def of(
        key: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, store: Any = None
    ) -> Handle:
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"shape {shape} for {key!r} has a negative size")
        return Handle(key, shape, dtype, math.prod(shape) * dtype.itemsize, store)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row (one index along the first dimension)."""
        if not self.shape:
            raise ValueError(f"{self.key!r} is 0-dimensional and has no rows")
        return self.nbytes // self.shape[0] if self.shape[0] else 0


def check_rows(handle: Handle, rows: slice | torch.Tensor) -> slice | torch.Tensor:
    """A row selection for ``read_rows``/``write_rows``, checked (`ValueError`) and normalized."""
    if len(handle.shape) < 1:
        raise ValueError(f"{handle.key!r} is 0-dimensional; row access needs a tensor with rows")
    n = handle.shape[0]
    if isinstance(rows, slice):
        start, stop, step = rows.indices(n)
        if step != 1:
            raise ValueError(f"row slices must have step 1, got {rows}; pass sorted row indices")
        return slice(start, max(start, stop))
    if not isinstance(rows, torch.Tensor) or rows.dtype not in (torch.int64, torch.int32):
        raise ValueError("rows must be a slice or a 1-D LongTensor of sorted row indices")
    rows = rows.reshape(-1).to("cpu", torch.int64)
    if rows.numel():
        if int(rows.min()) < 0 or int(rows.max()) >= n:
            raise ValueError(f"row indices out of range [0, {n}) for {handle.key!r}")
        if rows.numel() > 1 and bool((rows[1:] < rows[:-1]).any()):
            raise ValueError("row indices must be sorted ascending (use torch.sort or .unique())")
    return rows


def row_count(rows: slice | torch.Tensor) -> int:
    if isinstance(rows, slice):
        return rows.stop - rows.start
    return int(rows.numel())
