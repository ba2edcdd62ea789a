"""Which torch implementation HostOptimizer steps with, against the torch call it equals bitwise.

Every implementation flag (none, ``fused``, ``foreach``, each True and False) is bitwise torch's
own call with the same flags; without flags it is ``cls(..., fused=True)`` for Adam, AdamW and
Adagrad (torch's default only to rounding) and ``cls(...)`` itself for SGD (docs/host_optimizer.md).
The parameters have sizes that are no multiple of a vector width, so the fused kernels' tails
(stepped one element at a time) differ from the single-tensor path's.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import headroom as hr

STEPS = 5
CLASSES = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "Adam": (torch.optim.Adam, {"lr": 1e-2}),
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                              "weight_decay": 0.01}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 1e-2, "lr_decay": 0.01}),
}
FLAGS = {"default": {}, "fused=True": {"fused": True}, "fused=False": {"fused": False},
         "foreach=True": {"foreach": True}, "foreach=False": {"foreach": False}}
# The documented reference of HostOptimizer's default (no implementation flag).
DEFAULT_REFERENCE = {"AdamW": {"fused": True}, "Adam": {"fused": True}, "SGD": {},
                     "Adagrad": {"fused": True}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(37, 53), torch.nn.Tanh(), torch.nn.Linear(53, 19))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    for step in range(STEPS):
        x = torch.randn(8, 37, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _plain(name: str, flags: dict) -> list[torch.Tensor]:
    cls, kw = CLASSES[name]
    model = _model()
    return _train(model, cls(model.parameters(), **kw, **flags))


def _headroom(name: str, flags: dict, placement: str, tmp_path) -> list[torch.Tensor]:
    cls, kw = CLASSES[name]
    model = _model()
    state = "cpu"
    if placement != "plain":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # device="cpu", store="cpu": mechanics only
            hr.offload(model, device="cpu", store="cpu" if placement == "host"
                       else hr.DiskStore(tmp_path / "params"))
        if placement == "disk":
            state = hr.DiskStore(tmp_path / "state")
    opt = hr.HostOptimizer(model.parameters(), cls, state_store=state, slice_bytes=256,
                           **kw, **flags)
    try:
        got = _train(model, opt)
    finally:
        opt.close()
    return got


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("placement", ["plain", "host", "disk"])
@pytest.mark.parametrize("flag", list(FLAGS))
@pytest.mark.parametrize("name", list(CLASSES))
def test_each_implementation_is_bitwise_torchs_call_with_the_same_flags(name, flag, placement,
                                                                        tmp_path):
    """fp32 on the CPU: in place (``plain``), offloaded to host memory, and parameters and
    state on disk (stepped in slices); without a flag against the documented reference."""
    want = _plain(name, DEFAULT_REFERENCE[name] if flag == "default" else FLAGS[flag])
    assert _equal(_headroom(name, FLAGS[flag], placement, tmp_path), want)


@pytest.mark.parametrize("name", list(CLASSES))
def test_the_default_is_torchs_default_or_differs_from_it_as_documented(name):
    """The test above tells the references apart: on this model torch's fused kernel differs
    from its default in the last bits for each class, and HostOptimizer's default equals
    ``cls()`` exactly where the docs say so (SGD), else only to rounding."""
    default, fused = _plain(name, {}), _plain(name, {"fused": True})
    assert not _equal(default, fused)
    got = _headroom(name, {}, "plain", None)
    assert _equal(got, default) == (DEFAULT_REFERENCE[name] == {})
    for a, b in zip(got, default, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_options_record_the_implementation_chosen():
    """``opt.options`` says which kernel runs: ``fused=True`` where HostOptimizer chose it."""
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert hr.HostOptimizer(p, torch.optim.AdamW).options.optimizer_kwargs == {"fused": True}
    assert hr.HostOptimizer(p, torch.optim.SGD, lr=0.1).options.optimizer_kwargs == {"lr": 0.1}
    assert hr.HostOptimizer(p, torch.optim.Adam, foreach=True).options.optimizer_kwargs == \
        {"foreach": True}
