"""requires_grad changed on the masters after hr.offload behaves as in plain PyTorch."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import headroom as hr

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
