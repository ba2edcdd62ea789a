"""Dropout that keeps the random generator's state instead of its mask.

On CPU PyTorch's dropout draws ``noise = empty_like(x).bernoulli_(1 - p).div_(1 - p)`` and
returns ``x * noise``; autograd keeps ``noise``, a full float tensor. On CUDA it runs the fused
``native_dropout`` kernel and keeps a ``bool`` mask. Here the forward runs exactly those ops and
keeps only the generator state from just before them; backward puts the generator back in that
state, draws the same noise again with the same ops (so the same random numbers in the same
order), and restores the generator. The result is bitwise equal to ``nn.Dropout`` under the same
seed, for any ``p`` and both CPU and CUDA generators, and the surrounding random stream is left
exactly as PyTorch leaves it.

# NOTE: the trade-off is time: backward redraws the noise (one extra ``bernoulli_``), and the
# generator state is kept per call (5 KiB of host memory for the CPU Mersenne Twister, 16 bytes
# for a CUDA Philox generator), which is not device memory and not counted as activations.
"""

from __future__ import annotations

import torch
from torch import nn

from headroom.nn._common import first_order_only, note_consumer, records_graph

_ALIGN = 16  # bytes: the widest vectorized access of the CUDA dropout kernel


def _generator(device: torch.device) -> torch.Generator:
    if device.type in ("cpu", "meta"):  # meta: a dry run (hr.estimate), values never drawn
        return torch.default_generator
    index = device.index if device.index is not None else torch.accelerator.current_device_index()
    return torch.get_device_module(device.type).default_generators[index]


def _fused(x: torch.Tensor, p: float) -> bool:
    # NOTE: the condition aten's dropout uses to pick the fused native_dropout kernel.
    return x.device.type in ("cuda", "xpu", "lazy", "privateuseone") and 0 < p < 1 and x.numel() > 0


def _like(ref_size, ref_stride, offset_bytes: int, dtype, device) -> torch.Tensor:
    """An uninitialized tensor with the given strides whose address has the same alignment."""
    if offset_bytes == 0:
        return torch.empty_strided(ref_size, ref_stride, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    span = 1 + sum((n - 1) * st for n, st in zip(ref_size, ref_stride, strict=True) if n > 0)
    buf = torch.empty(span + _ALIGN // itemsize, dtype=dtype, device=device)
    return buf.as_strided(ref_size, ref_stride, offset_bytes // itemsize)


class _DropoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, inplace: bool) -> torch.Tensor:
        gen = _generator(x.device)
        ctx.state = gen.get_state()
        # NOTE: in-place dropout never takes the fused kernel in aten (dropout_ -> _dropout<true>).
        ctx.p, ctx.fused = p, not inplace and _fused(x, p)
        if ctx.fused:
            ctx.size, ctx.stride = x.size(), x.stride()
            ctx.offset = x.data_ptr() % _ALIGN
            ctx.dtype, ctx.device = x.dtype, x.device
            return torch.ops.aten.native_dropout(x, p, True)[0]
        noise = torch.empty_like(x)
        noise.bernoulli_(1 - p)
        noise.div_(1 - p)
        ctx.size, ctx.stride = noise.size(), noise.stride()
        ctx.dtype, ctx.device = noise.dtype, noise.device
        if inplace:
            ctx.mark_dirty(x)
            return x.mul_(noise)
        return x * noise

    @staticmethod
    @first_order_only
    def backward(ctx, grad: torch.Tensor):
        gen = _generator(ctx.device)
        now = gen.get_state()
        gen.set_state(ctx.state)
        try:
            if ctx.fused:
                like = _like(ctx.size, ctx.stride, ctx.offset, ctx.dtype, ctx.device)
                _, mask = torch.ops.aten.native_dropout(like, ctx.p, True)
            else:
                noise = torch.empty_strided(
                    ctx.size, ctx.stride, dtype=ctx.dtype, device=ctx.device
                )
                noise.bernoulli_(1 - ctx.p)
                noise.div_(1 - ctx.p)
        finally:
            gen.set_state(now)
        if ctx.fused:
            scale = 1.0 / (1.0 - ctx.p)
            return torch.ops.aten.native_dropout_backward(grad, mask, scale), None, None
        return grad * noise, None, None


class Dropout(nn.Dropout):
    """``nn.Dropout`` that keeps the generator state and redraws its mask in backward."""

    def _hr_saves_input(self) -> bool:
        return False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        p = self.p
        if not (self.training and 0 < p < 1 and records_graph() and input.requires_grad):
            return super().forward(input)
        if input.numel() == 0:
            return super().forward(input)
        note_consumer(self, input)
        return _DropoutFunction.apply(input, float(p), self.inplace)
