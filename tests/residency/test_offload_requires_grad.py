"""requires_grad changed on the masters after hr.offload behaves as in plain PyTorch."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import headroom as hr
from headroom.residency import state_of

from ._models import VOCAB, Transformer, lm_batch, lm_loss, values


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


# ---------------------------------------------------------------- requires_grad_ during a step
# (store, optimizer): torch.optim steps masters in host memory only; HostOptimizer any store
_SETUPS = [("cpu", "torch"), ("cpu", "host"), ("disk", "host")]
# one parameter inside a block, one outside the blocks
_FLIPPED = ("layers.1.qkv.weight", "head.weight")
_FLIPPED_TIED = ("layers.1.qkv.weight", "emb.weight")  # the embedding is also the head


def _pair(store: str, opt: str, tmp_path, *, tie: bool = False):
    torch.manual_seed(0)
    ref = Transformer(d=8, n=3, tie=tie)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu",
                   store="cpu" if store == "cpu" else hr.DiskStore(tmp_path / "w"))
    # HostOptimizer steps with torch's fused CPU kernel: bitwise the fused reference
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=opt == "host")
    if opt == "torch":
        o = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        o = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    return (ref, opt_ref), (model, o)


def _set(model, names, flag: bool) -> None:
    params = dict(model.named_parameters())
    for n in names:
        params[n].requires_grad_(flag)


def _grads(model, opt) -> set[str]:
    """Names of the parameters with a gradient (HostOptimizer reads the stored ones)."""
    if isinstance(opt, hr.HostOptimizer):
        return {n for n, p in model.named_parameters() if opt.grad(p) is not None}
    return {n for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(ref, model):
    got = values(model)
    for n, p in ref.named_parameters():
        assert torch.equal(got[n], p.detach()), n


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(("store", "opt"), _SETUPS)
def test_frozen_between_forward_and_backward(store, opt, tie, tmp_path):
    """requires_grad_(False) after forward, before backward: no gradient, no update (autograd
    checks the flag when the gradient arrives), on any store and with either optimizer."""
    pairs = _pair(store, opt, tmp_path, tie=tie)
    flipped = _FLIPPED_TIED if tie else _FLIPPED
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        batch = lm_batch(g)
        seen = []
        for m, o in pairs:
            torch.manual_seed(2)
            loss = lm_loss(m, batch)
            if step == 1:  # stepped before and after, skipped in between
                _set(m, flipped, False)
            loss.backward()
            seen.append(_grads(m, o))
            o.step()
            o.zero_grad()
            _set(m, flipped, True)
        assert seen[0] == seen[1]
        assert not set(flipped) & seen[0] if step == 1 else set(flipped) <= seen[0]
    _assert_same(pairs[0][0], pairs[1][0])


@pytest.mark.parametrize(("store", "opt"), _SETUPS)
def test_unfrozen_between_forward_and_backward(store, opt, tmp_path):
    """requires_grad_(True) after a forward that ran frozen: the parameter was not in the
    graph, so no gradient (as plain PyTorch); the next forward trains it."""
    pairs = _pair(store, opt, tmp_path)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        batch = lm_batch(g)
        seen = []
        for m, o in pairs:
            if step == 1:
                _set(m, _FLIPPED, False)
            torch.manual_seed(2)
            loss = lm_loss(m, batch)
            _set(m, _FLIPPED, True)
            loss.backward()
            seen.append(_grads(m, o))
            o.step()
            o.zero_grad()
        assert seen[0] == seen[1]
        assert not set(_FLIPPED) & seen[0] if step == 1 else set(_FLIPPED) <= seen[0]
    _assert_same(pairs[0][0], pairs[1][0])


@pytest.mark.parametrize(("store", "opt"), _SETUPS)
def test_frozen_between_steps(store, opt, tmp_path):
    """Freezing after some steps and unfreezing later (the usual way): frozen parameters keep
    their values and optimizer state; training resumes exactly."""
    pairs = _pair(store, opt, tmp_path)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        batch = lm_batch(g)
        for m, o in pairs:
            _set(m, _FLIPPED, step not in (1, 2))
            torch.manual_seed(2)
            lm_loss(m, batch).backward()
            o.step()
            o.zero_grad()
    _assert_same(pairs[0][0], pairs[1][0])
