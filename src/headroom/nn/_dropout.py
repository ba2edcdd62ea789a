"""Dropout that keeps the generator's position instead of its mask.

Forward runs PyTorch's own ops (CPU: ``bernoulli_`` noise; CUDA: ``native_dropout``) and keeps
the generator's position from just before them (CUDA: Philox seed and offset, 16 bytes; CPU:
the Mersenne Twister's 624 words and index, 2504 bytes, or PyTorch's own noise where that is no
larger); backward redraws the same noise from there and restores the generator: bitwise
``nn.Dropout``, and the random stream as PyTorch leaves it, for one extra ``bernoulli_``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from headroom.nn._common import first_order_only, note_consumer, records_graph, settle_pending

_ALIGN = 16  # bytes: the widest vectorized access of the CUDA dropout kernel

# CPUGeneratorImplState as get_state() returns it: seed u64 @0, left i32 @8, seeded i32 @12,
# next u64 @16, 624 words as u64 @24, then cached normal samples (bernoulli_ leaves them).
_STATE_BYTES = 5056
_WORDS = slice(24, 24 + 8 * 624)
_POSITION_BYTES = 4 * 626  # left, next and the 624 words, as uint32
_PHILOX_BYTES = 16  # an accelerator generator's seed and offset


def _position(state: torch.Tensor) -> np.ndarray | None:
    """The CPU generator's position in ``state``: ``[left, next, *words]`` as uint32."""
    if state.numel() != _STATE_BYTES:
        return None
    raw = state.numpy()
    out = np.empty(626, dtype=np.uint32)
    out[0] = raw[8:12].view(np.int32)[0]
    out[1] = raw[16:24].view(np.uint64)[0]
    out[2:] = raw[_WORDS].view(np.uint64)
    return out


def _state_at(now: torch.Tensor, position: np.ndarray) -> torch.Tensor:
    """``now`` (the generator's current state) moved to ``position``."""
    state = now.clone()
    raw = state.numpy()
    raw[8:12].view(np.int32)[0] = position[0]
    raw[16:24].view(np.uint64)[0] = position[1]
    raw[_WORDS].view(np.uint64)[:] = position[2:]
    return state


def _generator(device: torch.device) -> torch.Generator:
    if device.type in ("cpu", "meta"):  # meta: a dry run (hr.estimate), values never drawn
        return torch.default_generator
    index = device.index if device.index is not None else torch.accelerator.current_device_index()
    return torch.get_device_module(device.type).default_generators[index]


def _fused(x: torch.Tensor, p: float) -> bool:
    # The condition aten's dropout uses to pick the fused native_dropout kernel.
    return x.device.type in ("cuda", "xpu", "lazy", "privateuseone") and 0 < p < 1 and x.numel() > 0


def _like(ref_size, ref_stride, offset_bytes: int, dtype, device) -> torch.Tensor:
    """An uninitialized tensor with these strides, at ``offset_bytes`` past an alignment."""
    if offset_bytes == 0:
        return torch.empty_strided(ref_size, ref_stride, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    span = 1 + sum((n - 1) * st for n, st in zip(ref_size, ref_stride, strict=True) if n > 0)
    buf = torch.empty(span + _ALIGN // itemsize, dtype=dtype, device=device)
    return buf.as_strided(ref_size, ref_stride, offset_bytes // itemsize)


def _noise(out: torch.Tensor, p: float) -> torch.Tensor:
    """PyTorch's dropout noise, drawn into ``out``: ``bernoulli_(1 - p)``, scaled by it."""
    return out.bernoulli_(1 - p).div_(1 - p)


class _DropoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, inplace: bool) -> torch.Tensor:
        gen = _generator(x.device)
        # In-place dropout never takes the fused kernel in aten (dropout_ -> _dropout<true>).
        ctx.p, ctx.fused = p, not inplace and _fused(x, p)
        ctx.state = ctx.position = None
        if ctx.fused:
            ctx.state = gen.get_state()
            ctx.size, ctx.stride = x.size(), x.stride()
            ctx.offset = x.data_ptr() % _ALIGN
            ctx.dtype, ctx.device = x.dtype, x.device
            return torch.ops.aten.native_dropout(x, p, True)[0]
        position_bytes = _POSITION_BYTES if x.device.type == "cpu" else _PHILOX_BYTES
        small = x.numel() * x.element_size() <= position_bytes
        if not small:
            state = gen.get_state()
            if x.device.type == "cpu":
                ctx.position = _position(state)
            if ctx.position is None:
                ctx.state = state
        noise = _noise(torch.empty_like(x), p)
        ctx.size, ctx.stride = noise.size(), noise.stride()
        ctx.dtype, ctx.device = noise.dtype, noise.device
        if small:
            ctx.save_for_backward(noise)  # PyTorch's own noise, no larger than a position
        if inplace:
            ctx.mark_dirty(x)
            return x.mul_(noise)
        return x * noise

    @staticmethod
    @first_order_only
    def backward(ctx, grad: torch.Tensor):
        if ctx.state is None and ctx.position is None:
            (noise,) = ctx.saved_tensors
            return grad * noise, None, None
        gen = _generator(ctx.device)
        now = gen.get_state()
        gen.set_state(ctx.state if ctx.position is None else _state_at(now, ctx.position))
        try:
            if ctx.fused:
                like = _like(ctx.size, ctx.stride, ctx.offset, ctx.dtype, ctx.device)
                _, mask = torch.ops.aten.native_dropout(like, ctx.p, True)
            else:
                noise = _noise(torch.empty_strided(
                    ctx.size, ctx.stride, dtype=ctx.dtype, device=ctx.device), ctx.p)
        finally:
            gen.set_state(now)
        if ctx.fused:
            scale = 1.0 / (1.0 - ctx.p)
            return torch.ops.aten.native_dropout_backward(grad, mask, scale), None, None
        return grad * noise, None, None


class Dropout(nn.Dropout):
    """``nn.Dropout`` that keeps the generator's position and redraws its mask in backward."""

    def _hr_saves_input(self) -> bool:
        return False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        p = self.p
        if not (self.training and 0 < p < 1 and records_graph() and input.requires_grad
                and input.numel()):
            return super().forward(input)
        settle_pending()
        note_consumer(self, input)
        return _DropoutFunction.apply(input, float(p), self.inplace)
