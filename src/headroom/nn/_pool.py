"""Pooling layers that keep only indices (max) or nothing (average) plus the input's shape.

``MaxPool2DWithIndicesBackward0`` saves the input next to the indices, and
``AvgPool2DBackward0``/``AdaptiveAvgPool2DBackward0`` save the input, but their backward kernels
read only the input's sizes. These layers call the same aten kernels and hand backward an
uninitialized stand-in of the input's shape (see :class:`headroom.nn._common.TensorMeta`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.utils import _list_with_default, _ntuple

from headroom.nn._common import PoolOrPad, TensorMeta, first_order_only, per_dimension

aten = torch.ops.aten


class _IndexedPool(torch.autograd.Function):
    """``fwd(x, *args) -> (out, indices)``; backward ``bwd(grad, x, *bwd_args, indices)``."""

    @staticmethod
    def forward(ctx, x, fwd, args, bwd, bwd_args):
        out, indices = fwd(x, *args)
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(indices)
        ctx.meta, ctx.bwd, ctx.bwd_args = TensorMeta(x), bwd, bwd_args
        return out, indices

    @staticmethod
    @first_order_only
    def backward(ctx, grad, _grad_indices):
        (indices,) = ctx.saved_tensors
        gx = ctx.bwd(grad, ctx.meta.empty(), *ctx.bwd_args, indices)
        return gx, None, None, None, None


class _ShapeOnlyPool(torch.autograd.Function):
    """``fwd(x, *args) -> out``; backward ``bwd(grad, x, *bwd_args)`` reading x's shape only."""

    @staticmethod
    def forward(ctx, x, fwd, args, bwd, bwd_args):
        ctx.meta, ctx.bwd, ctx.bwd_args = TensorMeta(x), bwd, bwd_args
        return fwd(x, *args)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        return ctx.bwd(grad, ctx.meta.empty(), *ctx.bwd_args), None, None, None, None


class _MaxPool(PoolOrPad):
    _hr_dims: int

    def _hr_forward(self, input: torch.Tensor):
        n = self._hr_dims
        k = list(_ntuple(n)(self.kernel_size))
        s = list(_ntuple(n)(self.stride)) if self.stride is not None else k
        p = list(_ntuple(n)(self.padding))
        d = list(_ntuple(n)(self.dilation))
        if n == 1:
            # aten's max_pool1d_with_indices is max_pool2d_with_indices on unsqueeze(-2).
            x = input.unsqueeze(-2)
            args = ([1, k[0]], [1, s[0]], [0, p[0]], [1, d[0]], self.ceil_mode)
            out, idx = _IndexedPool.apply(
                x, aten.max_pool2d_with_indices, args, aten.max_pool2d_with_indices_backward, args
            )
            out, idx = out.squeeze(-2), idx.squeeze(-2)
        else:
            fwd = aten.max_pool2d_with_indices if n == 2 else aten.max_pool3d_with_indices
            bwd = (
                aten.max_pool2d_with_indices_backward
                if n == 2
                else aten.max_pool3d_with_indices_backward
            )
            args = (k, s, p, d, self.ceil_mode)
            out, idx = _IndexedPool.apply(input, fwd, args, bwd, args)
        return (out, idx) if self.return_indices else out


MaxPool1d, MaxPool2d, MaxPool3d = per_dimension(
    __name__, _MaxPool, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d),
    "``nn.{name}`` that keeps indices and the input's shape, not the input.")


class _AdaptiveMaxPool(PoolOrPad):
    _hr_dims: int

    def _hr_forward(self, input: torch.Tensor):
        n = self._hr_dims
        if n == 1:
            # aten's adaptive_max_pool1d is adaptive_max_pool2d on unsqueeze(-2).
            size = [1, _ntuple(1)(self.output_size)[0]]
            out, idx = _IndexedPool.apply(
                input.unsqueeze(-2),
                aten.adaptive_max_pool2d,
                (size,),
                aten.adaptive_max_pool2d_backward,
                (),
            )
            out, idx = out.squeeze(-2), idx.squeeze(-2)
        else:
            size = list(_list_with_default(_ntuple(n)(self.output_size), input.size()))
            fwd = aten.adaptive_max_pool2d if n == 2 else aten.adaptive_max_pool3d
            bwd = aten.adaptive_max_pool2d_backward if n == 2 else aten.adaptive_max_pool3d_backward
            out, idx = _IndexedPool.apply(input, fwd, (size,), bwd, ())
        return (out, idx) if self.return_indices else out


AdaptiveMaxPool1d, AdaptiveMaxPool2d, AdaptiveMaxPool3d = per_dimension(
    __name__, _AdaptiveMaxPool, (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d),
    "``nn.{name}`` that keeps indices and the input's shape, not the input.")


class _AvgPool(PoolOrPad):
    _hr_dims: int

    def _hr_forward(self, input: torch.Tensor) -> torch.Tensor:
        n = self._hr_dims
        k = list(_ntuple(n)(self.kernel_size))
        s = list(_ntuple(n)(self.stride)) if self.stride is not None else k
        p = list(_ntuple(n)(self.padding))
        if n == 1:
            # aten's avg_pool1d is avg_pool2d on unsqueeze(-2), no divisor_override.
            args = ([1, k[0]], [1, s[0]], [0, p[0]], self.ceil_mode, self.count_include_pad, None)
            out = _ShapeOnlyPool.apply(
                input.unsqueeze(-2), aten.avg_pool2d, args, aten.avg_pool2d_backward, args
            )
            return out.squeeze(-2)
        fwd = aten.avg_pool2d if n == 2 else aten.avg_pool3d
        bwd = aten.avg_pool2d_backward if n == 2 else aten.avg_pool3d_backward
        args = (k, s, p, self.ceil_mode, self.count_include_pad, self.divisor_override)
        return _ShapeOnlyPool.apply(input, fwd, args, bwd, args)


AvgPool1d, AvgPool2d, AvgPool3d = per_dimension(
    __name__, _AvgPool, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d),
    "``nn.{name}`` that keeps only its input's shape.")


class _AdaptiveAvgPool(PoolOrPad):
    _hr_dims: int

    def _hr_forward(self, input: torch.Tensor) -> torch.Tensor:
        n = self._hr_dims
        if n == 1:
            # aten's adaptive_avg_pool1d is adaptive_avg_pool2d on unsqueeze(-2).
            size = [1, _ntuple(1)(self.output_size)[0]]
            if size[1] == 1:
                return self._hr_torch_forward(input)  # a mean in aten, which saves nothing
            out = _ShapeOnlyPool.apply(
                input.unsqueeze(-2),
                aten._adaptive_avg_pool2d,
                (size,),
                aten._adaptive_avg_pool2d_backward,
                (),
            )
            return out.squeeze(-2)
        size = list(_list_with_default(_ntuple(n)(self.output_size), input.size()))
        # An all-ones output is a mean in aten, which saves nothing; keep PyTorch's path.
        if all(v == 1 for v in size) or input.is_quantized:
            return self._hr_torch_forward(input)
        fwd = aten._adaptive_avg_pool2d if n == 2 else aten._adaptive_avg_pool3d
        bwd = aten._adaptive_avg_pool2d_backward if n == 2 else aten._adaptive_avg_pool3d_backward
        return _ShapeOnlyPool.apply(input, fwd, (size,), bwd, ())


AdaptiveAvgPool1d, AdaptiveAvgPool2d, AdaptiveAvgPool3d = per_dimension(
    __name__, _AdaptiveAvgPool, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d),
    "``nn.{name}`` that keeps only its input's shape.")
