"""The phase of an offloaded model, one value: resting, forward, backward (or both)."""

import warnings

import torch
from torch import nn

import headroom as hr
from headroom.residency import Phase, state_of


def test_phase_is_resting_forward_then_backward():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # host store on a CPU: mechanics only
        hr.offload(model, device="cpu", store="cpu")
    state = state_of(model)
    seen = []
    model[1].register_forward_hook(lambda *a: seen.append(("fwd", state.phase, state.busy)))
    assert state.phase == Phase.RESTING and not state.busy
    out = model(torch.randn(4, 8))
    out.register_hook(lambda g: seen.append(("bwd", state.phase, state.busy)))
    assert state.phase == Phase.RESTING
    out.sum().backward()
    assert seen == [("fwd", Phase.FORWARD, True), ("bwd", Phase.BACKWARD, True)]
    assert state.phase == Phase.RESTING and not state.busy
