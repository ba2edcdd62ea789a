"""hr.plan on CPU: applied plans measure within their budget and train bitwise like plain."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import headroom as hr
from headroom.planner import PlanError, Speeds, parse_bytes, plan

# Declared speeds: which plan wins never depends on how loaded the machine is.
SPEEDS = Speeds(matmul=1e10, conv=1e10, memory=1e10, op=1e-5, disk_read=1e9, disk_write=5e8)
# NOTE: the host optimizer's slices for state on disk: half of model_fn's largest parameter, so
# that each is still stepped in several slices; the default (an eighth) makes every dry run
# step 4x as many slices, each through the dry run's dispatch modes, for the same checks.
SLICE = 32 << 10


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


@pytest.fixture(scope="module")
def plan_at(plain, tmp_path_factory):
    """``plan_at(fraction)``: the plan of model_fn for that fraction of the plain peak, searched
    once per module (a search is many dry runs); each fraction has a disk folder of its own."""
    # NOTE: a plan is not changed by reading it or by apply (which builds a new optimizer over
    # the model it is given), so the tests that ask for the same plan share one search.
    plans: dict = {}

    def at(fraction: float, **kw):
        key = (fraction, tuple(sorted(kw.items())))
        if key not in plans:
            plans[key] = plan(model_fn(), (X,), loss_fn=loss_fn, budget=int(plain[0] * fraction),
                              device="cpu", optimizer=torch.optim.AdamW,
                              optimizer_kwargs={"lr": 1e-2}, speeds=SPEEDS, slice_bytes=SLICE,
                              disk=tmp_path_factory.mktemp("plan"), **kw)
        return plans[key]

    return at


@pytest.fixture(scope="module")
def plan_1gib():
    """The plan of model_fn for a budget that holds the plain step."""
    return plan(model_fn(), (X,), loss_fn=loss_fn, budget="1GiB", device="cpu",
                optimizer=torch.optim.AdamW, speeds=SPEEDS)


@pytest.mark.parametrize("fraction", [0.75, 0.25])
def test_applied_plan_fits_and_trains_bitwise(plain, plan_at, fraction):
    """0.75 of the plain peak: the optimizer state and step go to disk; 0.25: the parameters
    too (half the peak chooses the same as 0.25)."""
    peak, expected = plain
    budget = int(peak * fraction)
    p = plan_at(fraction)
    assert p.peak <= budget
    assert "estimated peak" in str(p) and "hr." in p.code()
    compile(p.code(), "<plan>", "exec")
    model, opt = p.apply(model_fn())
    mem = train(model, opt)
    assert mem.peak <= budget, (mem.peak, budget, str(p))
    # the plan's peak is a dry run of the whole plan, what the applied plan measures, and room
    # for a gradient still being written to disk
    assert 0.95 * (p.peak - p.margin) <= mem.peak, (p.peak, mem.peak, str(p))
    got = final_params(model)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("cls,kw", [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
    (torch.optim.Adagrad, {"lr": 1e-2, "lr_decay": 0.01}),
    (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.5}),  # a class without fused=
], ids=lambda c: getattr(c, "__name__", ""))
def test_applied_plan_trains_bitwise_as_the_optimizer_named(cls, kw, tmp_path):
    """The host optimizer of an applied plan on the CPU is the class and arguments the user
    named, in the implementation ``cls(params, **kw)`` runs there: bitwise that call."""
    peak = hr.estimate(model_fn(), (X,), loss_fn=loss_fn, optimizer=cls, optimizer_kwargs=kw,
                       device="cpu").peak
    p = plan(model_fn(), (X,), loss_fn=loss_fn, budget=int(peak * 0.75), device="cpu",
             optimizer=cls, optimizer_kwargs=kw, disk=tmp_path, speeds=SPEEDS,
             slice_bytes=SLICE)
    assert p.choice.optimizer_state != "device", str(p)
    model, opt = p.apply(model_fn())
    assert isinstance(opt, hr.HostOptimizer) and opt.options.optimizer_class is cls
    ref = model_fn()
    train(ref, cls(ref.parameters(), **kw))
    train(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(final_params(model), final_params(ref),
                                                  strict=True))


def test_an_optimizer_instance_is_refused_naming_the_class_and_its_arguments():
    """A plan builds its optimizer over the model it applies to: an instance's learning rate
    would be lost, so it is refused rather than replaced by the class's defaults."""
    model = model_fn()
    with pytest.raises(TypeError, match=r"optimizer=torch.optim.AdamW, optimizer_kwargs="):
        plan(model, (X,), loss_fn=loss_fn, budget="1GiB", device="cpu", speeds=SPEEDS,
             optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))


def test_plain_fits_when_budget_is_large(plan_1gib):
    p = plan_1gib
    assert p.choice.describe() == ["nothing: the plain step fits"]
    model, opt = p.apply(model_fn())
    assert type(opt) is torch.optim.AdamW


def test_a_plan_names_the_fastest_plan_over_its_budget(plain, plan_at, plan_1gib):
    budget = int(plain[0] * 0.75)
    p = plan_at(0.75)
    choice, alt_peak, alt_time = p.faster_over_budget
    assert alt_peak > budget and alt_time < p.time_s
    assert choice == hr.planner.Choice(activation_min_bytes=p.choice.activation_min_bytes)
    text = str(p)
    assert "the fastest plan over the budget" in text and "nothing: the plain step\n" in text
    # nothing is faster than the plain step, so a plan that keeps it names no alternative
    assert plan_1gib.faster_over_budget is None


def test_impossible_budget_says_smallest_and_what_dominates(tmp_path):
    with pytest.raises(PlanError, match=r"smallest estimated peak is .* of which \w+ take") as e:
        plan(model_fn(), (X,), loss_fn=loss_fn, budget=1000, device="cpu",
             optimizer=torch.optim.AdamW, disk=tmp_path, speeds=SPEEDS, slice_bytes=SLICE)
    assert e.value.smallest > 1000
    with pytest.raises(PlanError, match="disk="):
        plan(model_fn(), (X,), loss_fn=loss_fn, budget=1000, device="cpu",
             optimizer=torch.optim.AdamW, speeds=SPEEDS, slice_bytes=SLICE)


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 << 30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes(4096) == 4096
    for bad in ("eight", "8 parsecs", -1, "0GiB"):
        with pytest.raises(ValueError, match="bytes|positive"):
            parse_bytes(bad)


def test_bad_budget_device_and_model_name_the_argument():
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="budget"):
            plan(model_fn(), (X,), loss_fn=loss_fn, budget=bad, device="cpu")
    with pytest.raises(ValueError, match="device 'tpu' is not a torch device.*device=.cuda"):
        plan(model_fn(), (X,), loss_fn=loss_fn, budget="1GiB", device="tpu")
    with pytest.raises(TypeError, match="torch.nn.Module, got NoneType"):
        plan(None, (X,), loss_fn=loss_fn, budget="1GiB", device="cpu")


def test_cuda_plan_on_a_cpu_only_build():
    def big():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(4)])

    x = torch.randn(32, 512)
    est = hr.estimate(big(), (x,), loss_fn=loss_fn, optimizer=torch.optim.AdamW, device="cuda")
    budget = est.peak_reserved // 2
    p = plan(big(), (x,), loss_fn=loss_fn, budget=budget, device="cuda",
             optimizer=torch.optim.AdamW)  # declared accelerator speeds
    assert p.device == "cuda:0" and p.peak <= budget
    assert p.choice.params != "device" or p.choice.optimizer_state != "device"
    # the plan's peak is the dry run of the whole plan, allocator model included
    assert p.peak == hr.estimate(big(), (x,), loss_fn=loss_fn, device="cuda",
                                 **_what_ifs(p)).peak_reserved


def _what_ifs(p) -> dict:
    """hr.estimate's options for the plan ``p`` (parameter offload and the host optimizer)."""
    import headroom.optim

    c = p.choice
    out: dict = {"optimizer": p.optimizer}
    if c.optimizer_state != "device":
        out["optimizer"] = headroom.optim.HostOptimizerOptions(
            p.optimizer, dict(p.optimizer_kwargs), "cpu" if c.optimizer_state == "host"
            else "disk", False, p.slice_bytes, 32 << 20)
    if c.params != "device":
        out["offload"] = {"store": "cpu" if c.params == "host" else "disk", "prefetch": 1}
    return out


def test_a_failing_dry_run_leaves_the_model_unchanged():
    model = model_fn()
    before = [p.detach().clone() for p in model.parameters()]

    def failing_loss(out):
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        plan(model, (X,), loss_fn=failing_loss, budget="1GiB", device="cpu",
             optimizer=torch.optim.AdamW, speeds=SPEEDS)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not hasattr(model, "_headroom_offload")


def deep():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(12)])


XD = torch.randn(2048, 64)


def test_a_budget_only_activation_offload_reaches(tmp_path):
    """Activations dominate: checkpointing keeps every block's input, so everything else turned
    on (with hr.convert or not, parameters and optimizer state on disk) stays above the budget;
    activation offload fits it."""
    import headroom.optim

    host = headroom.optim.HostOptimizerOptions(torch.optim.AdamW, {"fused": False}, "disk",
                                               False, 4 << 10, 32 << 20)
    rest = min(hr.estimate(deep(), (XD,), loss_fn=loss_fn, optimizer=host,
                           checkpoint=[str(i) for i in range(12)], prepare=prepare,
                           offload={"store": "disk", "prefetch": 1}).peak
               for prepare in (None, lambda m: hr.convert(m, inplace=True)))
    act = hr.estimate(deep(), (XD,), loss_fn=loss_fn, optimizer=torch.optim.AdamW,
                      offload_activations={"min_bytes": 4 << 10, "prefetch": 0}).peak
    assert act < 0.6 * rest
    budget = (rest + act) // 2
    p = plan(deep(), (XD,), loss_fn=loss_fn, budget=budget, device="cpu",
             optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2}, speeds=SPEEDS,
             disk=tmp_path)
    assert p.choice.activations == "disk", str(p)
    assert "offload_activations_in_forward(model, store=hr.DiskStore(" in p.code()
    compile(p.code(), "<plan>", "exec")

    model, opt = p.apply(deep())
    ref = deep()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def step(m, o):
        loss_fn(m(XD)).backward()
        o.step()
        o.zero_grad()

    step(model, opt)
    step(ref, ref_opt)
    with hr.track_memory(model=model, optimizer=opt) as mem:
        step(model, opt)
    step(ref, ref_opt)
    assert mem.peak <= budget, (mem.peak, budget, str(p))
    assert abs(p.peak - mem.peak) <= 0.05 * mem.peak, (p.peak, mem.peak)
    assert all(torch.equal(a, b) for a, b in zip(final_params(model), final_params(ref),
                                                  strict=True))


def test_activation_offload_in_forward_checks_and_removes(tmp_path):
    from headroom.planner import offload_activations_in_forward

    model = deep()
    with pytest.raises(ValueError, match="min_bytes"):
        offload_activations_in_forward(model, store=hr.DiskStore(tmp_path), min_bytes=-1)
    assert not model._forward_pre_hooks
    h = offload_activations_in_forward(model, store=hr.DiskStore(tmp_path), min_bytes=1 << 12)
    with hr.track_memory(model=model) as mem:
        model(XD).sum().backward()
    assert mem.resting_max.get("disk", {}).get("activations", 0) > 0
    h.remove()
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_forward_that_raises_leaves_activation_offload(tmp_path):
    from headroom import _saved_hooks
    from headroom.planner import offload_activations_in_forward

    class Failing(nn.Module):
        def forward(self, x):
            raise KeyError("injected")

    model = nn.Sequential(nn.Linear(64, 64), Failing())
    offload_activations_in_forward(model, store=hr.DiskStore(tmp_path), min_bytes=1 << 12)
    with pytest.raises(KeyError, match="injected"):
        model(XD)
    assert not _saved_hooks._keepers  # the context was left: nothing else is offloaded
    model[1] = nn.Identity()
    model(XD).sum().backward()  # and the next forward enters it again


# ---------------------------------------------------------------------------------------------
# fp32_masters: bf16/fp16 parameters trained from fp32 masters (hr.HostOptimizer) or not


def bf16_model():
    return model_fn().to(torch.bfloat16)


XB = X.to(torch.bfloat16)


def bf16_loss(out):
    return out.float().square().mean()


def _train_bf16(model, opt, steps=3):
    for _ in range(steps):
        bf16_loss(model(XB)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _masters_reference(steps=3):
    """Mixed precision by hand: fp32 masters of the bf16 parameters, AdamW on the masters, the
    bf16 gradients cast to fp32, the updated masters rounded back into the model."""
    model = bf16_model()
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-2, foreach=False)
    for _ in range(steps):
        bf16_loss(model(XB)).backward()
        for m, p in zip(masters, model.parameters(), strict=True):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters(), strict=True):
                p.copy_(m)
    return [p.detach().clone() for p in model.parameters()]


def _bf16_plan(budget, **kw):
    return plan(bf16_model(), (XB,), loss_fn=bf16_loss, budget=budget, device="cpu",
                optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2}, speeds=SPEEDS,
                slice_bytes=SLICE, **kw)


def test_fp32_masters_true_trains_a_bf16_model_from_masters():
    p = _bf16_plan("1GiB", fp32_masters=True)
    # the budget holds the plain step, but only the host optimizer gives masters
    assert p.choice.optimizer_state == "host" and p.choice.params == "device"
    assert p.fp32_masters and "fp32 masters" in str(p)
    compile(p.code(), "<plan>", "exec")
    assert "hr.HostOptimizer" in p.code()
    model, opt = p.apply(bf16_model())
    assert isinstance(opt, hr.HostOptimizer)
    got = _train_bf16(model, opt)
    want = _masters_reference()
    assert all(a.dtype == torch.bfloat16 for a in got)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_fp32_masters_false_updates_in_bf16_bitwise_the_plain_step(tmp_path):
    model = bf16_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bf16_loss(model(XB)).backward()
    opt.step()
    opt.zero_grad()
    with hr.track_memory(model=model, optimizer=opt) as mem:
        bf16_loss(model(XB)).backward()
        opt.step()
        opt.zero_grad()
    plain_peak = mem.peak
    model = bf16_model()
    want = _train_bf16(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    # a budget that the host optimizer reaches (adding masters) when nothing forbids it
    budget = int(plain_peak * 0.75)
    free = _bf16_plan(budget, disk=tmp_path)
    assert free.choice.optimizer_state != "device" and free.fp32_masters
    assert "fp32_masters=False forbids" in str(free)
    for p in (_bf16_plan("1GiB", fp32_masters=False), _bf16_plan("1GiB")):
        assert p.choice.optimizer_state == "device" and not p.fp32_masters
        assert "fp32 masters" not in str(p)
        model, opt = p.apply(bf16_model())
        got = _train_bf16(model, opt)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # refused masters: every candidate keeps the optimizer (and so the parameters) on the
    # device, and this budget is out of their reach; the error says why
    with pytest.raises(PlanError, match=r"\(with the plain step\).*fp32_masters=False keeps"):
        _bf16_plan(budget, disk=tmp_path, fp32_masters=False)


def test_fp32_masters_has_no_effect_on_fp32_parameters(plan_at):
    plans = {None: plan_at(0.75), **{m: plan_at(0.75, fp32_masters=m) for m in (True, False)}}
    assert len({p.choice for p in plans.values()}) == 1
    assert not plans[True].fp32_masters


def test_fp32_masters_on_an_accelerator_plan_keeps_the_optimizer_on_the_host():
    # NOTE: an accelerator's memory 150x the host's, and a link that costs: with SPEEDS (host
    # as fast as the device, a free link) the host optimizer's fused step is the faster one
    speeds = dataclasses.replace(SPEEDS, memory=1.5e12, link=12e9)
    kw = dict(loss_fn=bf16_loss, budget="1GiB", device="cuda", optimizer=torch.optim.AdamW,
              speeds=speeds, slice_bytes=SLICE)
    p = plan(bf16_model(), (XB,), fp32_masters=True, **kw)
    assert p.choice.optimizer_state == "host" and p.choice.params == "device"
    assert plan(bf16_model(), (XB,), **kw).choice.optimizer_state == "device"


def test_fp32_masters_bad_value_and_no_candidate():
    with pytest.raises(TypeError, match="fp32_masters must be True, False or None"):
        _bf16_plan("1GiB", fp32_masters="yes")
    with pytest.raises(PlanError, match="fp32 masters.*fp32_masters=None"):
        plan(bf16_model(), (XB,), loss_fn=bf16_loss, budget="1GiB", device="cpu",
             optimizer=torch.optim.AdamW, world_size=2, fp32_masters=True)
