"""hr.track_memory sees fewer activation bytes for a converted model."""

from __future__ import annotations

import copy

import pytest
import torch

import headroom as hr
from tests.nn._models import resnet_like, trainable, vgg_like


def _activation_peak(model: torch.nn.Module, x: torch.Tensor, input_grad: bool) -> int:
    x = x.clone().requires_grad_(input_grad)
    model(x).sum().backward()  # warm-up step: converted ReLUs learn their consumers
    with hr.track_memory(model=model) as mem:
        model(x).sum().backward()
    return mem.max_by_category["activations"]


@pytest.mark.parametrize("build", [vgg_like, resnet_like])
@pytest.mark.parametrize("case", ["all", "input", "norm"])
def test_activation_peak_is_lower(build, case):
    torch.manual_seed(0)
    plain = build()
    ours = hr.convert(copy.deepcopy(plain))
    for m in (plain, ours):
        trainable(m, case)
    x = torch.randn(4, 3, 16, 16)
    a = _activation_peak(plain, x, case == "input")
    b = _activation_peak(ours, x, case == "input")
    assert 0 < b < a
    if case != "all":
        assert b < 0.67 * a
