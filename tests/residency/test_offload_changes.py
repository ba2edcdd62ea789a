"""A model changed after hr.offload (parameters attached, tied, dropped) trains like plain."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import headroom as hr
from headroom.residency import state_of
from headroom.transfer import binding

from ._models import VOCAB, Transformer


def _offload(model, store, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu",
                   store="cpu" if store == "cpu" else hr.DiskStore(tmp_path / "w"))


def _train(models, opts, steps=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 6), generator=g)
        for m, o in zip(models, opts, strict=True):
            torch.manual_seed(3)
            m(ids).sum().backward()
            o.step()
            o.zero_grad()


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_layer_attached_and_weights_tied_after_offload(store, tmp_path):
    torch.manual_seed(0)
    ref = Transformer(d=8, n=3)
    model = copy.deepcopy(ref)
    _offload(model, store, tmp_path)
    torch.manual_seed(4)
    extra = nn.Linear(8, 8)
    model.layers[1].extra = copy.deepcopy(extra)  # attached inside a block: in its group
    ref.layers[1].extra = extra
    for m in (ref, model):
        m.head.weight = m.emb.weight  # tied after the fact
    state = state_of(model)
    assert binding(model.layers[1].extra.weight) is not None
    assert {s.name for s in state.blocks[1].slots[-2:]} == {"layers.1.extra.weight",
                                                          "layers.1.extra.bias"}
    opts = [hr.HostOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2, fused=False)
            for m in (ref, model)]
    _train((ref, model), opts)
    _same(model, ref)
    assert model.head.weight is model.emb.weight
    assert "head.weight" not in {s.name for s in state.slots}  # the untied one left the store


def test_modules_built_elsewhere_while_a_model_is_offloaded(tmp_path):
    """Registration hooks watch every module of the process: others are left as they are."""
    torch.manual_seed(0)
    model = Transformer(d=8, n=3)
    _offload(model, "disk", tmp_path)
    lazy = nn.LazyLinear(4)  # its parameter has no shape until the first call
    assert lazy(torch.ones(2, 3)).shape == (2, 4)
    other = nn.Sequential(nn.Linear(3, 3))
    other[0].weight = nn.Parameter(torch.ones(3, 3))
    assert binding(other[0].weight) is None and torch.equal(other[0].weight, torch.ones(3, 3))
    assert len(state_of(model).slots) == len(list(model.parameters()))


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_parameter_replaced_after_offload_takes_its_place(store, tmp_path):
    """A parameter assigned over a stored one under the same name (PEFT casts bf16 adapters to
    fp32 this way): the new one is stored with its values, the old one leaves the store."""
    torch.manual_seed(0)
    ref = Transformer(d=8, n=3)
    model = copy.deepcopy(ref)
    _offload(model, store, tmp_path)
    for m in (ref, model):
        for lin in (m.layers[1].fc1, m.head):
            old = lin.weight
            lin.weight = nn.Parameter(old.detach() * 2)
    state = state_of(model)
    for lin in (model.layers[1].fc1, model.head):
        assert binding(lin.weight) is not None
        assert torch.equal(lin.weight.detach().clone(), ref.state_dict()[
            "head.weight" if lin is model.head else "layers.1.fc1.weight"])
    assert len(state.slots) == len(list(model.parameters()))
    assert binding(old) is None and torch.equal(old.detach(), ref.head.weight.detach() / 2)
    opts = [hr.HostOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2, fused=False)
            for m in (ref, model)]
    _train((ref, model), opts)
    _same(model, ref)


def test_a_failed_join_leaves_the_offloaded_model_as_it_was(tmp_path, monkeypatch):
    """Placing a new layer fails half-way (a full disk, say): the new layer's parameters are
    back in its module and the model keeps its offload (schedule, hooks, optimizer checks)
    and trains like plain."""
    from headroom.residency import _adopt

    torch.manual_seed(0)
    ref = Transformer(d=8, n=3)
    model = copy.deepcopy(ref)
    _offload(model, "disk", tmp_path)
    state = state_of(model)
    place, unplace = _adopt._placement

    def failing(state, st, dev, dtype, lay, claimed, placed):
        place(state, st, dev, dtype, lay, claimed, placed)
        raise OSError("no space left on device")

    monkeypatch.setattr(_adopt, "_placement", (failing, unplace))
    extra = nn.Linear(8, 8)
    with pytest.raises(OSError, match="no space"):
        model.layers[1].extra = extra
    monkeypatch.setattr(_adopt, "_placement", (place, unplace))
    assert binding(extra.weight) is None and state_of(model) is state
    assert state in _adopt._LIVE and state.handles
    assert not hasattr(model.layers[1], "extra")
    opts = [hr.HostOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2, fused=False)
            for m in (ref, model)]
    _train((ref, model), opts)
    _same(model, ref)
