"""Which parameters a HostOptimizer steps: frozen ones, assigned gradients, changed groups."""

from __future__ import annotations

import pytest
import torch

import headroom as hr
from tests.optim._models import loss_fn, make_model


def test_frozen_parameters_are_accepted_and_skipped_like_torch():
    ref, model = make_model(), make_model()
    for m in (ref, model):
        m.blocks[1].requires_grad_(False)  # a frozen block among the parameters
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    for s in range(3):
        for m, o in ((ref, plain), (model, opt)):
            loss_fn(m, s).backward()
            o.step()
            o.zero_grad()
    for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    assert torch.equal(model.blocks[1].fc1.weight, make_model().blocks[1].fc1.weight)
    # Unfrozen later: stepped from then on, as torch does.
    for m in (ref, model):
        m.blocks[1].requires_grad_(True)
    for m, o in ((ref, plain), (model, opt)):
        loss_fn(m, 9).backward()
        o.step()
    for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_assigned_low_precision_gradients_step_like_an_fp32_master_adamw(dtype):
    torch.manual_seed(0)
    init = [torch.randn(5, 3), torch.randn(7)]
    params = [torch.nn.Parameter(t.to(dtype)) for t in init]
    opt = hr.HostOptimizer(params, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    # Reference: fp32 masters made from the low-precision values, fp32 gradients, fused AdamW.
    masters = [p.detach().float().clone() for p in params]
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    for s in range(4):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * s + i))
                 .to(dtype) for i, p in enumerate(params)]
        for p, g in zip(params, grads, strict=True):
            p.grad = g  # assigned, as many loops and test suites do
        for m, g in zip(masters, grads, strict=True):
            m.grad = g.float()
        opt.step()
        ref.step()
        opt.zero_grad()
        for p, m in zip(params, masters, strict=True):
            assert torch.equal(p.detach(), m.to(dtype)), s
    st = opt.state_dict()["state"]
    for i, m in enumerate(masters):
        assert torch.equal(st[i]["master"], m)
        assert torch.equal(st[i]["exp_avg_sq"], ref.state[m]["exp_avg_sq"])


def test_replaced_param_list_is_refused_and_duplicates_are_refused():
    w, v = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.zeros(3))
    opt = hr.HostOptimizer([w], torch.optim.AdamW, lr=0.1)
    w.grad = torch.ones(3)
    opt.step()
    opt.zero_grad()
    before = w.detach().clone()
    opt.param_groups[0]["params"] = [v]
    v.grad, w.grad = torch.ones(3), torch.ones(3)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\] was changed.*"
                       "add_param_group"):
        opt.step()
    assert torch.equal(w, before) and torch.equal(v, torch.zeros(3))  # nothing stepped
    opt.param_groups[0]["params"] = [w]
    opt.add_param_group({"params": [v]})  # the supported way: followed
    opt.step()
    assert not torch.equal(w, before) and not torch.equal(v, torch.zeros(3))
    with pytest.raises(ValueError, match="listed twice"):
        hr.HostOptimizer([w, w], torch.optim.AdamW, lr=0.1)
    with pytest.raises(ValueError, match="listed twice"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))] * 2})
