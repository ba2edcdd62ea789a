"""hr.linear_loss (multi-label, per-class losses) against the same losses on full logits.

The sums run in another order than on dense logits, so results cannot be bitwise those of PyTorch.
What is asserted is the issue's bar: the error against a float64 reference is at most what
PyTorch's own float32 computation on the full logits makes (twice that, plus a few float32 ulps
of the result's magnitude, for the order of the sums).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import headroom as hr
from tests.conftest import DEVICES

EPS32 = torch.finfo(torch.float32).eps
SEPARABLE = ("bce", "squared_hinge")


def assert_as_exact_as_torch(ours, torch32, ref64, what=""):
    """``ours`` is as close to the float64 ``ref64`` as PyTorch's float32 ``torch32`` is."""
    ref = ref64.detach().double().cpu()
    e_ours = float((ours.detach().double().cpu() - ref).abs().max()) if ref.numel() else 0.0
    e_torch = float((torch32.detach().double().cpu() - ref).abs().max()) if ref.numel() else 0.0
    floor = 4 * EPS32 * float(ref.abs().max()) if ref.numel() else 0.0
    assert e_ours <= 2 * e_torch + floor, (
        f"{what}: error {e_ours:.3g} vs PyTorch fp32's {e_torch:.3g} (floor {floor:.3g})")


def random_targets(batch, classes, *, max_pos=8, values=False, device="cpu", gen=None):
    """CSR targets with 0..max_pos positives per row (row 1 has none), rows unsorted."""
    counts = torch.randint(0, max_pos + 1, (batch,), generator=gen)
    counts[min(1, batch - 1)] = 0
    rows = [torch.randperm(classes, generator=gen)[: int(k)] for k in counts]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    indices = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
    if values:
        vals = torch.rand(indices.numel(), generator=gen) * 1.5  # soft, and > 1 (propensity)
        return offsets.to(device), indices.to(device), vals.to(device)
    return offsets.to(device), indices.to(device)


def dense_target(targets, batch, classes, dtype=torch.float64):
    offsets, indices = targets[0].cpu(), targets[1].cpu()
    rows = torch.repeat_interleave(torch.arange(batch), offsets.diff())
    t = torch.zeros(batch, classes, dtype=dtype)
    t[rows, indices] = targets[2].cpu().to(dtype) if len(targets) == 3 else 1.0
    return t


def dense_loss(z, t, loss, *, pos_weight=None, reduction="mean", keep=None):
    """The loss on full logits ``z`` against the dense target ``t``, with PyTorch's ops."""
    if keep is not None:
        z, t = z[keep], t[keep]
    if loss == "bce":
        rows = F.binary_cross_entropy_with_logits(z, t, pos_weight=pos_weight,
                                                  reduction="none").sum(1)
        if reduction == "mean":
            return F.binary_cross_entropy_with_logits(z, t, pos_weight=pos_weight)
    elif loss == "squared_hinge":
        pw = 1.0 if pos_weight is None else pos_weight
        el = pw * t * (1 - z).clamp_min(0) ** 2 + (1 - t) * (1 + z).clamp_min(0) ** 2
        rows = el.sum(1)
        if reduction == "mean":
            return el.mean()
    else:
        if loss == "softmax":
            t = t / t.sum(1, keepdim=True).clamp_min(1e-30)
        rows = F.cross_entropy(z, t, reduction="none") if z.shape[0] else z.sum(1)
    if reduction == "sum":
        return rows.sum()
    return rows.mean() if reduction == "mean" else rows


def _params(batch, dim, classes, *, bias, device="cpu", dtype=torch.float32):
    x = torch.randn(batch, dim, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(classes, dim, device=device, dtype=dtype) * 0.5).requires_grad_()
    b = torch.randn(classes, device=device, dtype=dtype, requires_grad=True) if bias else None
    return x, w, b


def _check(x, w, b, targets, *, loss, pos_weight=None, reduction="mean", ignore=None,
           grad_out=None, **kw):
    """Run linear_loss and the dense loss (fp64 and fp32); compare loss and every gradient."""
    batch, classes = x.shape[0], w.shape[0]
    out = hr.linear_loss(x, w, targets, loss=loss, bias=b, pos_weight=pos_weight,
                         reduction=reduction, ignore_rows=ignore, **kw)
    keep = None if ignore is None else ~ignore
    tensors = [t for t in (x, w, b) if t is not None]
    if grad_out is None:
        grad_out = torch.randn_like(out) if reduction == "none" else torch.tensor(-1.7)
    got = torch.autograd.grad(out, tensors, grad_out.to(out.device))
    refs = {}
    for dt in (torch.float64, torch.float32):
        xs = [t.detach().to(dt).requires_grad_() for t in tensors]
        z = xs[0] @ xs[1].T + (xs[2] if b is not None else 0)
        pw = pos_weight if pos_weight is None else torch.as_tensor(pos_weight).to(dt)
        t = dense_target(targets, batch, classes, dt).to(x.device)
        r = dense_loss(z, t, loss, pos_weight=pw, reduction=reduction, keep=keep)
        if reduction == "none" and keep is not None:
            r = torch.zeros(batch, dtype=dt, device=x.device).index_put((keep,), r)
        refs[dt] = (r, torch.autograd.grad(r, xs, grad_out.to(x.device, dt)))
    assert out.shape == refs[torch.float64][0].shape
    assert_as_exact_as_torch(out, refs[torch.float32][0], refs[torch.float64][0], "loss")
    for i, g in enumerate(got):
        assert_as_exact_as_torch(g, refs[torch.float32][1][i], refs[torch.float64][1][i],
                                 f"gradient {i}")
    return out


# ---------------------------------------------------------------------------------------------
# exactness


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss", ["bce", "squared_hinge", "softmax", "softmax_sum"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", [False, True])
@pytest.mark.parametrize("values", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_dense_reference(device, loss, reduction, ignore, values, bias):
    # 1000 classes in slices of 128 (the last one partial); rows without positives; soft values
    x, w, b = _params(37, 24, 1000, bias=bias, device=device)
    targets = random_targets(37, 1000, values=values, device=device)
    mask = None
    if ignore:
        mask = torch.zeros(37, dtype=torch.bool, device=device)
        mask[::5] = True
    _check(x, w, b, targets, loss=loss, reduction=reduction, ignore=mask, slice_size=128)


@pytest.mark.parametrize("loss", SEPARABLE)
@pytest.mark.parametrize("kind", ["float", "per_class", "single"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_pos_weight_like_pytorch(loss, kind, reduction):
    x, w, b = _params(29, 16, 700, bias=True)
    pw = {"float": 3.0, "per_class": torch.rand(700) * 4, "single": torch.tensor([2.5])}[kind]
    targets = random_targets(29, 700, values=True)
    _check(x, w, b, targets, loss=loss, pos_weight=pw, reduction=reduction, slice_size=96)


@pytest.mark.parametrize("slice_size", [1, 7, 300, 1000, 5000, None])
def test_any_slice_size(slice_size):
    x, w, b = _params(9, 8, 1000, bias=True)
    _check(x, w, b, random_targets(9, 1000), loss="bce", slice_size=slice_size)


def test_large_logits_keep_bce_exact():
    # |z| up to ~60: softplus saturates; positives with large z cancel in the bulk correction
    x, w, b = _params(16, 32, 500, bias=False)
    with torch.no_grad():
        w.mul_(6.0)
    targets = random_targets(16, 500, values=True)
    for reduction in ("sum", "none"):
        _check(x, w, b, targets, loss="bce", reduction=reduction, slice_size=64,
               pos_weight=torch.rand(500) * 3)


def test_list_and_sparse_csr_forms_equal_the_csr_pair():
    x, w, _ = _params(6, 8, 50, bias=False)
    offsets, indices = random_targets(6, 50)
    rows = [indices[offsets[i]:offsets[i + 1]] for i in range(6)]
    sp = torch.sparse_csr_tensor(offsets, indices, torch.ones(indices.numel()), (6, 50))
    ref = hr.linear_loss(x, w, (offsets, indices), reduction="none")
    assert torch.equal(hr.linear_loss(x, w, rows, reduction="none"), ref)
    assert torch.equal(hr.linear_loss(x, w, [r.tolist() for r in rows], reduction="none"), ref)
    assert torch.equal(hr.linear_loss(x, w, sp, reduction="none"), ref)
    # the order within a row does not matter
    flipped = torch.cat([r.flip(0) for r in rows])
    assert torch.equal(hr.linear_loss(x, w, (offsets, flipped), reduction="none"), ref)


def test_leading_dims_and_partial_grads():
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.randn(300, 16)  # frozen: no weight gradient is formed
    targets = random_targets(15, 300)
    ignore = torch.zeros(3, 5, dtype=torch.bool)
    ignore[1, 2] = True
    out = hr.linear_loss(x, w, targets, reduction="none", ignore_rows=ignore, slice_size=64)
    assert out.shape == (3, 5) and out[1, 2] == 0
    g = torch.randn(3, 5)
    (gx,) = torch.autograd.grad(out, [x], g)
    assert not gx[1, 2].any()
    xr = x.detach().reshape(15, 16).double().requires_grad_()
    t = dense_target(targets, 15, 300)
    ref = F.binary_cross_entropy_with_logits(xr @ w.double().T, t, reduction="none").sum(1)
    ref = ref * (~ignore.reshape(-1))
    (rx,) = torch.autograd.grad(ref, [xr], g.reshape(-1).double())
    torch.testing.assert_close(out.reshape(-1).double(), ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gx.reshape(15, 16).double(), rx, rtol=1e-5, atol=1e-6)


def test_bf16_accumulates_in_fp32():
    x, w, b = _params(32, 32, 3000, bias=True, dtype=torch.bfloat16)
    targets = random_targets(32, 3000)
    xf, wf, bf = (t.detach().float().requires_grad_() for t in (x, w, b))
    t = dense_target(targets, 32, 3000, torch.float32)
    ref = F.binary_cross_entropy_with_logits(xf @ wf.T + bf, t, reduction="sum")
    out = hr.linear_loss(x, w, targets, bias=b, reduction="sum", slice_size=256)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2**-8, atol=0)
    grads = torch.autograd.grad(out, [x, w, b])
    refs = torch.autograd.grad(ref, [xf, wf, bf])
    for got, want in zip(grads, refs, strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("loss", ["bce", "softmax"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_and_all_ignored_like_pytorch(loss, reduction):
    for batch, ignore_all in ((0, False), (5, True)):
        x, w, _ = _params(batch, 8, 40, bias=False)
        targets = random_targets(batch, 40) if batch else (torch.zeros(1).long(),
                                                            torch.zeros(0).long())
        ignore = torch.ones(batch, dtype=torch.bool) if ignore_all else None
        out = hr.linear_loss(x, w, targets, loss=loss, reduction=reduction, ignore_rows=ignore)
        z = (x @ w.T)[:0]
        ref = dense_loss(z, torch.zeros(0, 40), loss, reduction=reduction)
        if reduction == "none":
            assert out.shape == (batch,) and not out.any()
        else:
            torch.testing.assert_close(out, ref, equal_nan=True)
        gx, gw = torch.autograd.grad(out.sum(), [x, w])
        assert not gx.any() and not gw.any()


def test_retained_graph_second_backward_recomputes():
    x, w, b = _params(12, 8, 200, bias=True)
    targets = random_targets(12, 200)
    out = hr.linear_loss(x, w, targets, bias=b, slice_size=64)
    first = torch.autograd.grad(out, [x, w, b], retain_graph=True)
    second = torch.autograd.grad(out, [x, w, b], torch.tensor(2.0))
    for a, c in zip(first, second, strict=True):
        torch.testing.assert_close(2 * a, c, rtol=1e-6, atol=1e-9)


def test_in_place_change_before_backward_is_refused_like_autograd():
    # x @ weight.T + bias: autograd refuses a backward after weight changed in place (it would
    # use the changed values); so does linear_loss. A change of bias is refused too: a second
    # backward through a retained graph recomputes the logits from it.
    x, w, b = _params(12, 8, 200, bias=True)
    targets = random_targets(12, 200)
    dense = dense_loss(x @ w.T + b, dense_target(targets, 12, 200, torch.float32), "bce")
    ours = hr.linear_loss(x, w, targets, bias=b, slice_size=64)
    with torch.no_grad():
        w.add_(1.0)
    for out in (dense, ours):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward()
    with torch.no_grad():
        w.sub_(1.0)
    out = hr.linear_loss(x, w, targets, bias=b, slice_size=64)
    with torch.no_grad():
        b.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_gradients_accumulate_like_autograd():
    x, w, b = _params(12, 8, 200, bias=True)
    targets = random_targets(12, 200)
    for _ in range(2):
        hr.linear_loss(x, w, targets, bias=b, loss="squared_hinge").backward()
    refs = {}
    for dt in (torch.float64, torch.float32):
        xs = [t.detach().to(dt).requires_grad_() for t in (x, w, b)]
        for _ in range(2):
            dense_loss(xs[0] @ xs[1].T + xs[2], dense_target(targets, 12, 200, dt),
                       "squared_hinge").backward()
        refs[dt] = [t.grad for t in xs]
    for i, got in enumerate((x.grad, w.grad, b.grad)):
        assert_as_exact_as_torch(got, refs[torch.float32][i], refs[torch.float64][i], str(i))


def test_no_grad_forms_no_gradient(monkeypatch):
    from headroom.heads import _slices

    x, w, _ = _params(8, 8, 100, bias=False)
    targets = random_targets(8, 100)
    ref = hr.linear_loss(x, w, targets).detach()

    def boom(*a, **k):
        raise AssertionError("a gradient sink was made without grad mode")

    monkeypatch.setattr(_slices, "TensorGradSink", boom)
    with torch.no_grad():
        assert torch.equal(hr.linear_loss(x, w, targets), ref)


@pytest.mark.parametrize("loss", ["bce", "softmax"])
def test_double_backward_is_refused_with_the_fix(loss):
    x, w, _ = _params(8, 16, 100, bias=False)
    out = hr.linear_loss(x, w, random_targets(8, 100), loss=loss, reduction="none")
    with pytest.raises(RuntimeError, match=r"linear_loss does not support double backward.*"
                                           r"create_graph=True.*dense logits"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


# ---------------------------------------------------------------------------------------------
# a user's per-slice loss


def _focal(scores, targets, classes, *, class_weight, gamma=2.0):
    """A per-class loss that is not built in: class-weighted focal loss (uses ``classes``)."""
    p = torch.sigmoid(scores)
    pt = torch.where(targets > 0, p, 1 - p)
    bce = F.binary_cross_entropy_with_logits(scores, targets, reduction="none")
    cw = class_weight[classes].to(scores.dtype)
    return ((1 - pt) ** gamma * bce * cw).sum()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
def test_custom_loss_against_same_loss_on_full_logits(reduction, bias):
    x, w, b = _params(23, 16, 900, bias=bias)
    targets = random_targets(23, 900)
    cw = torch.rand(900) + 0.5
    seen = []

    def fn(scores, targets, classes):
        assert scores.dtype == targets.dtype == torch.float32
        assert isinstance(classes, range) and scores.shape[1] == len(classes)
        seen.append(classes)
        return _focal(scores, targets, classes, class_weight=cw)

    out = hr.linear_loss(x, w, targets, loss=fn, bias=b, reduction=reduction, slice_size=200)
    assert [(r.start, r.stop) for r in seen] == [(0, 200), (200, 400), (400, 600), (600, 800),
                                                 (800, 900)]
    tensors = [t for t in (x, w, b) if t is not None]
    got = torch.autograd.grad(out, tensors, torch.tensor(0.3))
    refs = {}
    for dt in (torch.float64, torch.float32):
        xs = [t.detach().to(dt).requires_grad_() for t in tensors]
        z = xs[0] @ xs[1].T + (xs[2] if bias else 0)
        r = _focal(z, dense_target(targets, 23, 900, dt), range(900), class_weight=cw)
        r = r / 23 if reduction == "mean" else r  # "mean" divides by the rows
        refs[dt] = (r, torch.autograd.grad(r, xs, torch.tensor(0.3, dtype=dt)))
    assert_as_exact_as_torch(out, refs[torch.float32][0], refs[torch.float64][0], "loss")
    for i, g in enumerate(got):
        assert_as_exact_as_torch(g, refs[torch.float32][1][i], refs[torch.float64][1][i], str(i))


def test_custom_loss_equals_the_built_in_it_restates():
    x, w, b = _params(17, 8, 333, bias=True)
    targets = random_targets(17, 333, values=True)

    def bce(scores, targets, classes):
        return F.binary_cross_entropy_with_logits(scores, targets, reduction="sum")

    a = hr.linear_loss(x, w, targets, loss=bce, bias=b, slice_size=50, reduction="sum")
    c = hr.linear_loss(x, w, targets, loss="bce", bias=b, slice_size=50, reduction="sum")
    torch.testing.assert_close(a, c, rtol=1e-5, atol=0)
    for ga, gc in zip(torch.autograd.grad(a, [x, w, b]), torch.autograd.grad(c, [x, w, b]),
                      strict=True):
        torch.testing.assert_close(ga, gc, rtol=1e-5, atol=1e-6 * float(gc.abs().max()))


class TestCustomLossErrors:
    def setup_method(self):
        self.x, self.w, _ = _params(4, 8, 30, bias=False)
        self.t = random_targets(4, 30)

    def test_not_a_scalar(self):
        with pytest.raises(TypeError, match=r"0-d floating tensor.*got shape \(4, 30\).*\.sum"):
            hr.linear_loss(self.x, self.w, self.t, loss=lambda s, t, c: s * t)

    def test_detached(self):
        with pytest.raises(RuntimeError, match="does not depend on `scores`"):
            hr.linear_loss(self.x, self.w, self.t, loss=lambda s, t, c: (s.detach() * t).sum())

    def test_other_tensor_requiring_grad(self):
        temperature = torch.tensor(2.0, requires_grad=True)
        with pytest.raises(RuntimeError, match="require grad besides `scores`.*no gradient"):
            hr.linear_loss(self.x, self.w, self.t,
                           loss=lambda s, t, c: F.softplus(s / temperature).sum())

    def test_reduction_none(self):
        with pytest.raises(ValueError, match="reduction='none' needs per-row"):
            hr.linear_loss(self.x, self.w, self.t, loss=lambda s, t, c: s.sum(),
                           reduction="none")


# ---------------------------------------------------------------------------------------------
# bad input: the cause and the fix, before any compute


class TestBadTargets:
    def setup_method(self):
        self.x = torch.randn(4, 8)
        self.w = torch.randn(10, 8)

    def _run(self, targets, **kw):
        return hr.linear_loss(self.x, self.w, targets, **kw)

    @pytest.mark.parametrize("bad", [10, -1, 1000])
    def test_class_out_of_range(self, bad, monkeypatch):
        def boom(*a, **k):
            raise AssertionError("computed before validating the targets")

        monkeypatch.setattr(torch, "mm", boom)
        with pytest.raises(ValueError, match=rf"outside \[0, 10\).*first: {bad} in row 2"):
            self._run((torch.tensor([0, 1, 2, 4, 4]), torch.tensor([0, 1, bad, 3])))

    def test_duplicate_in_a_row(self):
        with pytest.raises(ValueError, match=r"row 1 lists class 7 more than once.*unique"):
            self._run((torch.tensor([0, 1, 3, 3, 4]), torch.tensor([7, 7, 7, 2])))

    def test_offsets(self):
        with pytest.raises(ValueError, match=r"rows \+ 1 = 5 entries"):
            self._run((torch.tensor([0, 1, 2, 3]), torch.tensor([1, 2, 3])))
        with pytest.raises(ValueError, match=r"offsets\[0\] must be 0"):
            self._run((torch.tensor([1, 1, 2, 3, 3]), torch.tensor([1, 2, 3])))
        with pytest.raises(ValueError, match=r"non-decreasing.*offsets\[1\] = 2 > offsets\[2\]"):
            self._run((torch.tensor([0, 2, 1, 3, 3]), torch.tensor([1, 2, 3])))
        with pytest.raises(ValueError, match=r"offsets\[-1\] = 3 must equal len\(indices\) = 4"):
            self._run((torch.tensor([0, 1, 2, 3, 3]), torch.tensor([1, 2, 3, 4])))

    def test_forms(self):
        with pytest.raises(TypeError, match="must hold integers.*long"):
            self._run((torch.tensor([0, 1, 1, 1, 1]), torch.tensor([1.0])))
        with pytest.raises(TypeError, match="dense batch x classes target is what this avoids"):
            self._run(torch.zeros(4, 10))
        with pytest.raises(TypeError, match="CSR tuple"):
            self._run({"offsets": 0})
        with pytest.raises(ValueError, match="one index tensor per row, 4 rows, got 3"):
            self._run([torch.tensor([1]), torch.tensor([2]), torch.tensor([3])])
        with pytest.raises(ValueError, match="read as CSR"):
            self._run((torch.tensor([0, 1]),))
        sp = torch.sparse_csr_tensor(torch.tensor([0, 1, 1, 1, 1]), torch.tensor([3]),
                                     torch.ones(1), (4, 11))
        with pytest.raises(ValueError, match=r"shape \(rows, num_classes\) = \(4, 10\)"):
            self._run(sp)

    def test_values(self):
        off, idx = torch.tensor([0, 1, 2, 2, 2]), torch.tensor([1, 2])
        with pytest.raises(ValueError, match="one entry per index"):
            self._run((off, idx, torch.ones(3)))
        with pytest.raises(ValueError, match="finite"):
            self._run((off, idx, torch.tensor([1.0, float("nan")])))
        with pytest.raises(TypeError, match="values must be floating"):
            self._run((off, idx, torch.tensor([1, 1])))
        with pytest.raises(ValueError, match="values >= 0"):
            self._run((off, idx, torch.tensor([1.0, -1.0])), loss="softmax")

    def test_options(self):
        t = (torch.tensor([0, 1, 1, 1, 1]), torch.tensor([3]))
        with pytest.raises(ValueError, match="loss must be one of"):
            self._run(t, loss="hinge")
        with pytest.raises(ValueError, match="reduction"):
            self._run(t, reduction="avg")
        with pytest.raises(ValueError, match=r"pos_weight must have one entry per class"):
            self._run(t, pos_weight=torch.ones(9))
        with pytest.raises(ValueError, match="pos_weight requires grad.*detach"):
            self._run(t, pos_weight=torch.ones(10, requires_grad=True))
        with pytest.raises(ValueError, match="pos_weight weighs the positive term"):
            self._run(t, pos_weight=2.0, loss="softmax")
        with pytest.raises(ValueError, match="ignore_rows must be a bool tensor of shape"):
            self._run(t, ignore_rows=torch.zeros(4))
        with pytest.raises(ValueError, match="x has 8 features but weight has 9"):
            hr.linear_loss(self.x, torch.randn(10, 9), t)


# ---------------------------------------------------------------------------------------------
# what survives an exception (Ctrl-C included) in the middle of a pass


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_exception_mid_pass_changes_nothing_and_training_stays_exact(error):
    torch.manual_seed(0)
    w0 = torch.randn(500, 16) * 0.3
    batches = [(torch.randn(12, 16), random_targets(12, 500)) for _ in range(3)]
    calls = {"n": 0, "fail_at": None}

    def fn(scores, targets, classes):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise error("injected")
        return F.binary_cross_entropy_with_logits(scores, targets, reduction="sum")

    def train(fail: bool):
        w = torch.nn.Parameter(w0.clone())
        opt = torch.optim.AdamW([w], lr=1e-2)
        for i, (x, t) in enumerate(batches):
            if fail and i == 1:
                calls["n"], calls["fail_at"] = 0, 3  # the third of five slices
                with pytest.raises(error, match="injected"):
                    hr.linear_loss(x, w, t, loss=fn, slice_size=100)
                calls["fail_at"] = None
                assert w.grad is None  # nothing landed: gradients form in our own buffers
            hr.linear_loss(x, w, t, loss=fn, slice_size=100).backward()
            opt.step()
            opt.zero_grad()
        return w.detach()

    assert torch.equal(train(fail=True), train(fail=False))
