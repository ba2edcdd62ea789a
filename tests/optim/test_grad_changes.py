"""What users and frameworks do to ``param.grad`` between backward and ``HostOptimizer.step()``,
with the gradients resting in a store (``hr.offload``) or beside the optimizer's fp32 masters:
the step sees what torch's optimizers would see.

- ``param.grad = None`` (``model.zero_grad()``, which transformers.Trainer calls, then a step in
  which some parameters get no gradient: an unused task head, a skipped layer): the parameter
  is skipped, as torch skips it, not stepped with the gradient of an earlier step.
- ``param.grad = g`` (a tensor assigned after backward): it replaces the accumulated gradient;
  a later backward accumulates onto it.
- Inside ``final_backward`` (steps already started with the gradients backward left): a change
  afterwards (assigned, ``None``, in place: ``clip_grad_norm_``) is refused by ``step()``, and
  the step is undone where a disk takes part (as for a hyperparameter changed then).
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future

import pytest
import torch
import torch.nn as nn

import headroom as hr
from headroom.residency import state_of
from headroom.store import StoreFullError

PLACEMENTS = ["none", "cpu", "disk", "disk-device"]


class MultiTask(nn.Module):
    """A trunk and two task heads; each batch uses one head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
        self.heads = nn.ModuleList(nn.Linear(16, 3) for _ in range(2))

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.heads[task](self.trunk(x))


def _model(dtype=torch.float32) -> MultiTask:
    torch.manual_seed(0)
    return MultiTask().to(dtype)


def _batch(i: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).to(dtype)


def _loss(model: nn.Module, i: int, task: int, dtype=torch.float32) -> torch.Tensor:
    return model(_batch(i, dtype), task).float().square().mean()


def _offloaded(placement: str, tmp_path, dtype=torch.float32):
    model = _model(dtype)
    if placement != "none":
        store = "cpu" if placement == "cpu" else hr.DiskStore(tmp_path / "store")
        acc = "device" if placement.endswith("device") else "store"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # device="cpu" with a host store saves nothing
            hr.offload(model, device="cpu", store=store, grad_accumulation=acc)
    return model, hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                                   weight_decay=0.1)


def _plain():
    model = _model()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def _assert_equal(ref: nn.Module, model: nn.Module) -> None:
    for (n, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_model_zero_grad_with_an_unused_head_skips_it_like_torch(placement, tmp_path):
    # Trainer's loop: model.zero_grad() after each step. Head 1 gets no gradient in steps
    # 0 and 2, head 0 none in steps 1 and 3: their parameters must not move then (AdamW's
    # weight decay included), and the trunk sees the right heads.
    ref, plain = _plain()
    model, opt = _offloaded(placement, tmp_path)
    for s in range(4):
        for m, o in ((ref, plain), (model, opt)):
            _loss(m, s, s % 2).backward()
            o.step()
            m.zero_grad()
        _assert_equal(ref, model)
    assert opt.grad(model.heads[1].weight) is None  # cleared, as torch's param.grad


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_assigned_gradients_replace_and_accumulate_like_torch(placement, tmp_path):
    ref, plain = _plain()
    model, opt = _offloaded(placement, tmp_path)
    for s in range(3):
        for m, o in ((ref, plain), (model, opt)):
            _loss(m, 2 * s, 0).backward()
            w, b = m.trunk[0].weight, m.trunk[2].bias
            w.grad = w.grad * 0.5  # a new tensor: replaces the gradient
            _loss(m, 2 * s + 1, 0).backward()  # accumulates onto the assigned one
            b.grad = torch.full_like(b, 0.25)
            m.heads[0].bias.grad = None  # skipped in this step
            o.step()
            o.zero_grad()
        _assert_equal(ref, model)


@pytest.mark.parametrize("placement", ["none", "cpu", "disk"])
def test_low_precision_parameters_skip_and_take_assigned_gradients(placement, tmp_path):
    # bf16 parameters, fp32 masters: against a hand-written fp32-master AdamW. The master of
    # a parameter whose .grad is None is not stepped; an assigned bf16 gradient is the one
    # the master steps with.
    dtype = torch.bfloat16
    model, opt = _offloaded(placement, tmp_path, dtype)
    ref = _model(dtype)
    masters = [p.detach().float() for p in ref.parameters()]
    plain = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    assigned = torch.randn(16, generator=torch.Generator().manual_seed(7)).to(dtype)
    for s in range(4):
        task = s % 2
        _loss(ref, s, task, dtype).backward()
        _loss(model, s, task, dtype).backward()
        ref.trunk[2].bias.grad = assigned
        model.trunk[2].bias.grad = assigned.clone()
        for m, p in zip(masters, ref.parameters(), strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        plain.step()
        opt.step()
        ref.zero_grad()
        model.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters(), strict=True):
                p.copy_(m)
        _assert_equal(ref, model)


CHANGES = {
    "set to None": lambda m: setattr(m.heads[0].weight, "grad", None),
    "assigned": lambda m: setattr(m.heads[0].bias, "grad", torch.zeros(3)),
    "mul_": lambda m: m.trunk[0].weight.grad.mul_(0.5),
    "clip_grad_norm_": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3),
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("placement", ["cpu", "disk-device"])
def test_a_change_after_the_final_backward_started_the_step_is_refused(placement, change,
                                                                       tmp_path):
    # As for a hyperparameter changed then: with a disk taking part the early steps kept
    # their old values and are undone; with everything in host memory they were updated in
    # place, and step() refuses until a checkpoint is loaded.
    model, opt = _offloaded(placement, tmp_path)
    hr.save(tmp_path / "ckpt", model, opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with opt.final_backward():
        (_loss(model, 0, 0) + _loss(model, 0, 1)).backward()  # every parameter: all launched
    assert all(e.launched for e in opt._order)
    CHANGES[change](model)
    with pytest.raises(RuntimeError, match="after their.*step had started inside") as info:
        opt.step()
    notes = " ".join(getattr(info.value, "__notes__", []))
    if placement == "cpu":
        assert "MIX old and new values" in notes
        with pytest.raises(RuntimeError, match="mix old and new values"):
            opt.step()
        hr.load(tmp_path / "ckpt", model, opt)
    else:
        assert "was undone" in notes
    _assert_equal_dict(before, model)
    # The way on: a fresh iteration, exact against torch.
    ref, plain = _plain()
    opt.zero_grad()
    for m, o in ((ref, plain), (model, opt)):
        _loss(m, 1, 1).backward()
        o.step()
        o.zero_grad()
    _assert_equal(ref, model)


def _assert_equal_dict(before: dict, model: nn.Module) -> None:
    for k, v in model.state_dict().items():
        assert torch.equal(before[k], v), k


def test_a_failed_write_of_an_assigned_gradient_steps_nothing_and_is_retried(tmp_path):
    # The assigned gradient goes to the DiskStore before the step; when that write fails,
    # step() raises before anything is stepped, param.grad still holds the assigned tensor,
    # and the next step() writes it again: the result is torch's.
    ref, plain = _plain()
    model, opt = _offloaded("disk", tmp_path)
    for m in (ref, model):
        _loss(m, 0, 0).backward()
        m.trunk[0].weight.grad = m.trunk[0].weight.grad * 0.5
    before = {k: v.clone() for k, v in model.state_dict().items()}
    store = state_of(model).store
    orig, calls = store.write, []

    def failing(handle, src):
        calls.append(handle.key)
        fut: Future = Future()
        fut.set_exception(store._io_error(OSError(28, "No space left on device (injected)"),
                                          str(store.path)))
        return fut

    store.write = failing
    with pytest.raises(StoreFullError):
        opt.step()
    assert calls  # the write of the assigned gradient was the one that failed
    _assert_equal_dict(before, model)
    store.write = orig
    plain.step()
    opt.step()
    _assert_equal(ref, model)
