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

from headroom.nn._bitmask import pack_bool, pack_gt, pack_nonzero, unpack_as
from headroom.nn._common import (
    KeepsNoInput,
    consumers_keep_output,
    hooks_free,
    note_consumer,
    register_relu_output,
    run_saving_less,
)


def _unpack_like(ctx, grad: torch.Tensor) -> torch.Tensor:
    """The saved mask as ``grad.dtype`` values, positive where set, laid out like the tensor
    PyTorch's backward would have read (same strides).

    # NOTE: the strides matter for bitwise equality downstream: an element-wise backward kernel
    # lays its output out like its inputs, and the next backward (a batch norm, say) takes a
    # different reduction order for a channels-last gradient than for a contiguous one.
    """
    (bits,) = ctx.saved_tensors
    passes = unpack_as(bits, ctx.shape, grad.dtype)
    if passes.stride() == ctx.stride:
        return passes
    out = torch.empty_strided(ctx.shape, ctx.stride, dtype=grad.dtype, device=grad.device)
    return out.copy_(passes)


class _ReLUBits:
    """A ReLU result saved as its non-zero mask (pack hook of ``ReluBackward0``).

    # NOTE: PyTorch's ReluBackward0 runs ``threshold_backward(grad, result, 0)``; handing it a
    # tensor positive exactly where the result was non-zero, laid out like the result, gives
    # bitwise its own gradient (see _ReLUMask). Packing happens when the node saves the result,
    # so the full result is never held by autograd.
    """

    __slots__ = ("bits", "shape", "stride", "dtype", "device", "contiguous")

    def __init__(self, out: torch.Tensor) -> None:
        self.bits = pack_nonzero(out)
        self.shape, self.stride = out.shape, out.stride()
        self.dtype, self.device = out.dtype, out.device
        self.contiguous = out.is_contiguous()

    def unpack(self) -> torch.Tensor:
        passes = unpack_as(self.bits, self.shape, self.dtype)
        if self.contiguous:
            return passes
        out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        return out.copy_(passes)


def _threshold_backward(grad: torch.Tensor, passes: torch.Tensor) -> torch.Tensor:
    """PyTorch's ReLU backward kernel, ``passes <= 0 ? 0 : grad``.

    # NOTE: the kernel is element-wise, so when both inputs share one layout its output may
    # alias ``passes`` exactly: that saves one full-size allocation per backward, and the
    # output layout is the one PyTorch would pick anyway.
    """
    if passes.stride() == grad.stride() and passes.is_contiguous():
        return torch.ops.aten.threshold_backward.grad_input(grad, passes, 0, grad_input=passes)
    return torch.ops.aten.threshold_backward(grad, passes, 0)


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
        ctx.shape, ctx.stride = out.shape, out.stride()
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        return _threshold_backward(grad, _unpack_like(ctx, grad)), None


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
        elif hooks_free():
            relu = torch.relu_ if self.inplace else torch.relu
            out = run_saving_less(_ReLUBits, relu, input)
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
            saved = out  # PyTorch's in-place backward reads the result
        else:
            saved = x  # PyTorch's backward reads the input
            out = F.leaky_relu(x, slope)
        ctx.save_for_backward(pack_gt(saved))
        ctx.shape, ctx.stride = saved.shape, saved.stride()
        ctx.slope, ctx.inplace = slope, inplace
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        # NOTE: leaky_relu_backward reads only the sign of the tensor it is given, so a tensor
        # positive exactly where the mask is set gives bitwise PyTorch's own result.
        sign = _unpack_like(ctx, grad)
        gx = torch.ops.aten.leaky_relu_backward(grad, sign, ctx.slope, ctx.inplace)
        return gx, None, None


class LeakyReLU(KeepsNoInput, nn.LeakyReLU):
    """``nn.LeakyReLU`` that keeps a 1-bit sign mask instead of its input."""

    def _hr_forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.inplace and self.negative_slope < 0:
            return self._hr_torch_forward(input)  # PyTorch raises its own error for this
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
        ctx.shape, ctx.stride = out.shape, out.stride()
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        return _threshold_backward(grad, _unpack_like(ctx, grad)), None, None, None


class _HardtanhMixin(KeepsNoInput):
    def _hr_forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.min_val > self.max_val:
            return self._hr_torch_forward(input)  # PyTorch raises its own error for this
        return _HardtanhMask.apply(input, float(self.min_val), float(self.max_val), self.inplace)


class Hardtanh(_HardtanhMixin, nn.Hardtanh):
    """``nn.Hardtanh`` that keeps a 1-bit pass mask instead of its input."""


class ReLU6(_HardtanhMixin, nn.ReLU6):
    """``nn.ReLU6`` that keeps a 1-bit pass mask instead of its input."""
