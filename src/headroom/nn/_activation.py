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

from headroom.nn._bitmask import pack_bool, pack_gt, pack_nonzero, unpack_as
from headroom.nn._common import (
    KeepsNoInput,
    consumers_keep_output,
    first_order_only,
    hooks_free,
    note_consumer,
    records_graph,
    register_relu_output,
    relu_sites,
    run_saving_less,
)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one stretch of its storage in a permuted (channels-last)
    order, so that they can be packed and unpacked in memory order."""
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)


def _pack_nonzero_layout(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``t != 0`` packed, and whether in memory order (``t`` channels-last, see :func:`_dense`)
    rather than row-major order. Memory order packs and unpacks without a layout copy."""
    if not t.is_contiguous() and _dense(t):
        return pack_nonzero(t.as_strided((t.numel(),), (1,))), True
    return pack_nonzero(t), False


def _unpack_layout(
    bits: torch.Tensor,
    shape: torch.Size,
    stride: tuple[int, ...],
    memory_order: bool,
    dtype: torch.dtype,
    *,
    reuse: bool = False,
) -> torch.Tensor:
    """The mask of :func:`_pack_nonzero_layout` as ``dtype`` values, positive where set, laid
    out with ``stride`` like the tensor PyTorch's backward would have read.

    # NOTE: the strides matter for bitwise equality downstream: an element-wise backward kernel
    # lays its output out like its inputs, and the next backward (a batch norm, say) takes a
    # different reduction order for a channels-last gradient than for a contiguous one.
    """
    if memory_order:
        flat = unpack_as(bits, (bits.numel() * 8,), dtype, reuse=reuse)
        return flat.as_strided(shape, stride)
    passes = unpack_as(bits, shape, dtype, reuse=reuse)
    if passes.stride() == stride:
        return passes
    out = torch.empty_strided(shape, stride, dtype=dtype, device=passes.device)
    return out.copy_(passes)


def _unpack_like(ctx, grad: torch.Tensor) -> torch.Tensor:
    """The mask saved by a Function's forward as ``grad.dtype`` values (see _unpack_layout)."""
    (bits,) = ctx.saved_tensors
    return _unpack_layout(bits, ctx.shape, ctx.stride, ctx.memory_order, grad.dtype)


class _ReLUBits:
    """A ReLU result saved as its non-zero mask (pack hook of ``ReluBackward0``).

    # NOTE: PyTorch's ReluBackward0 runs ``threshold_backward(grad, result, 0)``; handing it a
    # tensor positive exactly where the result was non-zero, laid out like the result, gives
    # bitwise its own gradient (see _ReLUMask). Packing happens when the node saves the result,
    # so the full result is never held by autograd. ReluBackward0 drops the unpacked tensor
    # when it returns, so it may live in a reused buffer, except in a double backward (grad
    # mode on), whose graph keeps it.
    """

    __slots__ = ("bits", "shape", "stride", "dtype", "memory_order")

    def __init__(self, out: torch.Tensor) -> None:
        self.bits, self.memory_order = _pack_nonzero_layout(out)
        self.shape, self.stride, self.dtype = out.shape, out.stride(), out.dtype

    def unpack(self) -> torch.Tensor:
        return _unpack_layout(
            self.bits,
            self.shape,
            self.stride,
            self.memory_order,
            self.dtype,
            reuse=not torch.is_grad_enabled(),
        )


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
    return records_graph() and x.requires_grad


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
        bits, ctx.memory_order = _pack_nonzero_layout(out)
        ctx.save_for_backward(bits)
        ctx.shape, ctx.stride = out.shape, out.stride()
        return out

    @staticmethod
    @first_order_only
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
        # NOTE: a call site is the producing node's type and the shape without the batch
        # dimension: one ReLU module used twice in a block (torchvision's BasicBlock) has two.
        site = (type(input.grad_fn), input.shape[1:])
        sites = relu_sites(self)
        if consumers_keep_output(sites, site):
            out = super().forward(input)
        elif hooks_free():
            out = run_saving_less(_ReLUBits, torch.relu_ if self.inplace else torch.relu, input)
        else:
            out = _ReLUMask.apply(input, self.inplace)
        register_relu_output(sites, site, out)
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
        ctx.shape, ctx.stride, ctx.memory_order = saved.shape, saved.stride(), False
        ctx.slope, ctx.inplace = slope, inplace
        return out

    @staticmethod
    @first_order_only
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
        ctx.shape, ctx.stride, ctx.memory_order = out.shape, out.stride(), False
        return out

    @staticmethod
    @first_order_only
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
