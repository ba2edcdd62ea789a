"""Dropout redraws its mask in backward: bitwise equal to nn.Dropout, same random stream."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import headroom.nn as hnn
from tests.conftest import DEVICES
from tests.nn._util import saved_bytes


def _run(layer: nn.Module, x: torch.Tensor, seed: int):
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    inp = x * 1.0 if layer.inplace else x
    nbytes, out = saved_bytes(lambda: layer(inp))
    torch.rand(3, device=x.device)  # someone else draws between forward and backward
    (out * torch.arange(out.numel(), device=x.device).view_as(out)).sum().backward()
    after = torch.rand(4, device=x.device)  # the stream must continue exactly as with torch
    return out.detach(), x.grad, after, nbytes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("shape", [(3, 17, 50), (3, 17, 5)], ids=["position", "small"])
def test_dropout_bitwise_and_stream(device, p, inplace, shape):
    x = torch.randn(shape, device=device)
    plain, ours = nn.Dropout(p, inplace=inplace), hnn.Dropout(p, inplace=inplace)
    a, b = _run(plain, x, 7), _run(ours, x, 7)
    for u, v in zip(a[:3], b[:3], strict=True):
        assert torch.equal(u, v)
    if x.numel() * 4 > (2504 if device == "cpu" else 16):
        assert b[3] == 0 < a[3]  # the generator's position, no tensor saved
    else:
        assert b[3] == a[3]  # PyTorch's own noise: no larger than a position


def test_dropout_passthrough_cases():
    x = torch.randn(4, 6, requires_grad=True)
    assert hnn.Dropout(0.0)(x) is x
    assert hnn.Dropout(0.5).eval()(x) is x
    assert torch.equal(hnn.Dropout(1.0)(x), torch.zeros_like(x))


@pytest.mark.gpu
def test_dropout_cuda_unaligned_view():
    device = DEVICES[-1]
    base = torch.randn(1001, device=device)
    x = base[1:].view(8, 125)  # 4-byte offset: changes the fused kernel's vector width
    a, b = _run(nn.Dropout(0.3), x, 3), _run(hnn.Dropout(0.3), x, 3)
    for u, v in zip(a[:3], b[:3], strict=True):
        assert torch.equal(u, v)
