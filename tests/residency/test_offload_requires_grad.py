"""requires_grad changed on the masters after hr.offload behaves as in plain PyTorch."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import headroom as hr
from headroom.residency import state_of

from ._models import VOCAB, Transformer


def _step(model, ids):
    torch.manual_seed(3)  # the same dropout masks in both models
    model(ids).sum().backward()


@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_freezing_and_unfreezing_after_offload(store, tie, tmp_path):
    torch.manual_seed(0)
    ref = Transformer(d=8, n=3, tie=tie)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu",
                   store="cpu" if store == "cpu" else hr.DiskStore(tmp_path / "w"))
    ids = torch.randint(0, VOCAB, (2, 6))
    for m in (ref, model):
        m.requires_grad_(False)  # everything frozen, then a few unfrozen (as PEFT does)
        m.layers[1].qkv.weight.requires_grad_(True)
        m.ln.weight.requires_grad_(True)  # outside the blocks
    for m in (ref, model):
        _step(m, ids)
    want = {n for n, p in ref.named_parameters() if p.grad is not None}
    got = {n for n, p in model.named_parameters() if p.grad is not None}
    assert want == {"layers.1.qkv.weight", "ln.weight"}
    assert got == want
    opt = hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
    for n, p in model.named_parameters():
        g = opt.grad(p)
        if n in want:
            assert torch.equal(g, dict(ref.named_parameters())[n].grad), n
        else:
            assert g is None, n
    # unfreezing again: the embedding (outside the blocks) gets its gradient back
    for m in (ref, model):
        m.zero_grad()
        m.emb.weight.requires_grad_(True)
        _step(m, ids)
    got = {n for n, p in model.named_parameters() if p.grad is not None}
    assert got == {n for n, p in ref.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_frozen_parameter_outside_blocks_stays_for_input_gradients(store, tmp_path):
    """A trainable head outside the blocks finishes its gradient first; the frozen final norm
    (also outside) is still needed for the gradient of its input afterwards."""
    torch.manual_seed(0)
    ref = Transformer(d=8, n=3)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu",
                   store="cpu" if store == "cpu" else hr.DiskStore(tmp_path / "w"))
    rest = state_of(model).rest
    assert {s.name for s in rest.slots} >= {"ln.weight", "head.weight"}
    resident = []  # whether the norm's weight was on the device when its backward ran

    def watch(module, args):
        args[0].register_hook(lambda g: resident.append(rest.resident))

    model.ln.register_forward_pre_hook(watch)
    ids = torch.randint(0, VOCAB, (2, 6))
    for m in (ref, model):
        m.requires_grad_(False)
        m.head.weight.requires_grad_(True)
        m.layers[0].fc1.weight.requires_grad_(True)
        for _ in range(3):
            _step(m, ids)
    assert resident == [True] * 3
    opt = hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
    for n, p in ref.named_parameters():
        if p.grad is not None:
            assert torch.equal(opt.grad(dict(model.named_parameters())[n]), p.grad), n
