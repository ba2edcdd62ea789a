"""Multi-label targets without a dense ``batch x classes`` tensor: the positives of each row.

`parse_targets` validates any accepted form once and returns `Positives`, sorted by class: the
positives of any class slice are then one contiguous run, found by one ``searchsorted``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Positives", "parse_targets"]

_FORMS = (
    "a CSR tuple (offsets, indices) or (offsets, indices, values) with len(offsets) == rows + 1, "
    "a list with one tensor of class indices per row, or a torch.sparse_csr_tensor of shape "
    "(rows, num_classes)"
)


@dataclass(frozen=True)
class Positives:
    """The positives of a ``batch x num_classes`` multi-label target: ``(nnz,)`` int64
    ``rows`` and ``cols`` (sorted by class, then row) and ``values`` (``None``: all 1)."""

    batch: int
    num_classes: int
    rows: torch.Tensor
    cols: torch.Tensor
    values: torch.Tensor | None

    @property
    def nnz(self) -> int:
        return self.rows.numel()

    def value_or_one(self, dtype: torch.dtype) -> torch.Tensor:
        if self.values is None:
            return torch.ones(self.nnz, dtype=dtype, device=self.rows.device)
        return self.values.to(dtype)

    def row_sums(self, dtype: torch.dtype) -> torch.Tensor:
        """``(batch,)`` sum of each row's target values (its positives, when unweighted)."""
        out = torch.zeros(self.batch, dtype=dtype, device=self.rows.device)
        return out.index_add_(0, self.rows, self.value_or_one(dtype))

    def ranges(self, bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``(lo, hi)`` per slice: the slice's positives are entries ``lo:hi`` (one host sync)."""
        if not bounds:
            return []
        edges = torch.tensor([s for s, _ in bounds] + [bounds[-1][1]], device=self.cols.device)
        at = torch.searchsorted(self.cols, edges).tolist()
        return list(zip(at[:-1], at[1:], strict=True))

    def take_rows(self, keep: torch.Tensor) -> Positives:
        """The positives of rows ``keep`` (sorted int64), renumbered ``0 .. len(keep) - 1``."""
        new = torch.full((self.batch,), -1, dtype=torch.int64, device=self.rows.device)
        new[keep] = torch.arange(keep.numel(), device=keep.device)
        mapped = new[self.rows]
        sel = mapped >= 0
        values = None if self.values is None else self.values[sel]
        return Positives(keep.numel(), self.num_classes, mapped[sel], self.cols[sel], values)

    def take_classes(self, classes: torch.Tensor) -> Positives:
        """The same positives over the classes ``classes`` (sorted int64, holding every one)."""
        local = torch.searchsorted(classes.to(self.cols.device), self.cols)
        return Positives(self.batch, classes.numel(), self.rows, local, self.values)


def _as_index(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) and len(t) == 0:  # type: ignore[arg-type]
        return torch.zeros(0, dtype=torch.int64)  # an empty list: no positives, not floats
    t = torch.as_tensor(t)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(
            f"targets: {what} must hold integers, got dtype {t.dtype}; convert with .long()"
        )
    if t.dim() != 1:
        raise ValueError(f"targets: {what} must be 1-D, got shape {tuple(t.shape)}")
    return t.long()


def _from_user(targets: object, batch: int) -> tuple[torch.Tensor, torch.Tensor, object | None]:
    """``(offsets, indices, values or None)`` from any accepted form (not yet validated)."""
    if isinstance(targets, torch.Tensor):
        if targets.layout != torch.sparse_csr:
            raise TypeError(
                f"targets must be {_FORMS}; got a {targets.layout} tensor of shape "
                f"{tuple(targets.shape)} (a dense batch x classes target is what this avoids; "
                "a 1-D tensor of class ids is single-label: use linear_cross_entropy)"
            )
        return targets.crow_indices(), targets.col_indices(), targets.values()
    if isinstance(targets, tuple):
        if len(targets) not in (2, 3):
            raise ValueError(
                f"targets: a tuple is read as CSR (offsets, indices[, values]), got {len(targets)}"
                " entries; pass per-row index tensors as a list"
            )
        values = targets[2] if len(targets) == 3 else None
        return _as_index(targets[0], "offsets"), _as_index(targets[1], "indices"), values
    if isinstance(targets, list):
        if len(targets) != batch:
            raise ValueError(
                f"targets: a list needs one index tensor per row, {batch} rows, got "
                f"{len(targets)}"
            )
        rows = [_as_index(r, f"row {i}") for i, r in enumerate(targets)]
        lengths = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        dev = rows[0].device if rows else torch.device("cpu")
        indices = torch.cat([r.to(dev) for r in rows]) if rows else torch.zeros(0).long()
        return offsets.to(dev), indices, None
    raise TypeError(f"targets must be {_FORMS}; got {type(targets).__name__}")


def parse_targets(
    targets: object, *, batch: int, num_classes: int, device: torch.device
) -> Positives:
    """Validate multi-label targets (`linear_loss`'s forms) of ``batch`` rows and return their
    positives on ``device``, sorted by class then row."""
    if isinstance(targets, torch.Tensor) and tuple(targets.shape) != (batch, num_classes):
        raise ValueError(
            f"targets: a sparse target must have shape (rows, num_classes) = "
            f"{(batch, num_classes)}, got {tuple(targets.shape)}"
        )
    offsets, indices, values = _from_user(targets, batch)
    offsets, indices = offsets.long(), indices.long()
    if offsets.numel() != batch + 1:
        raise ValueError(
            f"targets: offsets must have rows + 1 = {batch + 1} entries (row b's classes are "
            f"indices[offsets[b]:offsets[b+1]]), got {offsets.numel()}; check that the targets "
            "belong to this batch"
        )
    offsets, indices = offsets.to(device), indices.to(device)
    lengths = offsets.diff()
    # one host sync for all checks: a bad structure would silently read the wrong rows
    bad_start = offsets[0] != 0
    bad_end = offsets[-1] != indices.numel()
    bad_order = (lengths < 0).any()
    out = (indices < 0) | (indices >= num_classes)
    if bool(bad_start | bad_end | bad_order | out.any()):
        if bool(bad_start):
            raise ValueError(f"targets: offsets[0] must be 0, got {int(offsets[0])}")
        if bool(bad_order):
            b = int(torch.nonzero(lengths < 0)[0])
            raise ValueError(
                f"targets: offsets must be non-decreasing, but offsets[{b}] = "
                f"{int(offsets[b])} > offsets[{b + 1}] = {int(offsets[b + 1])}"
            )
        if bool(bad_end):
            raise ValueError(
                f"targets: offsets[-1] = {int(offsets[-1])} must equal len(indices) = "
                f"{indices.numel()}"
            )
        i = int(torch.nonzero(out)[0])
        row = int(torch.searchsorted(offsets, torch.tensor(i, device=device), right=True)) - 1
        raise ValueError(
            f"targets: {int(out.sum())} class index(es) outside [0, {num_classes}) (first: "
            f"{int(indices[i])} in row {row}); fix the labels or num_classes"
        )
    rows = torch.repeat_interleave(torch.arange(batch, device=device), lengths)
    key = indices * batch + rows
    key, order = torch.sort(key)
    dup = key[1:] == key[:-1]
    if bool(dup.any()):
        k = int(key[int(torch.nonzero(dup)[0])])
        raise ValueError(
            f"targets: row {k % batch} lists class {k // batch} more than once; a class is a "
            "positive of a row or not: drop the repeats (e.g. torch.unique per row), or give "
            "the positive a target value in (offsets, indices, values)"
        )
    vals = None
    if values is not None:
        vals = torch.as_tensor(values).to(device)
        if not vals.dtype.is_floating_point:
            raise TypeError(
                f"targets: values must be floating point, got {vals.dtype}; convert with .float()"
            )
        if tuple(vals.shape) != tuple(indices.shape):
            raise ValueError(
                f"targets: values must have one entry per index, shape {tuple(indices.shape)}, "
                f"got {tuple(vals.shape)}"
            )
        if not bool(torch.isfinite(vals).all()):
            raise ValueError("targets: values must be finite")
        vals = vals[order]
    return Positives(batch, num_classes, rows[order], indices[order], vals)


class PositiveLogits:
    """Several positives per row as the targets of a softmax (``_linear_ce.LabelTargets``),
    ``weights`` ``(nnz,)`` of each positive's ``-log p`` term."""

    def __init__(self, pos: Positives, weights: torch.Tensor) -> None:
        self.pos = pos
        self.weights = weights
        self.logits = torch.zeros(0)
        self._ranges: list[tuple[int, int]] = []

    def prepare(self, bounds: list[tuple[int, int]], dtype: torch.dtype) -> None:
        self._ranges = self.pos.ranges(bounds)
        self.logits = torch.zeros(self.pos.nnz, dtype=dtype, device=self.pos.rows.device)

    def _at(self, i: int, start: int) -> tuple[slice, torch.Tensor, torch.Tensor]:
        lo, hi = self._ranges[i]
        return slice(lo, hi), self.pos.rows[lo:hi], self.pos.cols[lo:hi] - start

    def gather(self, i: int, z: torch.Tensor, start: int, stop: int) -> None:
        at, r, c = self._at(i, start)
        self.logits[at] = z[r, c]

    def subtract(
        self, i: int, g: torch.Tensor, start: int, stop: int, coef: torch.Tensor
    ) -> None:
        at, r, c = self._at(i, start)
        g.index_put_((r, c), -(coef[r] * self.weights[at]), accumulate=True)
