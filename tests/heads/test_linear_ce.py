"""hr.linear_cross_entropy against F.cross_entropy on full logits.

Bitwise equality with the dense computation is impossible here: the log-sum-exp is accumulated
slice by slice (a different summation order than the dense softmax), so results are compared
with `assert_close` at the issue's 1e-5 relative tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import headroom as hr
from tests.conftest import DEVICES

RTOL = 1e-5


def _close(actual, expected, *, rtol=RTOL, atol=1e-6):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def _inputs(batch, dim, classes, *, bias, device="cpu", dtype=torch.float32, ignore=None):
    x = torch.randn(batch, dim, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(classes, dim, device=device, dtype=dtype) * 0.5).requires_grad_()
    b = torch.randn(classes, device=device, dtype=dtype, requires_grad=True) if bias else None
    y = torch.randint(0, classes, (batch,), device=device)
    if ignore is not None:
        y[::4] = ignore
    return x, w, b, y


def _grads(out, tensors, grad_out):
    return torch.autograd.grad(out, [t for t in tensors if t is not None], grad_out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [None, -100, 7])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_cross_entropy(device, reduction, ignore_index, label_smoothing, bias):
    # 1000 classes in slices of 128: the last slice is partial.
    x, w, b, y = _inputs(37, 24, 1000, bias=bias, device=device, ignore=ignore_index)
    kw = {"reduction": reduction, "label_smoothing": label_smoothing}
    if ignore_index is not None:
        kw["ignore_index"] = ignore_index
    # The reference is the dense computation in float64: fp32 dense cross-entropy is itself off by
    # a few ulps of the 1000-term sums (more than the slice-by-slice result on some CPUs).
    x64, w64 = x.double(), w.double()
    b64 = b.double() if b is not None else None
    ref = F.cross_entropy(x64 @ w64.T + (b64 if b64 is not None else 0), y, **kw)
    out = hr.linear_cross_entropy(x, w, y, b, slice_size=128, **kw)
    _close(out, ref.float())
    # a negative scalar / mixed-sign incoming gradient exercises both sign paths of backward
    grad_out = torch.randn_like(out) if reduction == "none" else torch.tensor(-1.7, device=device)
    got_all = _grads(out, [x, w, b], grad_out)
    want_all = _grads(ref, [x64, w64, b64], grad_out.double())
    for got, want in zip(got_all, want_all, strict=True):
        _close(got, want.float())


@pytest.mark.parametrize("slice_size", [1, 5, 999, 1000, 4096, None])
def test_any_slice_size(slice_size):
    x, w, b, y = _inputs(9, 8, 1000, bias=True)
    ref = F.cross_entropy(x @ w.T + b, y)
    out = hr.linear_cross_entropy(x, w, y, b, slice_size=slice_size)
    _close(out, ref)
    for got, want in zip(_grads(out, [x, w, b], None), _grads(ref, [x, w, b], None), strict=True):
        _close(got, want)


def test_leading_dims_and_partial_grads():
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.randn(300, 16)  # no gradient wanted for the weight
    y = torch.randint(0, 300, (3, 5))
    ref = F.cross_entropy((x @ w.T).reshape(-1, 300), y.reshape(-1), reduction="none")
    out = hr.linear_cross_entropy(x, w, y, slice_size=64, reduction="none")
    assert out.shape == (3, 5)
    _close(out.reshape(-1), ref)
    g = torch.randn(3, 5)
    (gx,) = torch.autograd.grad(out, [x], g)
    (rx,) = torch.autograd.grad(ref, [x], g.reshape(-1))
    _close(gx, rx)


def test_bf16_accumulates_in_fp32():
    x, w, b, y = _inputs(64, 32, 3000, bias=True, dtype=torch.bfloat16)
    xf, wf, bf = (t.detach().float().requires_grad_() for t in (x, w, b))
    ref = F.cross_entropy(xf @ wf.T + bf, y, label_smoothing=0.1)
    out = hr.linear_cross_entropy(x, w, y, b, slice_size=256, label_smoothing=0.1)
    # the loss comes back in fp32 by default: no rounding to bf16 beyond the inputs'
    assert out.dtype == torch.float32
    _close(out, ref, rtol=1e-5, atol=0)
    as_bf16 = hr.linear_cross_entropy(x, w, y, b, slice_size=256, label_smoothing=0.1,
                                      loss_dtype=torch.bfloat16)
    assert as_bf16.dtype == torch.bfloat16 and as_bf16 == out.to(torch.bfloat16)
    grads = _grads(out, [x, w, b], None)
    refs = _grads(ref, [xf, wf, bf], None)
    for got, want in zip(grads, refs, strict=True):
        assert got.dtype == torch.bfloat16
        _close(got.float(), want, rtol=2**-8, atol=1e-7)
    # a bf16 computation of the same loss is visibly worse: the check above can fail
    naive = F.cross_entropy(x @ w.T + b, y, label_smoothing=0.1).float()
    assert (naive - ref).abs() > (out.float() - ref).abs()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch_like_pytorch(reduction):
    x = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(50, 8, requires_grad=True)
    y = torch.empty(0, dtype=torch.long)
    ref = F.cross_entropy(x @ w.T, y, reduction=reduction)
    out = hr.linear_cross_entropy(x, w, y, reduction=reduction)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, equal_nan=True)
    if reduction != "mean":  # mean of nothing is nan, as in PyTorch
        gx, gw = torch.autograd.grad(out.sum(), [x, w])
        rx, rw = torch.autograd.grad(ref.sum(), [x, w])
        assert torch.equal(gx, rx) and torch.equal(gw, rw)


def test_all_rows_ignored_like_pytorch():
    x, w, _, y = _inputs(6, 8, 40, bias=False)
    y[:] = -100
    for reduction in ("mean", "sum"):
        ref = F.cross_entropy(x @ w.T, y, reduction=reduction)
        out = hr.linear_cross_entropy(x, w, y, reduction=reduction)
        torch.testing.assert_close(out, ref, equal_nan=True)
        got, want = _grads(out, [x, w], None), _grads(ref, [x, w], None)
        for g, r in zip(got, want, strict=True):
            torch.testing.assert_close(g, r, equal_nan=True)


class TestBadInput:
    def setup_method(self):
        self.x = torch.randn(4, 8)
        self.w = torch.randn(10, 8)

    @pytest.mark.parametrize("bad", [10, -1, 1000])
    def test_label_out_of_range(self, bad, monkeypatch):
        # the error comes before any compute: the matrix product is never called
        def boom(*a, **k):
            raise AssertionError("computed before validating labels")

        monkeypatch.setattr(torch, "mm", boom)
        y = torch.tensor([0, 1, bad, 3])
        with pytest.raises(ValueError, match=rf"outside \[0, 10\).*first: {bad}"):
            hr.linear_cross_entropy(self.x, self.w, y)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
    def test_label_dtype(self, dtype):
        with pytest.raises(TypeError, match="integer tensor.*long"):
            hr.linear_cross_entropy(self.x, self.w, torch.zeros(4, dtype=dtype))

    def test_int32_labels_accepted(self):
        y = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
        ref = F.cross_entropy(self.x @ self.w.T, y.long())
        _close(hr.linear_cross_entropy(self.x, self.w, y), ref)

    def test_feature_mismatch(self):
        with pytest.raises(ValueError, match="x has 8 features but weight has 9"):
            hr.linear_cross_entropy(self.x, torch.randn(10, 9), torch.zeros(4, dtype=torch.long))

    def test_transposed_weight(self):
        with pytest.raises(ValueError, match="weight.T"):
            hr.linear_cross_entropy(self.x, self.w.T.contiguous(), torch.zeros(4).long())

    def test_target_shape(self):
        with pytest.raises(ValueError, match="target shape"):
            hr.linear_cross_entropy(self.x, self.w, torch.zeros(5, dtype=torch.long))

    def test_options(self):
        y = torch.zeros(4, dtype=torch.long)
        with pytest.raises(ValueError, match="reduction"):
            hr.linear_cross_entropy(self.x, self.w, y, reduction="avg")
        with pytest.raises(ValueError, match="label_smoothing"):
            hr.linear_cross_entropy(self.x, self.w, y, label_smoothing=1.5)
        with pytest.raises(ValueError, match="slice_size"):
            hr.linear_cross_entropy(self.x, self.w, y, slice_size=0)
        with pytest.raises(ValueError, match="bias must have shape"):
            hr.linear_cross_entropy(self.x, self.w, y, torch.zeros(9))
        with pytest.raises(TypeError, match="dtype"):
            hr.linear_cross_entropy(self.x.double(), self.w, y)


def test_pick_slice_size_respects_budget():
    s = hr.heads.pick_slice_size(4096, 10_000_000, budget_bytes=64 << 20)
    assert 4096 * s * 4 <= 64 << 20
    assert hr.heads.pick_slice_size(8, 100) == 100
    assert hr.heads.pick_slice_size(10**9, 100) == 1


@pytest.mark.gpu
def test_host_weight_streamed_to_accelerator():
    dev = DEVICES[-1]
    x = torch.randn(16, 32, device=dev, requires_grad=True)
    w = torch.randn(2000, 32, requires_grad=True)  # rests in host memory
    b = torch.randn(2000, requires_grad=True)
    y = torch.randint(0, 2000, (16,), device=dev)
    out = hr.linear_cross_entropy(x, w, y, b, slice_size=300, label_smoothing=0.1)
    ref = F.cross_entropy(x @ w.to(dev).T + b.to(dev), y, label_smoothing=0.1)
    _close(out, ref)
    out.backward()
    assert w.grad.device.type == "cpu" and b.grad.device.type == "cpu"
    rx, rw, rb = torch.autograd.grad(
        F.cross_entropy(x @ w.T.to(dev) + b.to(dev), y, label_smoothing=0.1), [x, w, b])
    _close(x.grad, rx)
    _close(w.grad, rw)
    _close(b.grad, rb)


@pytest.mark.parametrize("bias", [False, True])
def test_double_backward_is_refused_with_the_fix(bias):
    x, w, b, y = _inputs(8, 16, 100, bias=bias)
    loss = hr.linear_cross_entropy(x, w, y, b, slice_size=32)
    with pytest.raises(RuntimeError, match=r"linear_cross_entropy does not support double "
                                           r"backward.*create_graph=True.*F\.cross_entropy"):
        torch.autograd.grad(loss, x, create_graph=True)
    # a first-order backward of the same graph still works
    (gx,) = torch.autograd.grad(loss, x)
    xr = x.detach().clone().requires_grad_()
    logits = xr @ w.detach().T + (b.detach() if bias else 0)
    (ref,) = torch.autograd.grad(F.cross_entropy(logits, y), xr)
    _close(gx, ref)
