"""Offloaded parameters read from outside their block's forward (see [Note: uses outside a
block]): during the model's forward, between a forward and its backward, inside checkpointed
recomputation: each trains bitwise like the plain model, host memory and DiskStore."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import headroom as hr
from headroom.residency import state_of
from headroom.store import DiskStore
from tests.residency._models import FusedHead, Transformer, lm_batch, values


def _offload(model, store, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device="cpu" with a host store saves nothing
        return hr.offload(model, device="cpu", store=store, **kw)


@pytest.fixture(params=["cpu", "disk"])
def store(request, tmp_path):
    return "cpu" if request.param == "cpu" else DiskStore(tmp_path / "s", threads=2)


def _optimizer(model, kind):
    if kind == "host":
        return hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def _train(model, opt, loss_of, steps=3):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = lm_batch(g)
        torch.manual_seed(1)  # dropout
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()


def _lm(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _assert_same(ref, model):
    got = values(model)
    for k, v in values(ref).items():
        assert torch.equal(v, got[k]), k


def _at_rest(model):
    st = state_of(model)
    assert not any(b.resident for b in [*st.blocks, st.rest]), "device copies left resident"


@pytest.mark.parametrize("kind", ["host", "torch"])
def test_weights_read_inside_the_forward(store, kind):
    if kind == "torch" and isinstance(store, DiskStore):
        pytest.skip("torch.optim cannot step parameters on disk (HostOptimizer does)")
    torch.manual_seed(0)
    ref = FusedHead(n=3)
    model = _offload(copy.deepcopy(ref), store)
    assert state_of(model).plan.blocks  # the head and the layers are blocks of their own
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), _lm)
    _train(model, _optimizer(model, kind), _lm)
    _assert_same(ref, model)
    _at_rest(model)


@pytest.mark.parametrize("grad_accumulation", ["store", "device"])
def test_a_head_and_a_penalty_between_forward_and_backward(store, grad_accumulation):
    """A value head added after hr.offload, called on the output; an L2 penalty of a block's
    weight read through its module; two micro-batches per step."""
    torch.manual_seed(0)
    ref = Transformer(n=3)
    model = _offload(copy.deepcopy(ref), store, grad_accumulation=grad_accumulation)
    torch.manual_seed(2)
    value = nn.Linear(50, 1)
    ref.value = copy.deepcopy(value)
    model.value = value  # joins the offloaded model (hr.offload adopts it)

    def loss_of(m, x, y):
        out = m(x)
        return (F.cross_entropy(out.flatten(0, 1), y.flatten()) + m.value(out).pow(2).mean()
                + 1e-3 * m.layers[2].fc1.weight.pow(2).sum())

    for m, opt in ((ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)),
                   (model, _optimizer(model, "host"))):
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            for _ in range(2):
                x, y = lm_batch(g)
                torch.manual_seed(1)
                loss_of(m, x, y).backward()
            opt.step()
            opt.zero_grad()
    _assert_same(ref, model)
    _at_rest(model)


def test_a_checkpointed_use_outside_the_block(store):
    """The fused head under activation checkpointing: recomputed during backward, where the
    read finds the head still resident."""

    class Ckpt(FusedHead):
        def forward(self, x):
            h = self.emb(x)
            for layer in self.layers:
                h = layer(h)
            return checkpoint(lambda t: F.linear(self.ln(t), self.head.weight), h,
                              use_reentrant=False)

    torch.manual_seed(0)
    ref = Ckpt(n=3)
    model = _offload(copy.deepcopy(ref), store)
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), _lm)
    _train(model, _optimizer(model, "host"), _lm)
    _assert_same(ref, model)


def test_reads_at_rest_give_the_masters(store):
    """Outside forward and backward a module holds its masters: freezing through an
    attribute, building an optimizer, state_dict see them; a forward without a backward
    keeps nothing resident once the next forward starts."""
    torch.manual_seed(0)
    model = _offload(FusedHead(n=3), store)
    st = state_of(model)
    masters = {id(s.param) for s in st.slots}
    assert id(model.head.weight) in masters
    with torch.no_grad():
        model(torch.zeros(2, 4, dtype=torch.long))
    assert id(model.head.weight) in masters  # a forward without gradients leaves no window
    _at_rest(model)
    out = model(torch.zeros(2, 4, dtype=torch.long))
    with torch.no_grad():  # between forward and backward, without grad mode: the master
        assert id(model.head.weight) in masters
    assert id(model.head.weight) not in masters  # with it: the device copy
    out.sum().backward()
    assert id(model.head.weight) in masters
    _at_rest(model)
    model.head.weight.requires_grad_(False)  # freezing through the attribute at rest
    model.zero_grad()
    model(torch.zeros(2, 4, dtype=torch.long)).sum().backward()
    assert model.head.weight.grad is None
    assert model.layers[1].fc2.bias.grad is not None


def test_an_exception_between_forward_and_backward(store):
    """A forward whose loss computation outside the model raises: the next step starts clean
    and training stays exact."""
    torch.manual_seed(0)
    ref = FusedHead(n=3)
    model = _offload(copy.deepcopy(ref), store)
    opt = _optimizer(model, "host")
    out = model(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(RuntimeError):
        (out + model.layers[0].fc1.weight).sum()  # a shape error, after reading a weight
    del out
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), _lm)
    _train(model, opt, _lm)
    _assert_same(ref, model)
    _at_rest(model)


def test_copies_and_unoffload_hold_plain_parameter_dicts(store):
    model = _offload(FusedHead(n=2), store)
    plain = copy.deepcopy(model)
    assert all(type(m._parameters) is dict for m in plain.modules())
    hr.unoffload(model)
    assert all(type(m._parameters) is dict for m in model.modules())


def test_freezing_through_a_read_between_forward_and_backward(store):
    """``requires_grad_(False)`` on what a module gives between forward and backward (the
    device copy) freezes the parameter, as it would in plain PyTorch."""
    torch.manual_seed(0)
    ref = FusedHead(n=2)
    model = _offload(copy.deepcopy(ref), store)
    for m in (ref, model):
        out = m(torch.zeros(2, 4, dtype=torch.long))
        m.layers[0].fc1.weight.requires_grad_(False)
        out.sum().backward()
        assert not m.layers[0].fc1.weight.requires_grad
        assert m.layers[0].fc1.weight.grad is None  # frozen when its gradient arrived
        assert m.layers[0].fc2.weight.grad is not None
        m.zero_grad()
        m(torch.zeros(2, 4, dtype=torch.long)).sum().backward()
        assert m.layers[0].fc1.weight.grad is None  # and from the next forward on
        assert m.layers[0].fc2.weight.grad is not None
