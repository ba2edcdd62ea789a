"""Activations that keep a 1-bit mask instead of a full tensor.

PyTorch's ReLU keeps its whole output (32 bits per element in fp32) to know, in backward, where
the gradient passes; LeakyReLU, Hardtanh and ReLU6 keep their whole input for the same reason.
These layers keep one bit per element (:mod:`headroom.nn._bitmask`).

ReLU is special: its output is very often the input of the next layer, and when that layer keeps
its input for its own backward (a convolution whose weight trains), keeping the output costs
nothing: both saved references share one storage. A ReLU then runs PyTorch's own ReLU and adds
no byte; it switches to the bit mask only when every headroom layer seen consuming its output at
this call site will not keep it under the current ``requires_grad`` flags
(see :mod:`headroom.nn._common`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from headroom.nn._bitmask import pack_bool, pack_gt, pack_nonzero, unpack_nonzero
from headroom.nn._common import consumers_keep_output, note_consumer, register_relu_output


def _threshold_backward_into(grad: torch.Tensor, passes: torch.Tensor) -> torch.Tensor:
    """PyTorch's ReLU backward kernel, ``passes <= 0 ? 0 : grad``, written over ``passes``.

    # NOTE: the kernel is element-wise, so its output may alias an input exactly; reusing the
    # freshly unpacked ``passes`` buffer saves one full-size allocation per backward.
    """
    return torch.ops.aten.threshold_backward.grad_input(grad, passes, 0, grad_input=passes)


def _needs_graph(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


class _ReLUMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, inplace: bool) -> torch.Tensor:
        if inplace:
            ctx.mark_dirty(x)
            out = torch.relu_(x)
        else:
            out = torch.relu(x)
        # NOTE: PyTorch's threshold_backward zeroes the gradient where ``out <= 0`` (NaN passes).
        # A ReLU output is never negative, so "passes" is ``out != 0`` (one cast). Backward
        # hands threshold_backward a tensor that is positive exactly where the mask is set: the
        # very kernel PyTorch runs, so the result is bitwise the same (a bool mask with
        # masked_fill or where is exact too, but those mixed-dtype kernels are ~20x slower).
        ctx.save_for_backward(pack_nonzero(out))
        ctx.shape = out.shape
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (bits,) = ctx.saved_tensors
        passes = unpack_nonzero(bits, ctx.shape).to(grad.dtype)
        return _threshold_backward_into(grad, passes), None


class ReLU(nn.ReLU):
    """``nn.ReLU`` that keeps a 1-bit mask, or nothing its consumer does not keep already."""

    def _hr_saves_input(self) -> bool:
        return False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not _needs_graph(input):
            return super().forward(input)
        note_consumer(self, input)
        grad_fn = input.grad_fn
        site = (type(grad_fn).__name__ if grad_fn is not None else "", tuple(input.shape[1:]))
        if consumers_keep_output(self, site):
            out = super().forward(input)
        else:
            out = _ReLUMask.apply(input, self.inplace)
        register_relu_output(self, site, out)
        return out


class _LeakyReLUMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, slope: float, inplace: bool) -> torch.Tensor:
        if inplace:
            ctx.mark_dirty(x)
            out = F.leaky_relu_(x, slope)
            bits = pack_gt(out)
        else:
            bits = pack_gt(x)
            out = F.leaky_relu(x, slope)
        ctx.save_for_backward(bits)
        ctx.shape, ctx.slope, ctx.inplace = out.shape, slope, inplace
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (bits,) = ctx.saved_tensors
        # NOTE: leaky_relu_backward reads only the sign of the tensor it is given, so a 1/0
        # tensor built from the mask gives bitwise the same result as PyTorch's own backward.
        sign = unpack_nonzero(bits, ctx.shape).to(grad.dtype)
        gx = torch.ops.aten.leaky_relu_backward.grad_input(
            grad, sign, ctx.slope, ctx.inplace, grad_input=sign
        )
        return gx, None, None


class LeakyReLU(nn.LeakyReLU):
    """``nn.LeakyReLU`` that keeps a 1-bit sign mask instead of its input."""

    def _hr_saves_input(self) -> bool:
        return False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not _needs_graph(input):
            return super().forward(input)
        note_consumer(self, input)
        if self.inplace and self.negative_slope < 0:
            return super().forward(input)  # PyTorch raises its own error for this
        return _LeakyReLUMask.apply(input, float(self.negative_slope), self.inplace)


class _HardtanhMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, lo: float, hi: float, inplace: bool) -> torch.Tensor:
        if inplace:
            ctx.mark_dirty(x)
            out = F.hardtanh_(x, lo, hi)
        else:
            out = F.hardtanh(x, lo, hi)
        # NOTE: hardtanh_backward zeroes the gradient where ``x <= lo or x >= hi``; the output
        # meets the same conditions (clamped values equal the bounds) and NaN passes. Backward
        # hands threshold_backward a 1.0/0.0 "passes" tensor (see _ReLUMask for why).
        stops = torch.le(out, lo).logical_or_(torch.ge(out, hi))
        ctx.save_for_backward(pack_bool(stops.logical_not_()))
        ctx.shape = out.shape
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (bits,) = ctx.saved_tensors
        passes = unpack_nonzero(bits, ctx.shape).to(grad.dtype)
        return _threshold_backward_into(grad, passes), None, None, None


class _HardtanhMixin:
    def _hr_saves_input(self) -> bool:
        return False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not _needs_graph(input) or self.min_val > self.max_val:
            return super().forward(input)
        note_consumer(self, input)
        return _HardtanhMask.apply(input, float(self.min_val), float(self.max_val), self.inplace)


class Hardtanh(_HardtanhMixin, nn.Hardtanh):
    """``nn.Hardtanh`` that keeps a 1-bit pass mask instead of its input."""


class ReLU6(_HardtanhMixin, nn.ReLU6):
    """``nn.ReLU6`` that keeps a 1-bit pass mask instead of its input."""
