"""float64 inputs compute in float64: loss and gradients at float64 rounding.

Every entry point of ``heads/`` (`linear_cross_entropy` with its options, `linear_loss` with
each loss, `HugeClassifier` in host memory and on a `DiskStore`) against the same loss on dense
float64 logits with PyTorch's ops. The sums run in another order than the dense ones, so the
comparison is to rounding: ``rtol=1e-12`` (float64's epsilon is 2.2e-16; float32's, 1.2e-7, is
what a float32 computation of the same loss misses by).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import headroom as hr
from headroom.store import DiskStore
from tests.heads.test_linear_loss import dense_loss, dense_target, random_targets

F64 = torch.float64
B, S, D, C = 6, 5, 16, 300


def _close(a, b, what=""):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=lambda m: f"{what}: {m}")


def _ce_ref(x, w, b, y, *, shift=0, softcap=None, z_loss=0.0, label_smoothing=0.0,
            reduction="mean", ignore_index=-100, class_weight=None):
    """The dense float64 loss, written with PyTorch's ops as a user would."""
    if shift:
        x, y = x[..., :-shift, :], y[..., shift:]
    z = x @ w.T + (0 if b is None else b)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z2, y2 = z.reshape(-1, z.shape[-1]), y.reshape(-1)
    loss = F.cross_entropy(z2, y2, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction=reduction, weight=class_weight)
    if z_loss:
        valid = y2 != ignore_index
        zl = z_loss * torch.logsumexp(z2, 1) ** 2 * valid
        if reduction == "mean":
            loss = loss + zl.sum() / valid.sum()
        elif reduction == "sum":
            loss = loss + zl.sum()
        else:
            loss = loss + zl
    return loss.reshape(y.shape) if reduction == "none" else loss


CE_CASES = {
    "mean": {},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none"},
    "ignore_index": {"ignored": True},
    "label_smoothing": {"label_smoothing": 0.1},
    "softcap": {"softcap": 2.0},
    "z_loss": {"z_loss": 1e-2},
    "shift": {"shift": 1},
    "class_weight": {"class_weight": True},
    "everything": {"shift": 1, "softcap": 3.0, "z_loss": 1e-3, "label_smoothing": 0.05,
                   "ignored": True, "class_weight": True},
}


def _ce_inputs(case, *, bias=True):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, S, D, dtype=F64, generator=g)
    w = torch.randn(C, D, dtype=F64, generator=g) * 0.7
    b = torch.randn(C, dtype=F64, generator=g) if bias else None
    y = torch.randint(0, C, (B, S), generator=g)
    kw = dict(case)
    if kw.pop("ignored", False):
        y[0, :3] = -100
        y[4, 1] = -100
    if kw.pop("class_weight", False):
        kw["class_weight"] = torch.rand(C, dtype=F64, generator=g) + 0.5
    return x, w, b, y, kw


@pytest.mark.parametrize("slice_size", [None, 64])  # None: the one-pass path where it applies
@pytest.mark.parametrize("case", list(CE_CASES))
def test_linear_cross_entropy_fp64(case, slice_size):
    x, w, b, y, kw = _ce_inputs(CE_CASES[case])
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    refs = [t.clone().requires_grad_() for t in (x, w, b)]
    out = hr.linear_cross_entropy(leaves[0], leaves[1], y, leaves[2], slice_size=slice_size,
                                  **kw)
    ref = _ce_ref(*refs, y, **kw)
    assert out.dtype == F64
    _close(out, ref, "loss")
    grad = torch.randn_like(ref) if ref.dim() else torch.tensor(1.3, dtype=F64)
    got = torch.autograd.grad(out, leaves, grad)
    want = torch.autograd.grad(ref, refs, grad)
    for name, a, e in zip("xwb", got, want, strict=True):
        _close(a, e, f"gradient of {name}")


def test_linear_cross_entropy_fp64_lse():
    x, w, b, y, _ = _ce_inputs({})
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    refs = [t.clone().requires_grad_() for t in (x, w, b)]
    out = hr.linear_cross_entropy(*leaves[:2], y, leaves[2], return_lse=True, z_loss=1e-2)
    z = refs[0] @ refs[1].T + refs[2]
    lse = torch.logsumexp(z, -1)
    ref = _ce_ref(*refs, y, z_loss=1e-2)
    _close(out.lse, lse, "lse")
    gl, glse = torch.tensor(0.7, dtype=F64), torch.randn_like(lse)
    got = torch.autograd.grad((out.loss, out.lse), leaves, (gl, glse))
    want = torch.autograd.grad((ref, lse), refs, (gl, glse))
    for name, a, e in zip("xwb", got, want, strict=True):
        _close(a, e, f"gradient of {name}")


def _ml_ref(x, w, b, targets, loss, *, reduction, pos_weight=None):
    z = x @ w.T + (0 if b is None else b)
    t = dense_target(targets, x.shape[0], w.shape[0], F64)
    return dense_loss(z, t, loss, pos_weight=pos_weight, reduction=reduction)


def _user_bce(scores, targets, classes):
    return F.binary_cross_entropy_with_logits(scores, targets, reduction="sum")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("loss", ["bce", "squared_hinge", "softmax", "softmax_sum", "fn"])
def test_linear_loss_fp64(loss, reduction):
    if loss == "fn" and reduction == "none":
        pytest.skip("a loss function returns one sum per slice")
    g = torch.Generator().manual_seed(4)
    batch = 10
    x = torch.randn(batch, D, dtype=F64, generator=g)
    w = torch.randn(C, D, dtype=F64, generator=g) * 2.0  # logits beyond softplus' threshold
    b = torch.randn(C, dtype=F64, generator=g)
    targets = random_targets(batch, C, gen=g, values=loss != "fn")
    if loss in ("softmax", "softmax_sum"):  # every row with a positive (0 / 0 elsewhere)
        targets = random_targets(batch, C, gen=g, max_pos=1)
        targets = (torch.arange(batch + 1), torch.randint(0, C, (batch,), generator=g))
    pw = 1.7 if loss in ("bce", "squared_hinge") else None
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    refs = [t.clone().requires_grad_() for t in (x, w, b)]
    out = hr.linear_loss(leaves[0], leaves[1], targets, bias=leaves[2],
                         loss=_user_bce if loss == "fn" else loss, pos_weight=pw,
                         reduction=reduction, slice_size=64)
    ref = _ml_ref(*refs, targets, "bce" if loss == "fn" else loss, reduction=reduction,
                  pos_weight=None if pw is None else torch.tensor(pw, dtype=F64))
    if loss == "fn" and reduction == "mean":
        ref = ref * C  # a function's "mean" divides by rows, not elements
    assert out.dtype == F64
    _close(out, ref, "loss")
    grad = torch.randn_like(ref) if ref.dim() else torch.tensor(0.9, dtype=F64)
    got = torch.autograd.grad(out, leaves, grad)
    want = torch.autograd.grad(ref, refs, grad)
    for name, a, e in zip("xwb", got, want, strict=True):
        _close(a, e, f"gradient of {name}")


def _head(kind, tmp_path, *, bias=True, dtype=F64):
    store = "cpu" if kind == "cpu" else DiskStore(tmp_path / "store")
    return hr.HugeClassifier(C, D, bias=bias, device="cpu", store=store, dtype=dtype,
                             slice_size=64)


def _head_grads(head):
    b = hr.transfer.binding
    out = [head.store.read(b(head.weight).grad_handle).result()]
    if head.bias is not None:
        out.append(head.store.read(b(head.bias).grad_handle).result())
    return out


@pytest.mark.filterwarnings("ignore:HugeClassifier\\(device='cpu', store='cpu'\\)")
@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("case", ["mean", "none", "label_smoothing", "softcap", "z_loss",
                                  "shift", "everything"])
def test_huge_classifier_fp64(case, kind, tmp_path):
    head = _head(kind, tmp_path)
    x, _, _, y, kw = _ce_inputs(CE_CASES[case])
    w, b = head.read_weight(), head.read_bias()
    xs = x.clone().requires_grad_()
    refs = [x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
    out = head(xs, y, **kw)
    ref = _ce_ref(*refs, y, **kw)
    assert out.dtype == F64
    _close(out, ref, "loss")
    grad = torch.randn_like(ref) if ref.dim() else torch.tensor(1.3, dtype=F64)
    out.backward(grad)
    want = torch.autograd.grad(ref, refs, grad)
    _close(xs.grad, want[0], "gradient of x")
    for name, a, e in zip("wb", _head_grads(head), want[1:], strict=True):
        _close(a, e, f"gradient of {name}")


@pytest.mark.filterwarnings("ignore:HugeClassifier\\(device='cpu', store='cpu'\\)")
@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("loss", ["bce", "softmax"])
def test_huge_classifier_multilabel_fp64(loss, kind, tmp_path):
    head = _head(kind, tmp_path)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(10, D, dtype=F64, generator=g)
    targets = (torch.arange(11), torch.randint(0, C, (10,), generator=g))
    w, b = head.read_weight(), head.read_bias()
    xs = x.clone().requires_grad_()
    refs = [x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
    out = head(xs, targets, loss=loss)
    ref = _ml_ref(*refs, targets, loss, reduction="mean")
    _close(out, ref, "loss")
    out.backward()
    want = torch.autograd.grad(ref, refs)
    _close(xs.grad, want[0], "gradient of x")
    for name, a, e in zip("wb", _head_grads(head), want[1:], strict=True):
        _close(a, e, f"gradient of {name}")


@pytest.mark.filterwarnings("ignore:HugeClassifier\\(device='cpu', store='cpu'\\)")
def test_huge_classifier_fp64_topk():
    head = _head("cpu", None)
    x = torch.randn(7, D, dtype=F64)
    v, i = head.topk(x, 5)
    rv, ri = torch.topk(x @ head.read_weight().T + head.read_bias(), 5)
    assert v.dtype == F64 and torch.equal(i, ri)
    _close(v, rv, "top logits")


def test_half_precision_still_accumulates_in_fp32():
    """bf16 inputs: the passes run in fp32 (the loss and lse fp32, gradients bf16), as before."""
    x, w, b, y, _ = _ce_inputs({})
    xb, wb, bb = (t.to(torch.bfloat16).requires_grad_() for t in (x, w, b))
    out = hr.linear_cross_entropy(xb, wb, y, bb, slice_size=64, return_lse=True)
    assert out.loss.dtype == torch.float32 and out.lse.dtype == torch.float32
    ref = F.cross_entropy((xb.float() @ wb.float().T + bb.float()).reshape(-1, C), y.reshape(-1))
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    assert xb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("slice_size", [None, 64])
def test_compiled_fp64(slice_size):
    """Under torch.compile(fullgraph=True) the operators compute in float64 too."""
    x, w, b, y, kw = _ce_inputs(CE_CASES["everything"])
    torch._dynamo.reset()
    fn = torch.compile(hr.linear_cross_entropy, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    refs = [t.clone().requires_grad_() for t in (x, w, b)]
    out = fn(leaves[0], leaves[1], y, leaves[2], slice_size=slice_size, **kw)
    ref = _ce_ref(*refs, y, **kw)
    _close(out, ref, "loss")
    for name, a, e in zip("xwb", torch.autograd.grad(out, leaves),
                          torch.autograd.grad(ref, refs), strict=True):
        _close(a, e, f"gradient of {name}")
    g = torch.Generator().manual_seed(6)
    x2 = torch.randn(10, D, dtype=F64, generator=g, requires_grad=True)
    targets = random_targets(10, C, gen=g, values=True)
    ml = torch.compile(hr.linear_loss, fullgraph=True, backend="aot_eager")
    got = ml(x2, leaves[1], targets, bias=leaves[2], slice_size=slice_size)
    want = _ml_ref(x2, refs[1], refs[2], targets, "bce", reduction="mean")
    _close(got, want, "multi-label loss")
