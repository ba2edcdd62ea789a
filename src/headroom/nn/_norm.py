"""Normalization layers that skip the input where backward does not need it: a ``BatchNorm``
in eval mode with a frozen ``weight``, and any of them where only ``bias`` trains. Elsewhere
PyTorch's own forward runs; where they differ they call PyTorch's aten kernels (bitwise equal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from headroom.nn._common import (
    TensorMeta,
    _pending,
    _relu_outputs,
    channels_last_dense,
    first_order_only,
    note_consumer,
    per_dimension,
    records_graph,
    settle_pending,
    trains,
)

aten = torch.ops.aten


class _BatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
        out, save_mean, save_invstd, reserve, impl = torch.ops.aten._batch_norm_impl_index(
            x,
            weight,
            bias,
            running_mean,
            running_var,
            training,
            momentum,
            eps,
            torch.backends.cudnn.enabled,
        )
        need_x, need_w = ctx.needs_input_grad[:2]
        keep_x = need_w or (need_x and training)
        ctx.save_for_backward(
            x if keep_x else None, weight if need_x else None, save_mean, save_invstd, reserve
        )
        ctx.meta = None if keep_x else TensorMeta(x)
        ctx.running = (running_mean, running_var)  # module buffers, resident anyway
        ctx.training, ctx.eps, ctx.impl = training, eps, impl
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        x, weight, save_mean, save_invstd, reserve = ctx.saved_tensors
        if x is None:
            x = ctx.meta.empty()
        mask = list(ctx.needs_input_grad[:3])
        rm, rv = ctx.running
        if ctx.training:
            gx, gw, gb = torch.ops.aten._batch_norm_impl_index_backward(
                ctx.impl,
                x,
                grad,
                weight,
                rm,
                rv,
                save_mean,
                save_invstd,
                True,
                ctx.eps,
                mask,
                reserve,
            )
        else:
            # PyTorch's eval-mode backward is native_batch_norm_backward for every backend.
            gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
                grad, x, weight, rm, rv, save_mean, save_invstd, False, ctx.eps, mask
            )
        return gx, gw, gb, None, None, None, None, None


class _BatchNorm:
    def _hr_saves_input(self) -> bool:
        return self.training or (self.running_mean is None) or trains(self)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not records_graph():
            return super().forward(input)
        if _pending.young:
            settle_pending()
        need_x = input.requires_grad
        if need_x:
            if _relu_outputs:
                note_consumer(self, input)
            if self.training:
                return super().forward(input)  # the input's gradient needs the input itself
        # Skipped only with a frozen weight, where the input needs no gradient or in eval mode.
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        if trains(self) or not (need_x or trains(self, "bias")) or (need_x and bn_training):
            return super().forward(input)
        # Same bookkeeping as nn.BatchNorm's forward (momentum, num_batches_tracked).
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        track = not self.training or self.track_running_stats
        if bn_training:
            F._verify_batch_size(input.size())
        if bn_training and self.eps <= 0.0:
            raise ValueError(f"batch_norm eps must be positive during training, but got {self.eps}")
        if self.eps < 0.0:
            raise ValueError(f"batch_norm eps must be non-negative, but got {self.eps}")
        return _BatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if track else None,
            self.running_var if track else None,
            bn_training,
            factor,
            self.eps,
        )


BatchNorm1d, BatchNorm2d, BatchNorm3d = per_dimension(
    __name__, _BatchNorm, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d),
    "``nn.{name}`` that skips its input where backward does not need it.")


class _BiasOnlyNorm(torch.autograd.Function):
    """``fwd(x) -> (out, mean, rstd)``; backward ``bwd(grad, x, mean, rstd)`` reading x's shape
    (``weight`` and ``bias`` are passed for autograd to see which train)."""

    @staticmethod
    def forward(ctx, x, weight, bias, fwd, bwd):
        out, mean, rstd = fwd(x)
        ctx.save_for_backward(mean, rstd)
        ctx.meta, ctx.bwd = TensorMeta(x), bwd
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        mean, rstd = ctx.saved_tensors
        return None, None, ctx.bwd(grad, ctx.meta.empty(), mean, rstd), None, None


class _BiasOnlyMixin:
    """``forward`` of a norm that keeps no input when only its ``bias`` trains."""

    def _hr_saves_input(self) -> bool:
        return True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not records_graph():
            return super().forward(input)
        settle_pending()
        if input.requires_grad:
            note_consumer(self, input)
            return super().forward(input)
        if (
            trains(self)
            or not trains(self, "bias")
            or torch.is_autocast_enabled(input.device.type)
            or not self._hr_applies(input)
        ):
            return super().forward(input)  # (autocast: float32 on some devices)
        return self._hr_bias_only(input)


class LayerNorm(_BiasOnlyMixin, nn.LayerNorm):
    """``nn.LayerNorm`` that keeps no input when only its ``bias`` trains."""

    def _hr_applies(self, input: torch.Tensor) -> bool:
        return True

    def _hr_bias_only(self, input: torch.Tensor) -> torch.Tensor:
        shape, weight, bias, eps = list(self.normalized_shape), self.weight, self.bias, self.eps

        def fwd(x):
            return aten.native_layer_norm(x, shape, weight, bias, eps)

        def bwd(grad, x, mean, rstd):
            return aten.native_layer_norm_backward(
                grad, x, shape, mean, rstd, weight, bias, [False, False, True]
            )[2]

        return _BiasOnlyNorm.apply(input, weight, bias, fwd, bwd)


class GroupNorm(_BiasOnlyMixin, nn.GroupNorm):
    """``nn.GroupNorm`` that keeps no input when only its ``bias`` trains."""

    def _hr_applies(self, input: torch.Tensor) -> bool:
        return input.dim() >= 2

    def _hr_bias_only(self, input: torch.Tensor) -> torch.Tensor:
        # The layout aten.group_norm hands native_group_norm (suggested format on CPU).
        fmt = torch.contiguous_format
        dense = not input.is_contiguous() and channels_last_dense(input)
        if dense and input.device.type in ("cpu", "xpu"):
            fmt = torch.channels_last if input.dim() == 4 else torch.channels_last_3d
        x = input.contiguous(memory_format=fmt)
        n, c = x.shape[0], x.shape[1]
        hxw = x.numel() // (n * c) if n * c else 0
        weight, bias, groups, eps = self.weight, self.bias, self.num_groups, self.eps

        def fwd(x):
            return aten.native_group_norm(x, weight, bias, n, c, hxw, groups, eps)

        def bwd(grad, x, mean, rstd):
            # As PyTorch's node: the kernel reads the gradient (expanded for a ``.sum()`` loss)
            # as dense in the input's layout.
            grad = grad if grad.device.type == "xpu" else grad.contiguous(memory_format=fmt)
            return aten.native_group_norm_backward(
                grad, x, mean, rstd, weight, n, c, hxw, groups, [False, False, True]
            )[2]

        return _BiasOnlyNorm.apply(x, weight, bias, fwd, bwd)
