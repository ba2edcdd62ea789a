"""Where class-weight slices come from and where their gradients go.

The two passes of the sliced cross-entropy (``_linear_ce.py``) only ever ask for "the weight
(and bias) rows ``start:stop`` on the compute device, in the accumulation dtype" and hand back
"the gradient of rows ``start:stop``". This module hides where those rows rest: a tensor on the
compute device (views, no copy), a host tensor while the compute device is an accelerator
(copied slice by slice), or a store (``HugeClassifier``, read slice by slice).

# NOTE: keeping this a tiny internal interface means the transfer layer's mover (streams,
# events, pinned buffers) plugs in here without the numerics changing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch


def slice_bounds(num_classes: int, slice_size: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(num_classes)`` in steps of ``slice_size``."""
    return [(s, min(s + slice_size, num_classes)) for s in range(0, num_classes, slice_size)]


class SliceSource(Protocol):
    """Rows of a ``(num_classes, in_features)`` weight and an optional bias, slice by slice."""

    num_classes: int
    has_bias: bool

    def slices(
        self, bounds: list[tuple[int, int]]
    ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
        """Yield ``(start, stop, weight_rows, bias_rows)`` on the compute device."""
        ...


class GradSink(Protocol):
    """Receives the gradient of weight (and bias) rows, slice by slice."""

    def out(self, start: int, stop: int) -> torch.Tensor:
        """A ``(stop - start, in_features)`` tensor in the accumulation dtype to write into."""
        ...

    def commit(
        self, start: int, stop: int, grad_w: torch.Tensor | None, grad_b: torch.Tensor | None
    ) -> None:
        """Take the finished gradient of rows ``start:stop`` (``grad_w`` is what ``out`` gave)."""
        ...


class TensorSlices:
    """Slices of an in-memory weight tensor, moved to ``device`` and cast to ``dtype`` if needed.

    When the weight is already on ``device`` in ``dtype`` the slices are views (no copy). When it
    rests in host memory and ``device`` is an accelerator, each slice is copied on use.

    Args:
        weight: ``(num_classes, in_features)``.
        bias: ``(num_classes,)`` or ``None``.
        device: the compute device.
        dtype: the accumulation dtype the passes compute in.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.weight = weight
        self.bias = bias
        self.device = device
        self.dtype = dtype
        self.num_classes = weight.shape[0]
        self.has_bias = bias is not None

    def _move(self, t: torch.Tensor) -> torch.Tensor:
        # NOTE: a no-op (no copy) when the tensor is already on the device in the dtype.
        return t.to(device=self.device, dtype=self.dtype, non_blocking=True)

    def slices(
        self, bounds: list[tuple[int, int]]
    ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
        for start, stop in bounds:
            w = self._move(self.weight[start:stop])
            b = None if self.bias is None else self._move(self.bias[start:stop])
            yield start, stop, w, b


class TensorGradSink:
    """Writes slice gradients into full-size gradient tensors shaped like weight and bias.

    When the weight's gradient can be written in place (same device and dtype as the
    accumulation), ``out`` hands out a view of it and ``commit`` does nothing: no extra copy.

    Args:
        weight: the weight the gradient is for (gives shape, dtype, device).
        bias: the bias or ``None`` (no bias gradient).
        device: the compute device.
        dtype: the accumulation dtype.
        need_weight: whether to make a weight gradient at all.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        device: torch.device,
        dtype: torch.dtype,
        need_weight: bool,
    ) -> None:
        self.grad_weight = torch.empty_like(weight) if need_weight else None
        self.grad_bias = None if bias is None else torch.empty_like(bias)
        self._direct = (
            need_weight and weight.device == device and weight.dtype == dtype
        )
        self._device = device
        self._dtype = dtype
        self._tmp: torch.Tensor | None = None

    def out(self, start: int, stop: int) -> torch.Tensor:
        assert self.grad_weight is not None
        if self._direct:
            return self.grad_weight[start:stop]
        n, d = stop - start, self.grad_weight.shape[1]
        if self._tmp is None or self._tmp.numel() < n * d:
            self._tmp = torch.empty(n * d, device=self._device, dtype=self._dtype)
        return self._tmp[: n * d].view(n, d)

    def commit(
        self, start: int, stop: int, grad_w: torch.Tensor | None, grad_b: torch.Tensor | None
    ) -> None:
        if grad_w is not None and not self._direct:
            assert self.grad_weight is not None
            self.grad_weight[start:stop].copy_(grad_w)
        if grad_b is not None:
            assert self.grad_bias is not None
            self.grad_bias[start:stop].copy_(grad_b)
