"""``param.grad`` of a parameter whose gradient the host optimizer keeps on the host.

A parameter on an accelerator, or in bf16/fp16 with an fp32 master, hands its gradient to the
host as soon as backward finishes it; ``param.grad`` then reads that host gradient (in fp32:
the gradient the step uses) through a `headroom.transfer.StoreTensor`, so
``torch.nn.utils.clip_grad_norm_``, ``GradScaler.unscale_`` and frameworks that clip see it.
"""

from __future__ import annotations

import torch

from headroom.transfer import GradSource, Mover, ParamBinding, StoreTensor

__all__ = ["host_grad"]


def host_grad(p: torch.Tensor, b: ParamBinding, mover: Mover) -> StoreTensor:
    """A tensor with ``p``'s shape, dtype and device whose ops run on ``b``'s gradient.

    A later backward's gradient is added through ``mover`` (in the background on an
    accelerator), as the first one was.
    """
    src = GradSource(b, push=lambda g: mover.push_grad(g, b, accumulate=True))
    return StoreTensor(src, tuple(p.shape), dtype=p.dtype, device=p.device)
