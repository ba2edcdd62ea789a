"""torch.autograd.grad and backward(inputs=...) over offloaded parameters give what they give on
the plain model (host memory and DiskStore, fp32 on the CPU: bitwise)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import headroom as hr
from headroom.residency import state_of
from tests.conftest import accelerator_type

from ._models import CNN, VOCAB, Transformer, cnn_batch, lm_batch, lm_loss


def _pair(store: str, tmp_path, make=Transformer, **kw):
    torch.manual_seed(0)
    ref = make(**kw)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu", prefetch=0,
                   store="cpu" if store == "cpu" else hr.DiskStore(tmp_path / "w"))
    return ref, model


def _loss(model, batch):
    torch.manual_seed(2)  # the same dropout masks
    return lm_loss(model, batch)


def _stored_grads(model) -> dict[str, torch.Tensor]:
    opt = hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=1.0)
    out = {n: opt.grad(p) for n, p in model.named_parameters()}
    opt.close()
    return {n: g for n, g in out.items() if g is not None}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_grad_over_parameters_is_exact(store, tie, tmp_path):
    ref, model = _pair(store, tmp_path, tie=tie)
    batch = lm_batch(torch.Generator().manual_seed(1))
    want = torch.autograd.grad(_loss(ref, batch), list(ref.parameters()))
    got = torch.autograd.grad(_loss(model, batch), list(model.parameters()))
    assert len(got) == len(want)
    for (n, p), g, w in zip(model.named_parameters(), got, want, strict=True):
        assert type(g) is torch.Tensor and g.device == p.device, n
        assert torch.equal(g, w), n
    # nothing accumulated, as in plain PyTorch; dict inputs come back as a dict
    assert all(p.grad is None for p in model.parameters())
    assert not _stored_grads(model)
    got = torch.autograd.grad(_loss(model, batch), dict(model.named_parameters()))
    for (n, w) in zip(dict(ref.named_parameters()), want, strict=True):
        assert torch.equal(got[n], w), n


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_grad_over_inputs_and_parameters_together(store, tmp_path):
    ref, model = _pair(store, tmp_path, make=CNN)
    x, y = cnn_batch(torch.Generator().manual_seed(1))
    out = []
    for m in (ref, model):
        xi = x.clone().requires_grad_()
        loss = torch.nn.functional.cross_entropy(m(xi), y)
        params = [m.stages[1].conv1.weight, m.head.weight, m.stem.bias]
        out.append(torch.autograd.grad(loss, [xi, *params], retain_graph=True))
        out.append(torch.autograd.grad(loss, params[:1]))  # the graph was retained
    for a, b in zip(out[:2], out[2:], strict=True):
        assert len(a) == len(b)
        for ga, gb in zip(a, b, strict=True):
            assert torch.equal(ga, gb)


@pytest.mark.parametrize("how", ["tensor", "function"])
@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_backward_with_inputs_accumulates_only_those(store, how, tmp_path):
    ref, model = _pair(store, tmp_path)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # the second backward accumulates onto the first
        batch = lm_batch(g)
        for m in (ref, model):
            names = ("layers.1.qkv.weight", "head.weight", "emb.weight")
            inputs = [m.get_parameter(n) for n in names]
            loss = _loss(m, batch)
            if how == "tensor":
                loss.backward(inputs=inputs)
            else:
                torch.autograd.backward([loss], inputs=inputs)
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    got = _stored_grads(model)
    assert set(want) == set(names)
    assert set(got) == set(want)
    for n, w in want.items():
        assert torch.equal(got[n], w), n
    # and a step from there is the plain model's
    for m in (ref, model):
        opt = (torch.optim.SGD(m.parameters(), lr=0.5) if m is ref
               else hr.HostOptimizer(m.parameters(), torch.optim.SGD, lr=0.5))
        opt.step()
    got_values = {n: p for n, p in model.state_dict().items()}
    for n, p in ref.state_dict().items():
        assert torch.equal(got_values[n], p), n


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_unused_and_frozen_parameters_as_in_plain_pytorch(store, tmp_path):
    ref, model = _pair(store, tmp_path)
    batch = lm_batch(torch.Generator().manual_seed(1))
    name = "layers.0.fc1.weight"
    results = []
    for m in (ref, model):
        p = m.get_parameter(name)
        p.requires_grad_(False)
        loss = _loss(m, batch)  # p frozen in this forward: not in the graph
        p.requires_grad_(True)
        with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
            torch.autograd.grad(loss, [p], retain_graph=True)
        other = m.get_parameter("layers.0.fc2.weight")
        results.append(torch.autograd.grad(loss, [p, other], allow_unused=True,
                                           retain_graph=True))
        results.append(torch.autograd.grad(loss, [p, other], materialize_grads=True,
                                           retain_graph=True))
        other.requires_grad_(False)  # frozen after the forward: refused by torch itself
        with pytest.raises(RuntimeError, match="does not require grad"):
            torch.autograd.grad(loss, [other])
        other.requires_grad_(True)
    (a_none, a_zero), (b_none, b_zero) = results[:2], results[2:]
    assert a_none[0] is None and b_none[0] is None
    assert torch.equal(a_none[1], b_none[1])
    assert torch.equal(a_zero[0], torch.zeros_like(ref.get_parameter(name)))
    for x, y in zip(a_zero, b_zero, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_double_backward_over_parameters_is_refused(store, tmp_path):
    ref, model = _pair(store, tmp_path)
    batch = lm_batch(torch.Generator().manual_seed(1))
    loss = _loss(model, batch)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    # the model goes on exactly afterwards
    for m in (ref, model):
        _loss(m, batch).backward()
    got = _stored_grads(model)
    for n, p in ref.named_parameters():
        assert torch.equal(got[n], p.grad), n


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_grad_over_all_parameters_releases_blocks_as_backward_does(store, tmp_path):
    """Each block is released once its gradients are captured: with prefetch=0, at most one
    block is on the device at any point of the backward (as in loss.backward())."""
    _, model = _pair(store, tmp_path, n=5)
    state = state_of(model)
    most = []
    inner = state._pre_backward

    def counting(block):
        inner(block)
        most.append(sum(b.resident for b in state.blocks))

    state._pre_backward = counting
    ids = torch.randint(0, VOCAB, (2, 6))
    torch.autograd.grad(model(ids).sum(), list(model.parameters()))
    assert len(most) == 6 and max(most) == 1  # 5 blocks and the outside group
    assert not any(b.resident for b in state.blocks)


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_masters_get_their_class_back(store, tmp_path):
    ref, model = _pair(store, tmp_path)
    p = model.get_parameter("layers.0.fc1.weight")
    assert isinstance(p, nn.Parameter)
    c = copy.deepcopy(p)  # a plain parameter with the values, as before
    assert type(c) is nn.Parameter and torch.equal(c, ref.layers[0].fc1.weight)
    hr.unoffload(model)
    for p in model.parameters():
        assert type(p) is nn.Parameter


@pytest.mark.gpu
@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_grad_and_backward_inputs_on_an_accelerator(store, tmp_path):
    """Device copies on the accelerator, masters on the host: torch.autograd.grad returns the
    plain device model's gradients on the host; backward(inputs=...) stores only those."""
    dev = accelerator_type()
    torch.manual_seed(0)
    ref = Transformer()
    model = copy.deepcopy(ref)
    hr.offload(model, device=dev, store="cpu" if store == "cpu" else hr.DiskStore(tmp_path / "w"))
    ref.to(dev)
    batch = [t.to(dev) for t in lm_batch(torch.Generator().manual_seed(1))]
    want = torch.autograd.grad(_loss(ref, batch), list(ref.parameters()))
    got = torch.autograd.grad(_loss(model, batch), list(model.parameters()))
    for (n, p), g, w in zip(model.named_parameters(), got, want, strict=True):
        assert g.device == p.device, n
        torch.testing.assert_close(g, w.cpu(), msg=n)
    names = ("layers.1.qkv.weight", "head.weight")
    for m in (ref, model):
        _loss(m, batch).backward(inputs=[m.get_parameter(n) for n in names])
    got = _stored_grads(model)
    assert set(got) == set(names)
    for n in names:
        torch.testing.assert_close(got[n], ref.get_parameter(n).grad.cpu(), msg=n)
    assert not any(b.resident for b in state_of(model).blocks)
