"""hr.plan on CPU: applied plans measure within their budget and train bitwise like plain."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import headroom as hr
from headroom.planner import PlanError, parse_bytes, plan


def model_fn():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.ReLU()) for _ in range(8)],
                         nn.Linear(128, 4))


X = torch.randn(32, 128)


def loss_fn(out):
    return out.square().mean()


def train(model, opt, steps=3):
    """``steps`` steps; the second one measured (steady state)."""
    def step():
        loss_fn(model(X)).backward()
        opt.step()
        opt.zero_grad()

    step()
    with hr.track_memory(model=model, optimizer=opt) as mem:
        step()
    for _ in range(steps - 2):
        step()
    return mem


def final_params(model):
    if getattr(model, "_headroom_offload", None) is not None:
        model = hr.unoffload(model)
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def plain():
    model = model_fn()
    mem = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return mem.peak, final_params(model)


@pytest.mark.parametrize("fraction", [0.75, 0.5, 0.25])
def test_applied_plan_fits_and_trains_bitwise(plain, fraction, tmp_path):
    peak, expected = plain
    budget = int(peak * fraction)
    p = plan(model_fn(), (X,), loss_fn=loss_fn, budget=budget, device="cpu",
             optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2}, disk=tmp_path)
    assert p.peak <= budget
    assert "estimated peak" in str(p) and "hr." in p.code()
    model, opt = p.apply(model_fn())
    mem = train(model, opt)
    assert mem.peak <= budget, (mem.peak, budget, str(p))
    got = final_params(model)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_plain_fits_when_budget_is_large():
    p = plan(model_fn(), (X,), loss_fn=loss_fn, budget="1GiB", device="cpu",
             optimizer=torch.optim.AdamW)
    assert p.choice.describe() == ["nothing: the plain step fits"]
    model, opt = p.apply(model_fn())
    assert type(opt) is torch.optim.AdamW


def test_impossible_budget_says_smallest_and_what_dominates(tmp_path):
    with pytest.raises(PlanError, match=r"smallest estimated peak is .* of which \w+ take") as e:
        plan(model_fn(), (X,), loss_fn=loss_fn, budget=1000, device="cpu",
             optimizer=torch.optim.AdamW, disk=tmp_path)
    assert e.value.smallest > 1000
    with pytest.raises(PlanError, match="disk="):
        plan(model_fn(), (X,), loss_fn=loss_fn, budget=1000, device="cpu",
             optimizer=torch.optim.AdamW)


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 << 30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes(4096) == 4096
    for bad in ("eight", "8 parsecs", -1, "0GiB"):
        with pytest.raises(ValueError, match="bytes|positive"):
            parse_bytes(bad)


def test_cuda_plan_on_a_cpu_only_build():
    est = hr.estimate(model_fn(), (X,), loss_fn=loss_fn, optimizer=torch.optim.AdamW,
                      device="cuda")
    budget = est.peak_reserved // 2
    p = plan(model_fn(), (X,), loss_fn=loss_fn, budget=budget, device="cuda",
             optimizer=torch.optim.AdamW)
    assert p.device == "cuda:0" and p.peak <= budget
    assert p.choice.params != "device" or p.choice.optimizer_state != "device"


def test_a_failing_dry_run_leaves_the_model_unchanged():
    model = model_fn()
    before = [p.detach().clone() for p in model.parameters()]

    def failing_loss(out):
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        plan(model, (X,), loss_fn=failing_loss, budget="1GiB", device="cpu",
             optimizer=torch.optim.AdamW)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not hasattr(model, "_headroom_offload")
