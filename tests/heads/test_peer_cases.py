"""Correctness cases of Cut Cross-Entropy's and Liger's fused linear cross-entropy test suites,
run against hr.linear_cross_entropy.

Their cases (shapes, option grids, input distributions, tolerances), our code. CCE's criterion:
our error against an fp32 computation on upcast inputs is at most PyTorch's own error in the
input dtype plus the case's tolerance, element by element. Liger's: allclose against a dense
PyTorch module, with its atol/rtol per dtype and reduction. CCE's grids run whole, each
parametrized test looping over its options. By default the slow parts are sampled (the whole
suite must stay fast on two cores): CCE's backward grid runs every 8th case of each (dtype,
shape) (a different eighth per shape, 54 of 432), Liger's large shape is skipped. Set
``HEADROOM_PEER_GRID=full`` to run every case (several minutes on a CPU).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.nn.functional as F

import headroom as hr

IGNORE = -100
FULL = os.environ.get("HEADROOM_PEER_GRID") == "full"
large = pytest.mark.skipif(not FULL, reason="Liger's large shape: HEADROOM_PEER_GRID=full")
CCE_SHAPES = [(256, 512, 128), (252, 507, 128), (252, 507, 123)]  # (N, V, D)
CCE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _cap(z, softcap):
    return z if softcap is None else torch.tanh(z / softcap) * softcap


def _cce_inputs(shape, dtype, *, invalids, bias_scale):
    n, v, d = shape
    e = torch.randn(n, d, dtype=dtype) / d**0.5
    c = torch.randn(v, d, dtype=dtype)
    c[: min(n, v) // 2] = e[: min(n, v) // 2]  # some rows score high: large logits
    bias = torch.randn(v, dtype=dtype) * bias_scale
    targets = torch.randint(0, v, (n,))
    if invalids:
        targets[torch.randperm(n)[: int(0.2 * n)]] = IGNORE
    return e.view(4, -1, d), c, bias, targets.view(4, -1)


def _cce_dense(e, c, targets, bias, softcap, shift, reduction="none"):
    if shift:
        e, targets = e[:, :-shift], targets[:, shift:]
    z = e.flatten(0, -2) @ c.T
    if bias is not None:
        z = z + bias
    z = _cap(z, softcap)
    loss = F.cross_entropy(z.float(), targets.flatten(), ignore_index=IGNORE,
                           reduction=reduction)
    return loss, torch.logsumexp(z.float(), -1), targets


def _within(ours, gt, ref, tol, what):
    err, allowed = (gt - ours).abs(), (gt - ref).abs() + tol
    assert (err <= allowed).all(), f"{what}: excess {(err - allowed).max().item():.3g}"


@pytest.mark.parametrize("shape", CCE_SHAPES)
@pytest.mark.parametrize("dtype, tol", [("fp32", 1e-5), ("fp16", 1e-3), ("bf16", 1e-2)])
def test_cce_forward(shape, dtype, tol):
    """CCE's forward grid: softcap x bias x shift 0/2 x ignored labels (16 cases each)."""
    dt = CCE_DTYPES[dtype]
    for softcap, has_bias, shift, invalids in itertools.product(
            [None, 20.0], [True, False], [0, 2], [False, True]):
        e, c, bias, targets = _cce_inputs(shape, dt, invalids=invalids, bias_scale=0.01)
        b = bias if has_bias else None
        gt, _, _ = _cce_dense(e.float(), c.float(), targets, None if b is None else b.float(),
                              softcap, shift)
        ref, _, _ = _cce_dense(e, c, targets, b, softcap, shift)
        ours = hr.linear_cross_entropy(e, c, targets, b, softcap=softcap, shift=shift,
                                       reduction="none")
        assert ours.shape == (4, shape[0] // 4 - shift) and ours.dtype == torch.float32
        _within(ours.flatten(), gt, ref, tol,
                f"{dtype} softcap={softcap} bias={has_bias} shift={shift} invalids={invalids}")


@pytest.mark.parametrize("shape", CCE_SHAPES)
@pytest.mark.parametrize("dtype, tol", [("fp32", 5e-4), ("fp16", 1e-3), ("bf16", 1e-2)])
def test_cce_backward(shape, dtype, tol):
    """CCE's backward grid: softcap x bias x shift x ignored labels x reduction x z-loss through
    the returned lse (48 cases each)."""
    dt = CCE_DTYPES[dtype]
    grid = list(itertools.product([None, 20.0], [False, True], [False, True], [False, True],
                                  ["none", "mean", "sum"], [True, False]))
    if not FULL:
        grid = grid[CCE_SHAPES.index(shape) * 3 + list(CCE_DTYPES).index(dtype)::8]
    for softcap, has_bias, shift, invalids, reduction, z_loss in grid:
        e, c, bias, targets = _cce_inputs(shape, dt, invalids=invalids, bias_scale=0.02)
        b = bias if has_bias else None
        leaves = [e, c] + ([b] if b is not None else [])

        def grads(loss_and_lse, tensors, reduction=reduction, z_loss=z_loss):
            loss, lse, shifted = loss_and_lse
            if reduction == "sum":
                loss = loss / (shifted != IGNORE).count_nonzero()
            loss = loss.mean()
            if z_loss:
                valid = shifted.flatten() != IGNORE
                loss = loss + (lse.flatten()[valid] ** 2).mean()
            return torch.autograd.grad(loss, tensors)

        up = [t.float().requires_grad_() for t in leaves]
        gt = grads(_cce_dense(up[0], up[1], targets, up[2] if b is not None else None,
                              softcap, int(shift), reduction), up)
        low = [t.clone().requires_grad_() for t in leaves]
        ref = grads(_cce_dense(low[0], low[1], targets, low[2] if b is not None else None,
                               softcap, int(shift), reduction), low)
        mine = [t.clone().requires_grad_() for t in leaves]
        out = hr.linear_cross_entropy(mine[0], mine[1], targets,
                                      mine[2] if b is not None else None, softcap=softcap,
                                      shift=shift, reduction=reduction, return_lse=True)
        shifted = targets[:, int(shift):]
        ours = grads((out.loss, out.lse, shifted), mine)
        for name, o, g, r in zip("ecb", ours, gt, ref, strict=False):
            _within(o.float(), g, r.float(), tol,
                    f"{dtype} grad {name} softcap={softcap} bias={has_bias} shift={shift} "
                    f"invalids={invalids} {reduction} z_loss={z_loss}")


@pytest.mark.parametrize("shape", [(256, 512, 128), (255, 507, 128), (255, 507, 123)])
def test_cce_lse(shape):
    """CCE's log-sum-exp cases: dtype x softcap x bias (12 cases each)."""
    for dtype, softcap, has_bias in itertools.product(CCE_DTYPES.values(), [None, 20.0],
                                                       [True, False]):
        n, v, d = shape
        e = torch.randn(n, d, dtype=dtype) / d**0.5
        c = torch.randn(v, d, dtype=dtype)
        c[: min(n, v) // 2] = e[: min(n, v) // 2]
        b = torch.randn(v, dtype=dtype) * 0.02 if has_bias else None

        def lse(e, c, b, softcap=softcap):
            z = e @ c.T + (b if b is not None else 0)
            return torch.logsumexp(_cap(z, softcap).float(), -1)

        gt = lse(e.float(), c.float(), None if b is None else b.float())
        ref = lse(e, c, b)
        ours = hr.linear_cross_entropy(e, c, torch.zeros(n, dtype=torch.long), b,
                                       softcap=softcap, return_lse=True).lse
        _within(ours, gt, ref, 1e-5, f"{dtype} softcap={softcap} bias={has_bias}")


def test_cce_partial_gradients():
    """CCE's partials: only the inputs that require grad get one."""
    for de, dc, db in [(True, False, True), (False, True, False), (False, False, True)]:
        e = torch.randn(4, 64, 128, dtype=torch.bfloat16).requires_grad_(de)
        c = torch.randn(512, 128, dtype=torch.bfloat16).requires_grad_(dc)
        b = (torch.randn(512, dtype=torch.bfloat16) * 0.01).requires_grad_(db)
        hr.linear_cross_entropy(e, c, torch.randint(0, 512, (4, 64)), b).backward()
        assert (e.grad is not None, c.grad is not None, b.grad is not None) == (de, dc, db)


# ---------------------------------------------------------------------------------------------
# Liger's fused linear cross-entropy cases

LIGER_TOLERANCES = [  # reduction, dtype, atol, rtol
    ("mean", torch.bfloat16, 5e-3, 5e-2),
    ("mean", torch.float32, 1e-5, 5e-4),
    ("sum", torch.bfloat16, 5e-0, 5e1),
    ("sum", torch.float32, 1e-3, 5e-2),
]
LIGER_OPTIONS = [  # class weight, smoothing, ignore_index, z-loss, softcap
    (False, 0.0, -100, 0.0, None),
    (True, 0.1, 42, 1e-4, 30.0),
]


def _liger_dense(x, w, b, y, *, ce_weight, smoothing, ignore_index, z, softcap, reduction):
    """Liger's reference: a dense linear, fp32 logits, soft cap, CE plus z-loss."""
    z_logits = F.linear(x, w, b).float()
    if softcap is not None:
        z_logits = softcap * torch.tanh(z_logits / softcap)
    ce = F.cross_entropy(z_logits, y, weight=ce_weight, reduction=reduction,
                         label_smoothing=smoothing, ignore_index=ignore_index)
    lse = torch.logsumexp(z_logits, -1)
    zl = torch.where(y != ignore_index, z * lse**2, 0.0)
    zl = zl.sum() / (y != ignore_index).sum() if reduction == "mean" else zl.sum()
    return ce + zl, zl


def _liger_case(bt, h, v, reduction, dtype, atol, rtol, bias, opts, *, forward_only=False):
    has_w, smoothing, ii, z, softcap = opts
    ce_weight = torch.rand(v) if has_w else None
    w = torch.rand(v, h, dtype=dtype)
    b = torch.rand(v, dtype=dtype) if bias else None
    x = torch.randn(bt, h, dtype=dtype)
    y = torch.randint(0, v, (bt,))
    y[torch.randperm(bt)[: torch.randint(1, bt // 2, (1,)).item()]] = ii
    kw = dict(smoothing=smoothing, ignore_index=ii, z=z, softcap=softcap, reduction=reduction)
    leaves = [w] + ([b] if bias else [])
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    p1 = [t.clone().requires_grad_() for t in leaves]
    p2 = [t.clone().requires_grad_() for t in leaves]
    with torch.set_grad_enabled(not forward_only):
        ref, ref_z = _liger_dense(x1, p1[0], p1[1] if bias else None, y, ce_weight=ce_weight,
                                  **kw)
        out = hr.linear_cross_entropy(
            x2, p2[0], y, p2[1] if bias else None, class_weight=ce_weight,
            label_smoothing=smoothing, ignore_index=ii, z_loss=z, softcap=softcap,
            reduction=reduction, return_lse=True)
    torch.testing.assert_close(out.loss, ref.float(), atol=atol, rtol=rtol)
    if z:  # Liger returns the z-loss part: ours from the returned lse
        valid = y != ii
        ours_z = z * (out.lse[valid] ** 2).sum()
        ours_z = ours_z / valid.sum() if reduction == "mean" else ours_z
        torch.testing.assert_close(ours_z, ref_z.float(), atol=atol, rtol=rtol)
    if forward_only:
        assert not out.loss.requires_grad
        return
    g1 = torch.autograd.grad(ref, [x1, *p1])
    g2 = torch.autograd.grad(out.loss, [x2, *p2])
    for a, r in zip(g2, g1, strict=True):
        torch.testing.assert_close(a, r, atol=atol, rtol=rtol)


@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("reduction, dtype, atol, rtol", LIGER_TOLERANCES)
def test_liger_correctness(reduction, dtype, atol, rtol, forward_only):
    """Liger's test_correctness / _with_forward_only: bias x option set (4 cases each)."""
    for bias, opts in itertools.product([True, False], LIGER_OPTIONS):
        _liger_case(4 * 47, 31, 123, reduction, dtype, atol, rtol, bias, opts,
                    forward_only=forward_only)


@large
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.bfloat16, 5e-3, 5e-2),
                                               (torch.float32, 1e-5, 5e-4)])
def test_liger_correctness_large_shape(dtype, atol, rtol):
    """Liger's (B, T, H, V) = (8, 128, 1024, 4096) with every option, mean reduction."""
    _liger_case(8 * 128, 1024, 4096, "mean", dtype, atol, rtol, True, LIGER_OPTIONS[1])


@pytest.mark.parametrize("shape", [(2, 2, 8, 8), (9, 7, 41, 41)])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.bfloat16, 5e-3, 5e-2),
                                               (torch.float32, 1e-5, 5e-4)])
def test_liger_functional(shape, dtype, atol, rtol):
    """Liger's functional cases: signed class weights x bias, every option (4 cases each)."""
    bsz, t, h, v = shape
    for has_w, bias in itertools.product([True, False], [True, False]):
        x = torch.randn(bsz * t, h, dtype=dtype)
        y = torch.randint(0, v, (bsz * t,))
        w = torch.randn(v, h, dtype=dtype)
        b = torch.randn(v, dtype=dtype) if bias else None
        cw = torch.randn(v) if has_w else None
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref, _ = _liger_dense(x1, w, b, y, ce_weight=cw, smoothing=0.1, ignore_index=-100,
                              z=1e-4, softcap=30.0, reduction="mean")
        out = hr.linear_cross_entropy(x2, w, y, b, class_weight=cw, label_smoothing=0.1,
                                      z_loss=1e-4, softcap=30.0)
        torch.testing.assert_close(out, ref.float(), atol=atol, rtol=rtol)
        g = torch.randn_like(out)
        torch.testing.assert_close(torch.autograd.grad(out, x2, g)[0].float(),
                                   torch.autograd.grad(ref, x1, g)[0].float(),
                                   atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", [pytest.param((8, 128, 1024, 4096), marks=large),
                                   (4, 47, 31, 123)])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.bfloat16, 5e-3, 5e-2),
                                               (torch.float32, 1e-5, 5e-4)])
def test_liger_token_accuracy(shape, dtype, atol, rtol):
    """Liger's token-accuracy cases: bias x flag (4 cases each); the loss is the same either
    way."""
    bsz, t, h, v = shape
    for bias, flag in itertools.product([True, False], [True, False]):
        w = torch.rand(v, h, dtype=dtype)
        b = torch.rand(v, dtype=dtype) if bias else None
        x = torch.randn(bsz * t, h, dtype=dtype)
        y = torch.randint(0, v, (bsz * t,))
        y[torch.randperm(bsz * t)[: torch.randint(1, bsz * t // 2, (1,)).item()]] = -100
        ref = F.cross_entropy(F.linear(x, w, b).float(), y)
        out = hr.linear_cross_entropy(x, w, y, b, return_accuracy=flag)
        if flag:
            logits = F.linear(x.float(), w.float(), None if b is None else b.float())
            mask = y != -100
            expect = ((logits.argmax(-1) == y) & mask).sum().float() / mask.sum()
            torch.testing.assert_close(out.accuracy, expect, atol=atol, rtol=rtol)
            out = out.loss
        else:
            assert isinstance(out, torch.Tensor)
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16])
def test_liger_amp(cast):
    """Liger's autocast cases (bias x shape): under torch.autocast the loss computes in fp32
    from the fp32 inputs and stays within Liger's tolerance of the autocast dense module."""
    shapes = [(8, 128, 1024, 4096), (4, 47, 31, 123)] if FULL else [(4, 47, 31, 123)]
    for (bsz, t, h, v), bias in itertools.product(shapes, [True, False]):
        w = torch.rand(v, h)
        b = torch.rand(v) if bias else None
        x = torch.randn(bsz * t, h)
        y = torch.randint(0, v, (bsz * t,))
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=cast):
            ref = F.cross_entropy(F.linear(x1, w, b).float(), y)
            out = hr.linear_cross_entropy(x2, w, y, b)
        assert out.dtype == torch.float32
        assert torch.equal(out, hr.linear_cross_entropy(x, w, y, b))  # autocast changes nothing
        torch.testing.assert_close(out, ref, atol=5e-3, rtol=5e-2)
        torch.testing.assert_close(torch.autograd.grad(out, x2)[0],
                                   torch.autograd.grad(ref, x1)[0], atol=5e-3, rtol=5e-2)
