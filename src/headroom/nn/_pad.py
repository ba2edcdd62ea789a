"""Reflection and replication padding that keep only the input's shape for backward (PyTorch's
nodes save the input, whose sizes alone their kernels read), alone and inside convolutions with
``padding_mode="reflect"`` or ``"replicate"``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from headroom.nn._common import PoolOrPad, ShapeOnlyFunction, per_dimension, records_graph

_KERNEL = {"reflect": "reflection_pad{}d_backward", "replicate": "replication_pad{}d_backward"}


def pad(x: torch.Tensor, padding: Sequence[int], mode: str) -> torch.Tensor:
    """``F.pad(x, padding, mode)``, bitwise, keeping only ``x``'s shape when mode needs one."""
    padding = tuple(padding)
    if (
        mode in ("reflect", "replicate")
        and len(padding) in (2, 4, 6)
        and x.requires_grad
        and records_graph()
    ):
        bwd = getattr(torch.ops.aten, _KERNEL[mode].format(len(padding) // 2))
        return ShapeOnlyFunction.apply(x, F.pad, (padding, mode), bwd, (list(padding),))
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
