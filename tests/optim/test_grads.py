"""``param.grad`` of HostOptimizer-managed bf16/fp16 parameters (fp32 masters): what torch's
utilities read is the fp32 gradient the step uses, exactly as in a hand-written fp32-master loop.

Covered for parameters the optimizer hosts itself (not offloaded) and for parameters offloaded to
host memory and to a DiskStore; with gradient accumulation and with ``model.zero_grad()`` (what
transformers.Trainer calls) between steps.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import headroom as hr
from headroom.store import DiskStore

DTYPES = [torch.bfloat16, torch.float16]


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)],
                         nn.Linear(8, 2)).to(dtype)


def _placed(model: nn.Module, store: str | None, tmp_path) -> nn.Module:
    """``model`` as is (None), offloaded to host memory ("cpu") or to a DiskStore ("disk")."""
    if store is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # device="cpu" with a host store saves nothing
            hr.offload(model, device="cpu",
                       store=DiskStore(tmp_path / "s") if store == "disk" else "cpu")
    return model


def _batches(dtype, n):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 8, generator=g).to(dtype) for _ in range(n)]


def _reference(dtype, batches, accum, norm_type):
    """Plain torch: fp32 masters, gradients accumulated in fp32, clipped there, AdamW on them."""
    model = _model(dtype)
    masters = [p.detach().float() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    norms = []
    for i, x in enumerate(batches):
        model(x).float().square().sum().backward()
        for m, p in zip(masters, model.parameters(), strict=True):
            g = p.grad.float()
            m.grad = g if m.grad is None else m.grad + g
            p.grad = None
        if (i + 1) % accum:
            continue
        norms.append(torch.nn.utils.clip_grad_norm_(masters, 0.5, norm_type))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters(), strict=True):
                p.copy_(m)
    return norms, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("store", [None, "cpu", "disk"])
@pytest.mark.parametrize("accum,norm_type", [(1, 2.0), (2, float("inf"))])
def test_clip_over_fp32_master_gradients_is_exact(dtype, store, accum, norm_type, tmp_path):
    batches = _batches(dtype, 3 * accum)
    want_norms, want = _reference(dtype, batches, accum, norm_type)
    model = _placed(_model(dtype), store, tmp_path)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    norms = []
    for i, x in enumerate(batches):
        model(x).float().square().sum().backward()
        if (i + 1) % accum:
            continue
        for p in model.parameters():  # it reads as the parameter's, computes in fp32
            assert p.grad.dtype == dtype and p.grad.shape == p.shape
            assert p.grad.clone().dtype == torch.float32
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type))
        opt.step()
        model.zero_grad()  # as Trainer does; the next backward starts afresh
    for n, w in zip(norms, want_norms, strict=True):
        assert n.dtype == torch.float32 and torch.equal(n, w)
    assert any(float(n) > 0.5 for n in norms)
    for p, w in zip(model.parameters(), want, strict=True):
        assert torch.equal(p.detach().clone(), w)


def test_grad_scaler_reads_the_fp32_gradients_of_bf16_parameters():
    """GradScaler.unscale_ finds a non-finite gradient that rests in the host optimizer."""
    model = _model(torch.bfloat16)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x = _batches(torch.bfloat16, 1)[0]
    x[0, 0] = float("inf")
    scaler.scale(model(x).float().square().sum()).backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)  # unscale_ finds the inf: the step is skipped
    scaler.update()
    assert scaler.get_scale() == 2.0
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)


def _scaled_run(model, opt, *, clip: bool = False):
    """fp16 autocast with a GradScaler; step 3 has an inf (skipped, the scale halved)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    g = torch.Generator().manual_seed(0)
    scales = []
    for i in range(6):
        x = torch.randn(4, 8, generator=g)
        if i == 3:
            x[0, 0] = float("inf")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("store", [None, "cpu", "disk"])
@pytest.mark.parametrize("clip", [False, True])
def test_grad_scaler_with_fp16_autocast_is_bitwise_torchs_fused_adamw(store, clip, tmp_path):
    """The AMP recipe (fp32 weights, fp16 autocast, torch.amp.GradScaler, its unscale_ before
    clipping or not): bitwise torch's fused AdamW with the same scaler, the inf step skipped."""
    ref = _model(torch.float32)
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    want_scale = _scaled_run(ref, plain, clip=clip)
    model = _placed(_model(torch.float32), store, tmp_path)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    assert _scaled_run(model, opt, clip=clip) == want_scale
    assert want_scale[3] == want_scale[2] / 2  # the inf step was skipped
    for (n, p), w in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.detach(), w.detach()), n


def test_grad_scaler_after_final_backward_is_refused(tmp_path):
    """The steps final_backward started used the scaled gradients; unscaling them afterwards
    makes step() raise, the step undone (a DiskStore takes part)."""
    model = _placed(_model(torch.float32), "disk", tmp_path)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=64)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with opt.final_backward():
        scaler.scale(model(_batches(torch.float32, 1)[0]).square().sum()).backward()
    assert any(e.launched for e in opt._order)
    with pytest.raises(RuntimeError, match="after their step had started inside"):
        scaler.step(opt)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)
