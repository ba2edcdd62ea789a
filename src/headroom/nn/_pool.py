"""Pooling layers that keep only indices (max) or nothing (average) plus the input's shape:
PyTorch's nodes save the input too, but their backward kernels read only its sizes (see
:class:`headroom.nn._common.TensorMeta`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.utils import _list_with_default, _ntuple

from headroom.nn._common import PoolOrPad, ShapeOnlyFunction, per_dimension

aten = torch.ops.aten


def _pool(pool: PoolOrPad, input: torch.Tensor, op: str, args: tuple, bwd_args: tuple):
    """:class:`ShapeOnlyFunction` over aten's ``op`` (formatted with 2 or 3) and its ``_backward``;
    1-d pools are the 2-d kernels on ``unsqueeze(-2)``, as in aten."""
    n = pool._hr_dims
    name = op.format(3 if n == 3 else 2)
    fwd, bwd = getattr(aten, name), getattr(aten, f"{name}_backward")
    if n != 1:
        return ShapeOnlyFunction.apply(input, fwd, args, bwd, bwd_args)
    out = ShapeOnlyFunction.apply(input.unsqueeze(-2), fwd, args, bwd, bwd_args)
    return tuple(t.squeeze(-2) for t in out) if isinstance(out, tuple) else out.squeeze(-2)


def _windows(pool: PoolOrPad, *names: str) -> list[list[int]]:
    """``kernel_size``, ``stride`` (default: the kernel), ``padding`` and ``names`` as lists;
    for one dimension as the 2-d kernels take them (a leading 1, or 0 for the padding)."""
    n = pool._hr_dims
    k = list(_ntuple(n)(pool.kernel_size))
    s = list(_ntuple(n)(pool.stride)) if pool.stride is not None else k
    out = [k, s, list(_ntuple(n)(pool.padding))]
    out += [list(_ntuple(n)(getattr(pool, name))) for name in names]
    if n == 1:
        out = [[0 if i == 2 else 1, *v] for i, v in enumerate(out)]
    return out


class _MaxPool(PoolOrPad):
    def _hr_forward(self, input: torch.Tensor):
        args = (*_windows(self, "dilation"), self.ceil_mode)
        out, idx = _pool(self, input, "max_pool{}d_with_indices", args, args)
        return (out, idx) if self.return_indices else out


MaxPool1d, MaxPool2d, MaxPool3d = per_dimension(
    __name__, _MaxPool, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d),
    "``nn.{name}`` that keeps indices and the input's shape, not the input.")


def _output_size(pool: PoolOrPad, input: torch.Tensor) -> list[int]:
    n = pool._hr_dims
    if n == 1:
        return [1, _ntuple(1)(pool.output_size)[0]]
    return list(_list_with_default(_ntuple(n)(pool.output_size), input.size()))


class _AdaptiveMaxPool(PoolOrPad):
    def _hr_forward(self, input: torch.Tensor):
        size = _output_size(self, input)
        out, idx = _pool(self, input, "adaptive_max_pool{}d", (size,), ())
        return (out, idx) if self.return_indices else out


AdaptiveMaxPool1d, AdaptiveMaxPool2d, AdaptiveMaxPool3d = per_dimension(
    __name__, _AdaptiveMaxPool, (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d),
    "``nn.{name}`` that keeps indices and the input's shape, not the input.")


class _AvgPool(PoolOrPad):
    def _hr_forward(self, input: torch.Tensor) -> torch.Tensor:
        # avg_pool1d has no divisor_override
        args = (*_windows(self), self.ceil_mode, self.count_include_pad,
                getattr(self, "divisor_override", None))
        return _pool(self, input, "avg_pool{}d", args, args)


AvgPool1d, AvgPool2d, AvgPool3d = per_dimension(
    __name__, _AvgPool, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d),
    "``nn.{name}`` that keeps only its input's shape.")


class _AdaptiveAvgPool(PoolOrPad):
    def _hr_forward(self, input: torch.Tensor) -> torch.Tensor:
        size = _output_size(self, input)
        # An all-ones output is a mean in aten, which saves nothing; keep PyTorch's path.
        if all(v == 1 for v in size) or (self._hr_dims > 1 and input.is_quantized):
            return self._hr_torch_forward(input)
        return _pool(self, input, "_adaptive_avg_pool{}d", (size,), ())


AdaptiveAvgPool1d, AdaptiveAvgPool2d, AdaptiveAvgPool3d = per_dimension(
    __name__, _AdaptiveAvgPool, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d),
    "``nn.{name}`` that keeps only its input's shape.")
