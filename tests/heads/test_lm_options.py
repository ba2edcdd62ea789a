"""The language-model options of hr.linear_cross_entropy and HugeClassifier against dense PyTorch.

softcap, shift, z_loss, class_weight, the returned log-sum-exp / accuracy / predictions and
loss_dtype. fp32: loss and gradients at most as far from a float64 dense reference as PyTorch's
own fp32 dense computation is (twice that, plus a few ulps for the order of the sums). The
HugeClassifier runs with its weight on disk and must give what the function gives, bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import headroom as hr
from headroom.heads import _linear_ce
from headroom.store import DiskStore
from headroom.transfer import binding
from tests.heads.test_linear_loss import assert_as_exact_as_torch

C, D = 1000, 24


def dense_loss(x, w, y, b=None, *, softcap=None, shift=0, z_loss=0.0, class_weight=None,
               label_smoothing=0.0, reduction="mean", ignore_index=-100):
    """The options on full logits, as a user would write them with PyTorch (and HF, Gemma)."""
    if shift:
        x, y = x[..., :-shift, :], y[..., shift:]
    z = x @ w.T
    if b is not None:
        z = z + b
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    z2, y2 = z.reshape(-1, w.shape[0]), y.reshape(-1)
    cw = None if class_weight is None else class_weight.to(z.dtype)
    loss = F.cross_entropy(z2, y2, weight=cw, ignore_index=ignore_index,
                           label_smoothing=label_smoothing, reduction=reduction)
    lse = torch.logsumexp(z2, -1)
    if z_loss:
        valid = y2 != ignore_index
        zl = torch.where(valid, z_loss * lse**2, torch.zeros_like(lse))
        loss = loss + (zl if reduction == "none" else
                       zl.sum() / valid.sum() if reduction == "mean" else zl.sum())
    if reduction == "none":
        loss = loss.reshape(y.shape)
    return loss, lse.reshape(y.shape), z2


def _inputs(shape=(3, 17), *, bias=True, scale=1.0, dtype=torch.float32, ignore=-100):
    x = (torch.randn(*shape, D) * scale).to(dtype).requires_grad_()
    w = (torch.randn(C, D) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(C).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, C, shape)
    y.view(-1)[::5] = ignore
    return x, w, b, y


OPTIONS = {
    "softcap": {"softcap": 5.0},             # logits reach +-20: the cap saturates
    "shift": {"shift": True},
    "shift2": {"shift": 2},
    "z_loss": {"z_loss": 0.05},
    "class_weight": {"class_weight": "rand"},
    "class_weight_smoothing": {"class_weight": "rand", "label_smoothing": 0.2},
    "negative_class_weight": {"class_weight": "randn", "label_smoothing": 0.1},
    "ignore_index": {"ignore_index": 7},
    "all": {"softcap": 5.0, "shift": True, "z_loss": 0.05, "class_weight": "rand",
            "label_smoothing": 0.1, "ignore_index": 7},
}


def _resolve(opts):
    opts = dict(opts)
    if opts.get("class_weight") == "rand":
        opts["class_weight"] = torch.rand(C) + 0.1
    elif opts.get("class_weight") == "randn":
        opts["class_weight"] = torch.randn(C)
    return opts


@pytest.mark.parametrize("path", ["sliced", "rows"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_fp32_as_exact_as_torch(name, reduction, path, monkeypatch):
    # "sliced": two passes over class slices; "rows": the one-pass path over chunks of rows
    # (automatic slices, a scalar loss, a weight on x's device; "none" falls back to slices)
    calls = _count_paths(monkeypatch)
    opts = _resolve(OPTIONS[name])
    ii = opts.get("ignore_index", -100)
    x, w, b, y = _inputs(scale=2.0, ignore=ii)
    out = hr.linear_cross_entropy(x, w, y, b, slice_size=128 if path == "sliced" else None,
                                  reduction=reduction, **opts)
    expect = "rows" if path == "rows" and reduction != "none" else "sliced"
    assert calls == [expect]
    ref32, _, _ = dense_loss(x, w, y, b, reduction=reduction, **opts)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref64, _, _ = dense_loss(x64, w64, y, b64, reduction=reduction, **opts)
    assert out.shape == ref32.shape and out.dtype == torch.float32
    assert_as_exact_as_torch(out, ref32, ref64, f"{name} loss")
    g = torch.randn_like(ref64) if reduction == "none" else torch.tensor(-1.3, dtype=torch.float64)
    got = torch.autograd.grad(out, (x, w, b), g.float())
    want32 = torch.autograd.grad(ref32, (x, w, b), g.float())
    want64 = torch.autograd.grad(ref64, (x64, w64, b64), g)
    for what, a, t32, t64 in zip("xwb", got, want32, want64, strict=True):
        assert_as_exact_as_torch(a, t32, t64, f"{name} grad {what}")


def _count_paths(monkeypatch):
    """Record which path each call takes."""
    from headroom.heads import _linear_ce

    calls = []
    cls = _linear_ce._LinearCrossEntropy
    orig = cls.forward

    def forward(ctx, *a):
        calls.append("sliced" if len(a) < 8 or a[7] is None else "rows")  # a[7]: rows
        return orig(ctx, *a)

    monkeypatch.setattr(cls, "forward", staticmethod(forward))
    return calls


def test_rows_path_chunks_and_scales():
    # several chunks (never all rows at once), an incoming gradient other than 1, and a
    # gradient only for some inputs
    x, w, b, y = _inputs(shape=(4, 150), scale=2.0)
    rows = _linear_ce.rows_per_chunk(600, C, softcap=False)
    assert rows == 300
    for need in ("xwb", "w", "x"):
        xs, ws, bs = (t.detach().clone().requires_grad_(k in need)
                      for k, t in zip("xwb", (x, w, b), strict=True))
        out = hr.linear_cross_entropy(xs, ws, y, bs, softcap=5.0, z_loss=0.01)
        ref, _, _ = dense_loss(xs, ws, y, bs, softcap=5.0, z_loss=0.01)
        torch.testing.assert_close(out, ref)
        leaves = [t for t in (xs, ws, bs) if t.requires_grad]
        for a, r in zip(torch.autograd.grad(out * 3.5, leaves),
                        torch.autograd.grad(ref * 3.5, leaves), strict=True):
            torch.testing.assert_close(a, r)
    # no gradient wanted: the sliced forward alone
    with torch.no_grad():
        torch.testing.assert_close(hr.linear_cross_entropy(x, w, y, b), dense_loss(x, w, y, b)[0])


def test_lse_is_returned_and_differentiable():
    # a z-loss built by the caller from the returned lse (as CCE's users do) must equal the
    # built-in z_loss, loss and gradients
    x, w, b, y = _inputs(scale=2.0)
    out = hr.linear_cross_entropy(x, w, y, b, slice_size=128, shift=True, softcap=5.0,
                                  return_lse=True)
    _, lse_ref, _ = dense_loss(x, w, y, b, shift=True, softcap=5.0)
    assert out.lse.shape == y[:, 1:].shape
    torch.testing.assert_close(out.lse, lse_ref)
    valid = y[:, 1:] != -100
    by_hand = out.loss + 0.05 * (out.lse[valid] ** 2).mean()
    built_in = hr.linear_cross_entropy(x, w, y, b, slice_size=128, shift=True, softcap=5.0,
                                       z_loss=0.05)
    torch.testing.assert_close(by_hand, built_in)
    for a, c in zip(torch.autograd.grad(by_hand, (x, w, b)),
                    torch.autograd.grad(built_in, (x, w, b)), strict=True):
        torch.testing.assert_close(a, c)
    # the lse alone as the output of a graph
    ref = torch.autograd.grad(lse_ref.sum(), (x, w, b))
    out = hr.linear_cross_entropy(x, w, y, b, slice_size=128, shift=True, softcap=5.0,
                                  return_lse=True)
    for a, c in zip(torch.autograd.grad(out.lse.sum(), (x, w, b)), ref, strict=True):
        torch.testing.assert_close(a, c)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("shift", [0, 1])
def test_accuracy_and_predictions_equal_dense(softcap, shift):
    x, w, b, y = _inputs(scale=2.0)
    y.view(-1)[3::7] = torch.arange(C)[:y.view(-1)[3::7].numel()]  # some rows right by chance
    with torch.no_grad():
        _, _, z = dense_loss(x, w, y, b, softcap=softcap, shift=shift)
    pred = z.argmax(-1)
    yy = (y[:, shift:] if shift else y).reshape(-1)
    # make some targets the prediction, so the accuracy is neither 0 nor 1
    yy = torch.where(torch.arange(yy.numel()) % 3 == 0, pred, yy)
    yy[1] = -100
    y2 = y.clone()
    (y2[:, shift:] if shift else y2).copy_(yy.reshape(y2[:, shift:].shape))
    out = hr.linear_cross_entropy(x, w, y2, b, slice_size=128, softcap=softcap, shift=shift,
                                  return_accuracy=True, return_predictions=True)
    expect = torch.where(yy != -100, pred, -1)
    assert torch.equal(out.predictions.reshape(-1), expect)
    valid = yy != -100
    acc = ((pred == yy) & valid).sum() / valid.sum()
    assert 0 < acc < 1
    torch.testing.assert_close(out.accuracy, acc.float())
    plain = hr.linear_cross_entropy(x, w, y2, b, slice_size=128, softcap=softcap, shift=shift)
    assert torch.equal(out.loss, plain)


@pytest.mark.parametrize("slice_size", [None, 128])
def test_ignored_rows_skip_the_products(monkeypatch, slice_size):
    # a masked prompt costs nothing: only the rows not ignored reach the passes
    from headroom.heads import _linear_ce

    seen = []
    def recording(orig):
        def record(x, *a, **k):
            seen.append(x.shape[0])
            return orig(x, *a, **k)
        return record

    for name in ("row_pass", "ce_forward"):
        monkeypatch.setattr(_linear_ce, name, recording(getattr(_linear_ce, name)))
    x, w, b, y = _inputs(shape=(4, 150), scale=2.0)
    y[:, :40] = -100
    opts = {"shift": True, "softcap": 5.0, "z_loss": 0.01}
    out = hr.linear_cross_entropy(x, w, y, b, slice_size=slice_size, return_accuracy=True,
                                  return_predictions=True, **opts)
    valid = y[:, 1:] != -100
    assert seen == [int(valid.sum())]
    ref, _, z = dense_loss(x, w, y, b, **opts)
    torch.testing.assert_close(out.loss, ref)
    expect = torch.where(valid, z.argmax(-1).reshape(valid.shape), -1)
    assert torch.equal(out.predictions, expect)
    torch.testing.assert_close(out.accuracy, (expect == y[:, 1:]).sum() / valid.sum())
    got = torch.autograd.grad(out.loss, (x, w, b))
    for a, r in zip(got, torch.autograd.grad(ref, (x, w, b)), strict=True):
        torch.testing.assert_close(a, r)
    assert not got[0][:, :39].any()  # rows predicting an ignored label: exactly zero


def test_predictions_take_the_first_of_tied_classes():
    x = torch.ones(4, 2)
    w = torch.zeros(300, 2)
    w[[7, 150, 299]] = 1.0  # three tied maxima, in different slices
    out = hr.linear_cross_entropy(x, w, torch.tensor([7, 150, 1, -100]), slice_size=100,
                                  return_accuracy=True, return_predictions=True)
    assert out.predictions.tolist() == [7, 7, 7, -1]
    assert out.accuracy.item() == pytest.approx(1 / 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_loss_is_fp32_and_close(dtype):
    x, w, b, y = _inputs(dtype=dtype)
    opts = {"softcap": 5.0, "shift": True, "z_loss": 0.05, "class_weight": torch.rand(C) + .1}
    out = hr.linear_cross_entropy(x, w, y, b, slice_size=128, **opts)
    assert out.dtype == torch.float32
    xf, wf, bf = (t.detach().float().requires_grad_() for t in (x, w, b))
    ref, _, _ = dense_loss(xf, wf, y, bf, **opts)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # fp32 math on the same inputs
    for a, r in zip(torch.autograd.grad(out, (x, w, b)),
                    torch.autograd.grad(ref, (xf, wf, bf)), strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), r, rtol=2**-7, atol=1e-6)
    assert hr.linear_cross_entropy(x, w, y, b, slice_size=128, loss_dtype=dtype,
                                   **opts).dtype == dtype


# ---------------------------------------------------------------------------------------------
# HugeClassifier: every option with the weight on disk, bitwise what the function gives


@pytest.mark.parametrize("name", ["softcap", "shift", "z_loss", "class_weight_smoothing", "all"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_classifier_on_disk_equals_function(name, reduction, tmp_path):
    opts = _resolve(OPTIONS[name])
    ii = opts.get("ignore_index", -100)
    head = hr.HugeClassifier(C, D, bias=True, device="cpu", store=DiskStore(tmp_path / "s"),
                             slice_size=128)
    w = head.read_weight().clone().requires_grad_()
    b = head.read_bias().clone().requires_grad_()
    x, _, _, y = _inputs(scale=2.0, ignore=ii)
    xr = x.detach().clone().requires_grad_()
    flags = {"return_lse": True, "return_accuracy": True, "return_predictions": True}
    got = head(x, y, reduction=reduction, **opts, **flags)
    want = hr.linear_cross_entropy(xr, w, y, b, slice_size=128, reduction=reduction, **opts,
                                   **flags)
    for a, c in zip(got, want, strict=True):
        assert torch.equal(a, c)
    g = torch.randn_like(got.loss)
    (got.loss * g).sum().add(got.lse.sum()).backward()
    (want.loss * g).sum().add(want.lse.sum()).backward()
    assert torch.equal(x.grad, xr.grad)
    store = head.store
    assert torch.equal(store.read(binding(head.weight).grad_handle).result(), w.grad)
    assert torch.equal(store.read(binding(head.bias).grad_handle).result(), b.grad)


def test_classifier_bf16_features_give_fp32_loss():
    with pytest.warns(UserWarning, match="saves no memory"):
        head = hr.HugeClassifier(C, D, device="cpu", slice_size=128)
    x = torch.randn(2, 5, D, dtype=torch.bfloat16)
    y = torch.randint(0, C, (2, 5))
    assert head(x, y, shift=True).dtype == torch.float32
    assert head(x, y, loss_dtype=torch.bfloat16).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# bad input: the cause and the fix, before any compute


class TestBadOptions:
    x = torch.randn(2, 6, D)
    w = torch.randn(C, D)
    y = torch.randint(0, C, (2, 6))

    @pytest.mark.parametrize("kw, err, match", [
        ({"softcap": 0.0}, ValueError, "softcap must be a positive float"),
        ({"softcap": -3.0}, ValueError, "softcap must be a positive float"),
        ({"z_loss": -1.0}, ValueError, "z_loss must be a float >= 0"),
        ({"shift": -1}, ValueError, "shift must be a bool or an int >= 0"),
        ({"shift": 6}, ValueError, "shift=6 needs a sequence dimension longer than 6"),
        ({"class_weight": torch.ones(C - 1)}, ValueError,
         r"class_weight must have shape \(1000,\)"),
        ({"class_weight": torch.ones(C, dtype=torch.long)}, TypeError, "floating tensor"),
        ({"class_weight": torch.ones(C, requires_grad=True)}, ValueError, "detach"),
        ({"loss_dtype": torch.int64}, TypeError, "loss_dtype must be a floating dtype"),
    ])
    def test_refused(self, kw, err, match):
        with pytest.raises(err, match=match):
            hr.linear_cross_entropy(self.x, self.w, self.y, **kw)

    def test_shift_needs_a_sequence(self):
        with pytest.raises(ValueError, match=r"shift=1 needs x of shape \(..., seq, features\)"):
            hr.linear_cross_entropy(torch.randn(D), self.w, torch.tensor(3), shift=True)

    def test_label_after_shift_out_of_range(self):
        y = self.y.clone()
        y[0, 0] = C + 5  # never used with shift: accepted
        hr.linear_cross_entropy(self.x, self.w, y, shift=True)
        y[0, 3] = C + 5
        with pytest.raises(ValueError, match="outside"):
            hr.linear_cross_entropy(self.x, self.w, y, shift=True)

    def test_classifier_refuses_options_it_cannot_honour(self):
        with pytest.warns(UserWarning, match="saves no memory"):
            sampled = hr.HugeClassifier(C, D, device="cpu", sample_rate=0.5)
        with pytest.raises(ValueError, match="softcap.*need the exact loss"):
            sampled(self.x, self.y, softcap=5.0)
        with pytest.warns(UserWarning, match="saves no memory"):
            head = hr.HugeClassifier(C, D, device="cpu")
        with pytest.raises(ValueError, match="given: z_loss"):
            head(self.x[0], (torch.arange(7), torch.arange(6)), z_loss=0.1)
