"""Accelerator-only: races between headroom's side streams and the computing stream, provoked.

Offloaded training (``hr.offload`` with ``hr.HostOptimizer``) runs for a few steps on the device
and is compared with the same model trained resident on the device by ``hr.HostOptimizer``
(both step on the host, from the same gradients). Around headroom's release, fetch and gradient
points the computing stream is held back with ``torch.cuda._sleep``: a copy on a side stream that
is not ordered after compute then runs ahead of it, overwriting memory that queued kernels still
read or reading a gradient before it is written, and the values come out wrong. The variants:
host and disk stores, prefetch 1 and 2, overlap on and off, gradient accumulation, a
``compute_dtype``, a user stream around the whole loop, ``cuda:1`` where there is one, the
staging bound of accumulated gradients made small (the path of gradients over 256 MB), a
backward that fails half-way, and a huge classifier head streamed from host memory. One run goes
through PyTorch's CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``), which reports any unordered access
to device memory, in a subprocess.

These tests are skipped without an accelerator (see tests/conftest.py).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import headroom as hr
from tests.conftest import accelerator_type

pytestmark = pytest.mark.gpu

DEV = accelerator_type()
WIDTH = 512  # 1 MiB weights: copies long enough to race with held-back kernels
BLOCKS = 6
STEPS = 4
CYCLES = 5_000_000  # a few milliseconds of a held-back computing stream


def _hold() -> None:
    """Hold the current (computing) stream back for a while."""
    if DEV == "cuda":
        torch.cuda._sleep(CYCLES)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())
                           for _ in range(BLOCKS)])


@pytest.fixture
def held(monkeypatch):
    """Hold the computing stream back before every release, fetch and gradient push, and before
    each block's backward (so its gradients are written late)."""
    from headroom.residency import _group
    from headroom.transfer import Mover

    for cls, name in ((_group.Residency, "release"), (Mover, "fetch_many"),
                      (Mover, "push_grad")):
        real = getattr(cls, name)

        def wrapped(self, *args, _real=real, **kwargs):
            _hold()
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapped)
    return _hold


def _train(model: nn.Module, opt, device, *, steps: int = STEPS, accum: int = 1,
           final: bool = False, hold_backward: bool = False,
           dtype: torch.dtype | None = None) -> None:
    g = torch.Generator().manual_seed(1)
    hooks = []
    if hold_backward:
        hooks = [m.register_full_backward_pre_hook(lambda *a: _hold()) for m in model]
    for _ in range(steps):
        for i in range(accum):
            x = torch.randn(64, WIDTH, generator=g).to(device, dtype or torch.float32)
            with opt.final_backward(final and i == accum - 1):
                (model(x).float().square().mean() / accum).backward()
        opt.step()
        opt.zero_grad()
    for h in hooks:
        h.remove()


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    names = {n for n, _ in model.named_parameters()}
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items() if k in names}


def _compare(ours: nn.Module, ref: nn.Module) -> None:
    a, b = _values(ours), _values(ref)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def _offload(model, device, store, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hr.offload(model, device=device, store=store, **kw)


def _pair(device, store, *, prefetch=1, compute_dtype=None, overlap=False, accum=1,
          hold_backward=True, grad_accumulation="store"):
    base = _model()
    ref = copy.deepcopy(base)
    if compute_dtype is not None:
        ref = ref.to(compute_dtype)
    ref = ref.to(device)
    ref_opt = hr.HostOptimizer(ref.parameters(), torch.optim.AdamW, lr=1e-3, overlap=overlap)
    _train(ref, ref_opt, device, accum=accum, final=overlap, dtype=compute_dtype)
    ours = _offload(copy.deepcopy(base), device, store, prefetch=prefetch,
                    compute_dtype=compute_dtype, grad_accumulation=grad_accumulation)
    opt = hr.HostOptimizer(ours.parameters(), torch.optim.AdamW, lr=1e-3, overlap=overlap)
    _train(ours, opt, device, accum=accum, final=overlap, hold_backward=hold_backward,
           dtype=compute_dtype)
    torch.accelerator.synchronize()
    return ours, ref, opt


@pytest.mark.parametrize(("store", "prefetch", "overlap", "accum"), [
    ("cpu", 1, False, 1), ("cpu", 2, True, 1), ("cpu", 1, True, 3), ("disk", 1, False, 2),
    ("disk", 2, True, 1),
])
def test_offloaded_training_matches_resident_with_compute_held_back(
        held, tmp_path, store, prefetch, overlap, accum):
    st = "cpu" if store == "cpu" else hr.DiskStore(tmp_path / "s")
    ours, ref, _ = _pair(DEV, st, prefetch=prefetch, overlap=overlap, accum=accum)
    _compare(ours, ref)


@pytest.mark.parametrize("overlap", [False, True])
def test_gradients_summed_on_the_device(held, tmp_path, overlap):
    """grad_accumulation="device" on disk: the sums are handed over on a side stream when the
    step reads them, or (overlap) as the final backward completes them, after the adds still
    queued on the held-back computing stream."""
    ours, ref, _ = _pair(DEV, hr.DiskStore(tmp_path / "s"), overlap=overlap, accum=3,
                         grad_accumulation="device")
    _compare(ours, ref)


def test_bf16_gradients_summed_on_the_device_in_fp32(held):
    """bf16 parameters in host memory with HostOptimizer: fp32 sums on the device, bitwise
    what the resident model's host gradients sum to."""
    base = _model().to(torch.bfloat16)
    ref = copy.deepcopy(base).to(DEV)
    ref_opt = hr.HostOptimizer(ref.parameters(), torch.optim.AdamW, lr=1e-3, overlap=True)
    _train(ref, ref_opt, DEV, accum=3, final=True, dtype=torch.bfloat16)
    ours = _offload(copy.deepcopy(base), DEV, "cpu", grad_accumulation="device")
    opt = hr.HostOptimizer(ours.parameters(), torch.optim.AdamW, lr=1e-3, overlap=True)
    _train(ours, opt, DEV, accum=3, final=True, hold_backward=True, dtype=torch.bfloat16)
    torch.accelerator.synchronize()
    a, b = _values(ours), _values(ref)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_compute_dtype(held):
    ours, ref, _ = _pair(DEV, "cpu", compute_dtype=torch.bfloat16, accum=2)
    a, b = _values(ours), _values(ref)
    for k in a:  # fp32 masters on both sides (the reference's are the optimizer's)
        torch.testing.assert_close(a[k].bfloat16().float(), b[k], rtol=1e-2, atol=1e-3, msg=k)


def test_staged_gradients_past_the_bound(held, monkeypatch):
    """Accumulated gradients go through page-locked staging and land on the mover's thread;
    with the bound on staged bytes made small every push past the first waits for a landing,
    the path gradients over 256 MB take."""
    import headroom.transfer._mover as mover_mod

    monkeypatch.setattr(mover_mod, "_MAX_STAGED_BYTES", 1 << 20)
    ours, ref, _ = _pair(DEV, "cpu", accum=3, overlap=True)
    _compare(ours, ref)


def test_a_user_stream_around_the_loop(held):
    s = torch.cuda.Stream() if DEV == "cuda" else torch.get_device_module(DEV).Stream()
    with torch.get_device_module(DEV).stream(s):
        ours, ref, _ = _pair(DEV, "cpu", overlap=True, accum=2)
    s.synchronize()
    _compare(ours, ref)


@pytest.mark.skipif(DEV is None or torch.accelerator.device_count() < 2,
                    reason="needs a second accelerator")
def test_second_device(held):
    dev = torch.device(DEV, 1)
    ours, ref, _ = _pair(dev, "cpu", overlap=True)
    _compare(ours, ref)
    assert all(p.device.type == "cpu" for p in ours.parameters())


def test_a_backward_that_fails_half_way(held):
    """An error raised inside backward (a tensor hook) after some gradients moved: after
    zero_grad the next steps train exactly like a run that never saw the failed step."""
    base = _model()
    ref = copy.deepcopy(base).to(DEV)
    ref_opt = hr.HostOptimizer(ref.parameters(), torch.optim.AdamW, lr=1e-3, overlap=False)
    _train(ref, ref_opt, DEV)
    ours = _offload(copy.deepcopy(base), DEV, "cpu")
    opt = hr.HostOptimizer(ours.parameters(), torch.optim.AdamW, lr=1e-3, overlap=False)
    x = torch.randn(64, WIDTH, device=DEV)

    def fail(*args):
        raise RuntimeError("injected")

    h = ours[BLOCKS // 2].register_full_backward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="injected"):
        ours(x).square().mean().backward()
    h.remove()
    opt.zero_grad()
    _train(ours, opt, DEV)
    torch.accelerator.synchronize()
    _compare(ours, ref)


def test_pinned_memory_is_counted_exactly_and_given_back():
    from headroom.store import _pinned, pinned_bytes

    base = pinned_bytes()
    model = _offload(_model(), DEV, "cpu")
    store = hr.residency.state_of(model).store
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # one slab for the masters: registered at its own size on CUDA (whole pages), a power of
    # two from the caching allocator elsewhere
    backend = _pinned._backend(True, torch.device(DEV, torch.accelerator.current_device_index()))
    carved = sum(-(-p.numel() * 4 // 64) * 64 for p in model.parameters())
    assert store.spent_bytes == _pinned.spent(carved, backend)
    if backend == "register":
        assert store.spent_bytes < params + 4096 + 64 * 2 * BLOCKS
    assert pinned_bytes() - base == store.spent_bytes
    assert all(p.is_pinned() for p in model.parameters())
    before = _host_cached()
    model(torch.randn(8, WIDTH, device=DEV)).sum().backward()
    torch.accelerator.synchronize()
    if backend == "register":  # masters and gradients never went through torch's allocator
        assert _host_cached() == before
    assert pinned_bytes() - base == store.spent_bytes >= 2 * params
    hr.unoffload(model)
    assert pinned_bytes() == base


def _host_cached() -> int:
    """Bytes torch's caching host allocator holds (CUDA), else 0."""
    if DEV != "cuda":
        return 0
    stats = torch.cuda.memory.host_memory_stats()
    return sum(v for k, v in stats.items()
               if k.startswith("allocated_bytes") and k.endswith("current"))


def test_huge_classifier_streams_exactly_with_compute_held_back(monkeypatch):
    from headroom.heads import _linear_ce

    real = _linear_ce.OneHot.subtract

    def held_subtract(self, i, *args):
        _hold()
        return real(self, i, *args)

    monkeypatch.setattr(_linear_ce.OneHot, "subtract", held_subtract)
    c, d, b = 20_000, 256, 32
    head = hr.HugeClassifier(c, d, bias=True, device=DEV, slice_size=2048, prefetch=2)
    w = head.store.read(head._wh).result().clone()
    bias = head.store.read(head._bh).result().clone()
    x = torch.randn(b, d, device=DEV, requires_grad=True)
    y = torch.randint(0, c, (b,), device=DEV)
    loss = head(x, y)
    loss.backward()
    wr = w.to(DEV).requires_grad_()
    br = bias.to(DEV).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    ref = F.cross_entropy(xr @ wr.T + br, y)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    gw = head.store.read(hr.transfer.binding(head.weight).grad_handle).result()
    torch.testing.assert_close(gw, wr.grad.cpu(), rtol=1e-5, atol=1e-6)


_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.nn as nn, headroom as hr
    sys.path.insert(0, {root!r})
    from tests.residency import test_offload_gpu_races as t
    {body}
""")


def _run(body: str, **env) -> subprocess.CompletedProcess:
    root = str(Path(__file__).resolve().parents[2])
    code = _SCRIPT.format(root=root, body=textwrap.dedent(body))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600, cwd=root)


@pytest.mark.skipif(DEV != "cuda", reason="the sanitizer is CUDA's")
def test_under_the_cuda_sanitizer(tmp_path):
    """Offload with prefetch, the host optimizer with overlap, a disk store, and the streamed
    head, under TORCH_CUDA_SANITIZER=1: any unordered access to device memory fails the run."""
    r = _run(f"""
        ours, ref, _ = t._pair("cuda", "cpu", prefetch=2, overlap=True, accum=2,
                               hold_backward=False)
        t._compare(ours, ref)
        ours, ref, _ = t._pair("cuda", hr.DiskStore({str(tmp_path / "s")!r}), overlap=True,
                               hold_backward=False)
        t._compare(ours, ref)
        head = hr.HugeClassifier(5000, 64, device="cuda", slice_size=512)
        x = torch.randn(8, 64, device="cuda", requires_grad=True)
        head(x, torch.randint(0, 5000, (8,), device="cuda")).backward()
        torch.cuda.synchronize()
        print("ok")
    """, TORCH_CUDA_SANITIZER="1")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-4000:]
    assert "CSAN" not in r.stderr, r.stderr[-4000:]


@pytest.mark.skipif(DEV != "cuda" or torch.cuda.device_count() < 2,
                    reason="needs a second CUDA device")
def test_second_device_leaves_the_first_alone():
    """A head (and an offloaded model) on cuda:1 create no context on GPU 0: page-locked memory
    is registered, and streams and events made, under cuda:1's own guard."""
    r = _run("""
        head = hr.HugeClassifier(5000, 64, device="cuda:1", slice_size=512)
        x = torch.randn(8, 64, device="cuda:1", requires_grad=True)
        head(x, torch.randint(0, 5000, (8,), device="cuda:1")).backward()
        model = hr.offload(t._model(), device="cuda:1", store="cpu")
        model(torch.randn(4, t.WIDTH, device="cuda:1")).sum().backward()
        torch.cuda.synchronize(1)
        print("gpu0", torch._C._cuda_hasPrimaryContext(0))
    """)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "gpu0 False" in r.stdout, r.stdout
