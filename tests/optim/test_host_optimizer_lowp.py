"""HostOptimizer on bf16 and fp16 parameters: fp32 masters, fp32 state, fp32 gradient sums.

The same result whether the parameters are ordinary CPU tensors, offloaded to host memory or
offloaded to a DiskStore, and equal to a hand-written fp32-master AdamW.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import headroom as hr
from headroom.store import DiskStore, HostStore, StoreFullError

STEPS = 4
ACCUM = 2
LR = 1e-2


def _model(dtype: torch.dtype, *, mixed: bool = False) -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(3):
        lin = nn.Linear(16, 16).to(dtype)
        norm = nn.LayerNorm(16)  # fp32 norms beside low-precision linears when mixed
        if not mixed:
            norm = norm.to(dtype)
        blocks.append(nn.Sequential(lin, norm))
    return nn.Sequential(*blocks)


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + i)
    x = torch.randn(4, 16, generator=g).to(model[0][0].weight.dtype)
    return model(x).float().square().mean()


def _place(model: nn.Module, where: str, tmp_path) -> nn.Module:
    if where == "plain":
        return model
    store = "cpu" if where == "host" else DiskStore(tmp_path / where, threads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hr.offload(model, device="cpu", store=store)


def _train_host(model: nn.Module, steps=range(STEPS), clip=None, **kw) -> hr.HostOptimizer:
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0.1, **kw)
    _run(model, opt, steps, clip)
    return opt


def _run(model, opt, steps, clip=None):
    for s in steps:
        for m in range(ACCUM):
            _loss(model, s * ACCUM + m).backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _reference(model: nn.Module, steps=range(STEPS), clip=None) -> dict[str, torch.Tensor]:
    """fp32 masters, gradients summed in fp32 over micro-batches, torch's fused AdamW on the
    masters, the parameters set to the masters rounded to their dtype after every step."""
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=0.1, fused=True)
    for s in steps:
        sums = [torch.zeros_like(m) for m in masters]
        for m in range(ACCUM):
            _loss(model, s * ACCUM + m).backward()
            for acc, p in zip(sums, params, strict=True):
                acc.add_(p.grad)
                p.grad = None
        for mst, acc in zip(masters, sums, strict=True):
            mst.grad = acc
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(masters, clip, foreach=True)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, mst in zip(params, masters, strict=True):
                p.copy_(mst)
    return _values(model)


@pytest.mark.parametrize("mixed", [False, True], ids=["lowp", "mixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_equal_across_placements_and_to_an_fp32_master_reference(dtype, mixed, tmp_path):
    expected = _reference(_model(dtype, mixed=mixed))
    for where in ("plain", "host", "disk"):
        model = _place(_model(dtype, mixed=mixed), where, tmp_path)
        _train_host(model)
        got = _values(model)
        for k, v in expected.items():
            assert got[k].dtype == v.dtype, (where, k)
            assert torch.equal(got[k], v), (where, k)


@pytest.mark.parametrize("state", ["cpu", "disk"])
def test_clipping_and_disk_state_are_the_same_fp32_computation(state, tmp_path):
    expected = _reference(_model(torch.bfloat16), clip=0.05)
    for where in ("plain", "host", "disk"):
        model = _place(_model(torch.bfloat16), where, tmp_path / state)
        st = DiskStore(tmp_path / state / f"state-{where}", threads=2) if state == "disk" \
            else "cpu"
        _train_host(model, clip=0.05, state_store=st, slice_bytes=256)
        got = _values(model)
        for k, v in expected.items():
            assert torch.equal(got[k], v), (where, k)


@pytest.mark.parametrize("where", ["plain", "host", "disk"])
def test_state_dict_holds_the_fp32_master_and_resumes_exactly(where, tmp_path):
    full = _place(_model(torch.bfloat16), where, tmp_path / "a")
    _train_host(full)
    first = _place(_model(torch.bfloat16), where, tmp_path / "b")
    opt = _train_host(first, steps=range(2))
    sd = opt.state_dict()
    for st in sd["state"].values():
        assert st["master"].dtype == torch.float32
        assert st["exp_avg"].dtype == torch.float32
    path = tmp_path / "ckpt.safetensors"
    hr.save(path, first, opt)
    resumed = _place(_model(torch.bfloat16), where, tmp_path / "c")
    opt2 = hr.HostOptimizer(resumed.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0.1)
    hr.load(path, resumed, opt2)
    _run(resumed, opt2, range(2, STEPS))
    want, got = _values(full), _values(resumed)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_nothing_is_updated_when_the_state_does_not_fit(tmp_path):
    model = _place(_model(torch.bfloat16), "host", tmp_path)
    before = _values(model)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=LR,
                           state_store=HostStore(max_bytes=1024))
    _loss(model, 0).backward()
    with pytest.raises(StoreFullError, match="Nothing was updated"):
        opt.step()
    after = _values(model)
    for k in before:
        assert torch.equal(after[k], before[k]), k


def test_offload_alone_keeps_plain_bf16_semantics():
    """Without HostOptimizer, an offloaded bf16 model trains like plain bf16 PyTorch: bf16
    gradients accumulated in bf16, stepped by a torch optimizer on the bf16 masters."""
    ref = _model(torch.bfloat16)
    model = _place(copy.deepcopy(ref), "host", None)
    for m in (ref, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        _run(m, opt, range(2))
    want, got = _values(ref), _values(model)
    for k in want:
        assert torch.equal(got[k], want[k]), k
