"""Reflection and replication padding that keep only the input's shape for backward (PyTorch's
nodes save the input, whose sizes alone their kernels read), alone and inside convolutions with
``padding_mode="reflect"`` or ``"replicate"``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from headroom.nn._common import (
    PoolOrPad,
    TensorMeta,
    first_order_only,
    per_dimension,
    records_graph,
)

_KERNEL = {"reflect": "reflection_pad{}d_backward", "replicate": "replication_pad{}d_backward"}


class _PadFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, pad: tuple[int, ...], mode: str) -> torch.Tensor:
        out = F.pad(x, pad, mode=mode)
        ctx.meta = TensorMeta(x)
        ctx.pad = list(pad)
        ctx.backward_op = getattr(torch.ops.aten, _KERNEL[mode].format(len(pad) // 2))
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad: torch.Tensor):
        return ctx.backward_op(grad, ctx.meta.empty(), ctx.pad), None, None


def pad(x: torch.Tensor, padding: Sequence[int], mode: str) -> torch.Tensor:
    """``F.pad(x, padding, mode)``, bitwise, keeping only ``x``'s shape when mode needs one."""
    padding = tuple(padding)
    if (
        mode in ("reflect", "replicate")
        and len(padding) in (2, 4, 6)
        and x.requires_grad
        and records_graph()
    ):
        return _PadFunction.apply(x, padding, mode)
    return F.pad(x, padding, mode=mode)


class _PadMixin(PoolOrPad):
    _hr_mode: str

    def _hr_forward(self, input: torch.Tensor) -> torch.Tensor:
        return pad(input, self.padding, self._hr_mode)


_DOC = "``nn.{name}`` that keeps only its input's shape for backward."
ReflectionPad1d, ReflectionPad2d, ReflectionPad3d = per_dimension(
    __name__, _PadMixin, (nn.ReflectionPad1d, nn.ReflectionPad2d, nn.ReflectionPad3d), _DOC,
    _hr_mode="reflect")
ReplicationPad1d, ReplicationPad2d, ReplicationPad3d = per_dimension(
    __name__, _PadMixin, (nn.ReplicationPad1d, nn.ReplicationPad2d, nn.ReplicationPad3d), _DOC,
    _hr_mode="replicate")
