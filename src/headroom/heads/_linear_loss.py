"""Exact linear + multi-label (per-class) losses over many classes, slice by slice.

``linear_loss(x, weight, (offsets, indices), loss=...)`` equals the same loss on the full logits
``x @ weight.T + bias`` against the dense multi-hot target, without either ever existing:

* separable losses (``"bce"``, ``"squared_hinge"``, a user's ``fn(scores, targets, classes)``):
  the loss and gradient of a slice of classes depend on that slice's logits only, so one pass
  does it all: ``z = x @ W_s.T``, the slice's loss, its gradient ``g`` (in place, or by autograd
  for a user's function), ``grad_x += g @ W_s`` and ``grad_W_s = g.T @ x``. Three matrix
  products, as many as the dense computation.
* multi-label softmax (``"softmax"``, ``"softmax_sum"``): the online log-sum-exp pass of
  ``linear_cross_entropy`` with several positives per row, and its recompute pass in backward.

A separable element loss is ``pw_c * t * l_pos(z) + (1 - t) * l_neg(z)`` for a target value
``t`` (1 at a positive, 0 elsewhere) and ``pos_weight`` ``pw``: exactly
``F.binary_cross_entropy_with_logits`` for ``l_pos(z) = softplus(-z)``,
``l_neg(z) = softplus(z)``. Each slice applies ``l_neg`` to all its logits in bulk, then corrects
its few positives, so a row with five positives among a million classes costs five gathers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from headroom.heads._linear_ce import (
    DEFAULT_LOGITS_BUDGET,
    _refuse_double_backward,
    grad_pass,
    log_sum_exp,
    logits,
    lse_pass,
    pick_slice_size,
)
from headroom.heads._slices import (
    GradSink,
    ParamSlices,
    SliceSource,
    landing,
    slice_bounds,
)
from headroom.heads._targets import PositiveLogits, Positives, parse_targets

__all__ = ["LOSSES", "multilabel_loss"]

LOSSES = ("bce", "squared_hinge", "softmax", "softmax_sum")
_SOFTMAX = ("softmax", "softmax_sum")

# The separable passes hold the slice's logits and a scratch of the same size (the bulk
# loss's, or a loss function's B x S targets): two buffers, so each gets half the logits budget.
_BUFFERS = 2

SliceLoss = Callable[[torch.Tensor, torch.Tensor, range | torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# the separable losses: l_neg in bulk over a slice, then the positives corrected


@dataclass(frozen=True)
class _Separable:
    """``l(z, t) = pw * t * pos(z) + (1 - t) * neg(z)`` and its derivative in ``z``."""

    pos: Callable[[torch.Tensor], torch.Tensor]
    neg: Callable[[torch.Tensor], torch.Tensor]
    dpos: Callable[[torch.Tensor], torch.Tensor]
    dneg: Callable[[torch.Tensor], torch.Tensor]
    # (z, tmp, want_grad) -> per-row sum of neg(z); with want_grad, z becomes dneg(z)
    bulk: Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]


def _softplus_threshold(dtype: torch.dtype) -> float:
    """Above this, ``softplus(z)`` is ``z`` to the dtype's rounding (``log1p(exp(-z))`` is
    below half an ulp of ``z``): torch's 20 for float32 and narrower, 40 for float64, whose
    ``softplus(25)`` is ``25 + 1.4e-11``."""
    return 40.0 if dtype == torch.float64 else 20.0


def _softplus(z: torch.Tensor) -> torch.Tensor:
    return F.softplus(z, threshold=_softplus_threshold(z.dtype))


def _bce_bulk(z: torch.Tensor, tmp: torch.Tensor, want_grad: bool) -> torch.Tensor:
    torch.ops.aten.softplus.out(z, 1, _softplus_threshold(z.dtype), out=tmp)
    rows = tmp.sum(1)
    if want_grad:
        z.sigmoid_()
    return rows


def _hinge_bulk(z: torch.Tensor, tmp: torch.Tensor, want_grad: bool) -> torch.Tensor:
    h = z.add_(1.0).clamp_min_(0.0)
    rows = torch.mul(h, h, out=tmp).sum(1)
    if want_grad:
        h.mul_(2.0)
    return rows


_LOSS_FNS = {
    "bce": _Separable(
        pos=lambda z: _softplus(-z), neg=_softplus,
        dpos=lambda z: -torch.sigmoid(-z), dneg=torch.sigmoid, bulk=_bce_bulk,
    ),
    "squared_hinge": _Separable(
        pos=lambda z: (1.0 - z).clamp_min(0.0).square(),
        neg=lambda z: (1.0 + z).clamp_min(0.0).square(),
        dpos=lambda z: -2.0 * (1.0 - z).clamp_min(0.0),
        dneg=lambda z: 2.0 * (1.0 + z).clamp_min(0.0),
        bulk=_hinge_bulk,
    ),
}


def _separable_slice(
    kind: _Separable, z: torch.Tensor, tmp: torch.Tensor, r: torch.Tensor, c: torch.Tensor,
    a: torch.Tensor, v: torch.Tensor, want_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss of one slice of logits ``z``; with ``want_grad``, ``z`` becomes dloss/dz.

    ``r, c, v, a``: the slice's positives (row, column in the slice, target value ``t``,
    ``pw * t``).
    """
    zp = z[r, c]
    rows = kind.bulk(z, tmp, want_grad)
    # The bulk counted neg(z) at the positives too; their loss is a*pos(z) + (1-t)*neg(z).
    rows.index_add_(0, r, a * kind.pos(zp) - v * kind.neg(zp))
    if want_grad:
        z[r, c] = (1.0 - v) * kind.dneg(zp) + a * kind.dpos(zp)
    return rows, z


def _foreign_leaves(loss: torch.Tensor, scores: torch.Tensor) -> int:
    """How many tensors other than ``scores`` that require grad ``loss`` depends on."""
    seen, stack, found = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None and var is not scores:
            found += 1
        stack.extend(n for n, _ in node.next_functions)
    return found


def _user_slice(
    fn: SliceLoss, z: torch.Tensor, tmp: torch.Tensor, r: torch.Tensor, c: torch.Tensor,
    v: torch.Tensor, classes: range | torch.Tensor, want_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A user's slice loss (a 0-d sum) and, with ``want_grad``, its gradient by autograd."""
    targets = tmp.zero_()
    targets[r, c] = v
    scores = z.detach().requires_grad_(want_grad)
    with torch.set_grad_enabled(want_grad):
        loss = fn(scores, targets, classes)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        got = f"shape {tuple(loss.shape)} {loss.dtype}" if isinstance(loss, torch.Tensor) else (
            type(loss).__name__)
        raise TypeError(
            "the loss function must return its slice's loss summed over the slice's elements, a "
            f"0-d floating tensor; got {got}. End it with .sum()"
        )
    if not want_grad:
        return loss.detach(), z
    if loss.grad_fn is None:
        raise RuntimeError(
            "the loss function's result does not depend on `scores` through autograd (was "
            "`scores` detached, or the loss computed without grad?), so it would train nothing; "
            "compute the loss from `scores` with differentiable torch operations"
        )
    if _foreign_leaves(loss, scores):
        # Only d(loss)/d(scores) is taken, slice by slice; a learnable tensor inside fn
        # would silently get no gradient.
        raise RuntimeError(
            "the loss function uses tensors that require grad besides `scores` (a learnable "
            "parameter, or an output of a model); headroom differentiates it only with respect "
            "to `scores`, so they would get no gradient. Pass them detached, or compute that "
            "part of the loss outside"
        )
    (g,) = torch.autograd.grad(loss, scores)
    return loss.detach(), g


# ---------------------------------------------------------------------------------------------
# what to compute, and where the weight rests


@dataclass(frozen=True)
class LossSpec:
    """One call's loss: what to compute over which positives.

    Attributes:
        loss: a name in `LOSSES` or a user's slice loss.
        pos: the positives (of the rows that count).
        num_classes: classes of the weight the slices come from.
        pos_coef: ``(nnz,)`` ``pw * t`` (separable) or the softmax weight of each positive.
        values: ``(nnz,)`` target value ``t`` of each positive.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        denominator: what ``"mean"`` divides the sum by.
        slice_size: classes per slice.
        class_ids: the class id of each weight row for a user's loss (``None``: the row index).
        one_pass: form the gradients in forward.
        accum_dtype: dtype of logits and accumulation.
        softmax_scale: ``(rows,)`` factor of the softmax term in a softmax row's gradient.
    """

    loss: str | SliceLoss
    pos: Positives
    num_classes: int
    pos_coef: torch.Tensor
    values: torch.Tensor
    reduction: str
    denominator: int
    slice_size: int
    class_ids: torch.Tensor | None
    one_pass: bool
    accum_dtype: torch.dtype
    softmax_scale: torch.Tensor | None = None


def separable_pass(
    plan: LossSpec,
    x: torch.Tensor,
    source: SliceSource,
    *,
    scale: float | torch.Tensor | None,
    need_x: bool = False,
    sink: GradSink | None = None,
    need_weight: bool = False,
    need_bias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One pass over the class slices: loss, and with ``scale``, the gradients.

    Args:
        plan: the loss (separable or a user's).
        x: ``(B, D)`` in the accumulation dtype on the compute device.
        source: the weight slices.
        scale: ``None`` (loss only), a number (the gradient of the summed loss is multiplied
            by it) or a ``(B,)`` per-row factor.
        need_x: return the gradient of ``x``.
        sink: receives weight and bias gradient slices, or ``None``.
        need_weight: form the weight gradient.
        need_bias: form the bias gradient.

    Returns:
        ``(loss, grad_x or None)``: the loss as float64, per row ``(B,)`` for a built-in loss
        and a 0-d sum for a user's.
    """
    batch, dt, dev = x.shape[0], x.dtype, x.device
    want_grad = scale is not None
    n = min(plan.slice_size, source.num_classes)
    flat = torch.empty(_BUFFERS * batch * n, dtype=dt, device=dev)
    kind = _LOSS_FNS.get(plan.loss) if isinstance(plan.loss, str) else None
    pos = plan.pos
    total: torch.Tensor | None = None
    grad_x = torch.zeros_like(x) if want_grad and need_x else None
    bounds = slice_bounds(source.num_classes, plan.slice_size)
    ranges = pos.ranges(bounds)
    alpha = scale if want_grad and not isinstance(scale, torch.Tensor) else 1.0
    # A scalar factor rides on x for the weight gradient (B x D, once) and on the products'
    # alpha for x's, instead of a multiply pass over each gradient slice.
    x_w = x * alpha if alpha != 1.0 and sink is not None else x
    with closing(source.slices(bounds)) as slices:
        for (start, stop, w, b), (lo, hi) in zip(slices, ranges, strict=True):
            size = batch * (stop - start)
            z = flat[:size].view(batch, stop - start)
            tmp = flat[batch * n: batch * n + size].view(batch, stop - start)
            logits(x, w, b, z)
            r, c, v = pos.rows[lo:hi], pos.cols[lo:hi] - start, plan.values[lo:hi]
            if kind is not None:
                part, g = _separable_slice(kind, z, tmp, r, c, plan.pos_coef[lo:hi], v,
                                           want_grad)
            else:
                classes = range(start, stop) if plan.class_ids is None else (
                    plan.class_ids[start:stop])
                part, g = _user_slice(plan.loss, z, tmp, r, c, v, classes, want_grad)
            total = part.double() if total is None else total + part.double()
            if not want_grad:
                continue
            if isinstance(scale, torch.Tensor):
                g.mul_(scale.unsqueeze(1))
            if grad_x is not None:
                grad_x.addmm_(g, w, alpha=alpha)
            if sink is not None:
                gb = gw = None
                if need_bias:
                    gb = g.sum(0)
                    if alpha != 1.0:
                        gb.mul_(alpha)
                if need_weight:
                    gw = sink.out(start, stop)
                    torch.mm(g.t(), x_w, out=gw)
                sink.commit(start, stop, gw, gb)
    assert total is not None
    return total, grad_x


def _softmax_rows(plan: LossSpec, x: torch.Tensor, source: SliceSource) -> tuple[torch.Tensor, ...]:
    """Per-row multi-label softmax loss ``sum_p w_p * (lse - z_p)``, and the lse's parts."""
    targets = PositiveLogits(plan.pos, plan.pos_coef)
    row_max, row_sum, _, _ = lse_pass(x, source, targets, slice_size=plan.slice_size,
                                   want_logit_sum=False)
    lse = log_sum_exp(row_max, row_sum)
    rows = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
    terms = plan.pos_coef.double() * (lse[plan.pos.rows] - targets.logits.double())
    return rows.index_add_(0, plan.pos.rows, terms), row_max, row_sum


def _reduce(plan: LossSpec, loss: torch.Tensor) -> torch.Tensor:
    if plan.reduction == "none":
        return loss
    total = loss.sum()
    # 0/0 = nan for no rows, as F.binary_cross_entropy_with_logits and F.cross_entropy.
    return total / plan.denominator if plan.reduction == "mean" else total


def _gradient_scale(plan: LossSpec, grad_out: torch.Tensor) -> float | torch.Tensor:
    if plan.reduction == "none":
        return grad_out.reshape(-1).to(plan.accum_dtype)
    g = float(grad_out)
    if plan.reduction == "mean":
        return g / plan.denominator if plan.denominator else 0.0
    return g


Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def loss_forward(
    x: torch.Tensor, params: ParamSlices, plan: LossSpec, needs: tuple[bool, bool, bool]
) -> tuple[torch.Tensor, Grads | None, torch.Tensor | None, torch.Tensor | None]:
    """The sliced multi-label loss of ``x`` ``(B, D)``.

    Returns:
        ``(loss, grads, row_max, row_sum)``: the reduced loss in ``x``'s dtype; with
        ``plan.one_pass`` the gradients of ``(x, weight, bias)`` for an incoming gradient of 1
        (``x``'s in the accumulation dtype), else ``None``; a softmax's log-sum-exp parts.
    """
    xa = x.to(plan.accum_dtype)
    need_x, need_w, need_b = needs
    grads = row_max = row_sum = None
    if plan.loss in _SOFTMAX:
        loss, row_max, row_sum = _softmax_rows(plan, xa, params.source(plan.slice_size))
    elif plan.one_pass:
        sink = params.sink(plan.slice_size, weight=need_w, bias=need_b) if (
            need_w or need_b) else None
        with landing(sink):
            loss, gx = separable_pass(
                plan, xa, params.source(plan.slice_size),
                scale=_gradient_scale(plan, torch.ones(())), need_x=need_x, sink=sink,
                need_weight=need_w, need_bias=need_b,
            )
        gw, gb = params.landed(sink, weight=need_w, bias=need_b) if sink else (None, None)
        grads = (gx, gw, gb)
    else:
        loss, _ = separable_pass(plan, xa, params.source(plan.slice_size), scale=None)
    return _reduce(plan, loss).to(x.dtype), grads, row_max, row_sum


def loss_backward(
    x: torch.Tensor, params: ParamSlices, plan: LossSpec,
    saved: tuple[torch.Tensor | None, torch.Tensor | None], grad_out: torch.Tensor,
    needs: tuple[bool, bool, bool],
) -> Grads:
    """The gradients of `loss_forward`'s loss (``x``'s in the accumulation dtype), by a pass
    over the slices; ``saved`` is its ``(row_max, row_sum)``."""
    need_x, need_w, need_b = needs
    row_max, row_sum = saved
    xa = x.to(plan.accum_dtype)
    scale = _gradient_scale(plan, grad_out)
    sink = params.sink(plan.slice_size, weight=need_w, bias=need_b) if (
        need_w or need_b) else None
    with landing(sink):
        if plan.loss in _SOFTMAX:
            row_scale = scale if isinstance(scale, torch.Tensor) else torch.full(
                (x.shape[0],), scale, dtype=plan.accum_dtype, device=x.device)
            assert plan.softmax_scale is not None and row_max is not None and row_sum is not None
            gx = grad_pass(
                xa, params.source(plan.slice_size), PositiveLogits(plan.pos, plan.pos_coef),
                row_max, row_sum, row_scale * plan.softmax_scale, row_scale,
                slice_size=plan.slice_size, need_x=need_x, sink=sink, need_weight=need_w,
                need_bias=need_b,
            )
        else:
            _, gx = separable_pass(
                plan, xa, params.source(plan.slice_size), scale=scale, need_x=need_x,
                sink=sink, need_weight=need_w, need_bias=need_b,
            )
    gw, gb = params.landed(sink, weight=need_w, bias=need_b) if sink else (None, None)
    return gx, gw, gb


class _LinearLoss(torch.autograd.Function):
    """`loss_forward` and `loss_backward` under autograd; gradients formed in forward (one
    pass) are scaled in backward."""

    @staticmethod
    def forward(ctx: Any, x, weight, bias, params: ParamSlices, plan: LossSpec):  # type: ignore[override]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ctx.needs = (need_x, need_w, need_b and bias is not None)
        loss, ctx.grads, row_max, row_sum = loss_forward(x, params, plan, ctx.needs)
        # NOTE: the params' own tensors are saved too, so that autograd refuses a backward
        # after an in-place change of them, as it does for x @ weight.T + bias
        ctx.save_for_backward(x, row_max, row_sum, *params.versioned)
        ctx.params, ctx.plan = params, plan
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        _refuse_double_backward(
            "linear_loss", "the same loss on dense logits x @ weight.T + bias"
        )
        x, row_max, row_sum = ctx.saved_tensors[:3]
        if ctx.grads is not None:
            gx, gw, gb = ctx.grads
            # Handed out once; a second backward through a retained graph recomputes.
            ctx.grads = None
            if not bool(grad_out == 1):
                g = float(grad_out)
                for t in (gx, gw, gb):
                    if t is not None:
                        t.mul_(g)
        else:
            gx, gw, gb = loss_backward(x, ctx.params, ctx.plan, (row_max, row_sum), grad_out,
                                       ctx.needs)
        gx = None if gx is None else gx.to(x.dtype)
        return gx, gw, gb, None, None


# ---------------------------------------------------------------------------------------------
# entry points


def _check_pos_weight(
    pos_weight: float | torch.Tensor | None, loss: str | SliceLoss, num_classes: int
) -> None:
    if pos_weight is None:
        return
    if callable(loss) or loss in _SOFTMAX:
        raise ValueError(
            "pos_weight weighs the positive term of 'bce' and 'squared_hinge'; a softmax has no "
            "such term, and a loss function applies its own weights (it gets the targets)"
        )
    if isinstance(pos_weight, (int, float)):
        return
    if not isinstance(pos_weight, torch.Tensor) or not pos_weight.is_floating_point():
        raise TypeError(f"pos_weight must be a float or a floating tensor, got {pos_weight!r}")
    if pos_weight.numel() != 1 and tuple(pos_weight.shape) != (num_classes,):
        raise ValueError(
            f"pos_weight must have one entry per class, shape ({num_classes},), or a single "
            f"one; got shape {tuple(pos_weight.shape)}"
        )
    if pos_weight.requires_grad:
        raise ValueError(
            "pos_weight requires grad, but the sliced loss does not differentiate it (it would "
            "silently get none); pass pos_weight.detach()"
        )


def make_plan(
    pos: Positives,
    *,
    loss: str | SliceLoss,
    pos_weight: float | torch.Tensor | None,
    reduction: str,
    slice_size: int | None,
    class_ids: torch.Tensor | None,
    one_pass: bool,
    accum_dtype: torch.dtype,
) -> LossSpec:
    """The plan of one call, for positives over all classes (``pos.num_classes``).

    With ``class_ids`` (sorted, holding every positive class) the weight rows are those classes
    only: the loss over a sample of the classes.
    """
    dt, dev = accum_dtype, pos.rows.device
    values = pos.value_or_one(dt)
    coef = values
    scale = None
    softmax = loss in _SOFTMAX
    if softmax:
        if bool((values < 0).any()):
            raise ValueError("targets: a softmax needs target values >= 0 (a distribution)")
        sums = pos.row_sums(dt)
        has = sums > 0
        if loss == "softmax":
            coef = values / torch.where(has, sums, torch.ones_like(sums))[pos.rows]
            scale = has.to(dt)
        else:
            scale = sums
    elif pos_weight is not None:
        pw = pos_weight if isinstance(pos_weight, (int, float)) else pos_weight.to(dev, dt)
        if isinstance(pw, torch.Tensor) and pw.numel() == pos.num_classes > 1:
            pw = pw[pos.cols]
        coef = values * pw.reshape(-1) if isinstance(pw, torch.Tensor) else values * pw
    num_classes = pos.num_classes
    if class_ids is not None:
        pos = pos.take_classes(class_ids)
        num_classes = class_ids.numel()
    rows = pos.batch
    if slice_size is None:
        budget = DEFAULT_LOGITS_BUDGET // (1 if softmax else _BUFFERS)
        slice_size = pick_slice_size(rows, num_classes, accum_dtype=dt, budget_bytes=budget)
    return LossSpec(
        loss=loss, pos=pos, num_classes=num_classes, pos_coef=coef, values=values,
        reduction=reduction,
        # What PyTorch's dense loss divides by: elements for BCE, rows for a softmax
        denominator=rows * num_classes if isinstance(loss, str) and not softmax else rows,
        slice_size=max(1, min(slice_size, num_classes)), class_ids=class_ids,
        one_pass=one_pass and reduction != "none" and not softmax,
        accum_dtype=dt, softmax_scale=scale,
    )


class MultilabelCall(NamedTuple):
    """One checked multi-label call (see `multilabel_call`).

    Attributes:
        x: ``(K, D)`` features of the rows that count.
        weight, bias: what autograd differentiates (a sample's rows in the sampled loss).
        params: where their slices are.
        plan: the loss.
        keep: indices of the rows that count, or ``None`` (all).
        lead: ``x``'s shape without its features.
    """

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    params: ParamSlices
    plan: LossSpec
    keep: torch.Tensor | None
    lead: torch.Size

    def all_rows(self, out: torch.Tensor) -> torch.Tensor:
        """The loss of all rows (0 for the rows not counted) from that of the rows kept."""
        if self.plan.reduction != "none":
            return out
        batch = math.prod(self.lead)
        if self.keep is not None:
            out = out.new_zeros(batch).index_copy(0, self.keep, out)
        return out.reshape(self.lead)


def multilabel_call(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: object,
    params: ParamSlices | None,
    *,
    num_classes: int,
    loss: str | SliceLoss,
    pos_weight: float | torch.Tensor | None,
    reduction: str,
    slice_size: int | None,
    ignore_rows: torch.Tensor | None,
    accum_dtype: torch.dtype,
    sample: Callable[[Positives], tuple[torch.Tensor, ParamSlices, torch.Tensor,
                                        torch.Tensor | None]] | None = None,
    grads: bool | None = None,
) -> MultilabelCall:
    """Validate, drop ignored rows and plan the sliced loss (shared by the entry points).

    Args:
        x: ``(..., D)`` features; ``weight``/``bias`` only tell autograd what needs a gradient
            (``params`` says where their slices are).
        sample: for a sampled (approximate) loss: given the positives, picks the classes and
            returns ``(class ids, params, weight, bias)`` for exactly those rows; ``params``
            is then ``None``.
        grads: whether gradients are wanted (``None``: from grad mode and ``requires_grad``).
    """
    if not (isinstance(loss, str) and loss in LOSSES) and not callable(loss):
        raise ValueError(
            f"loss must be one of {LOSSES} or a function fn(scores, targets, classes) returning "
            f"the slice's summed loss, got {loss!r}"
        )
    if callable(loss) and reduction == "none":
        raise ValueError(
            "reduction='none' needs per-row losses, and a loss function returns one sum per "
            "slice; use 'sum' or 'mean', or return per-row terms from a built-in loss"
        )
    _check_pos_weight(pos_weight, loss, num_classes)
    lead = x.shape[:-1]
    batch = math.prod(lead)
    x2 = x.reshape(batch, x.shape[-1])
    pos = parse_targets(targets, batch=batch, num_classes=num_classes, device=x.device)
    keep = None
    if ignore_rows is not None:
        if ignore_rows.dtype != torch.bool or ignore_rows.shape not in (lead, (batch,)):
            raise ValueError(
                f"ignore_rows must be a bool tensor of shape {tuple(lead)} (True: the row "
                f"counts for nothing), got {ignore_rows.dtype} {tuple(ignore_rows.shape)}"
            )
        drop = ignore_rows.reshape(-1).to(x.device)
        if bool(drop.any()):
            keep = torch.nonzero(~drop).flatten()
            x2 = x2[keep]
            pos = pos.take_rows(keep)
    class_ids = None
    if sample is not None:
        class_ids, params, weight, bias = sample(pos)
    assert params is not None
    if grads is None:
        grads = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, weight, bias))
    plan = make_plan(pos, loss=loss, pos_weight=pos_weight, reduction=reduction,
                     slice_size=slice_size, class_ids=class_ids,
                     one_pass=params.one_pass and grads, accum_dtype=accum_dtype)
    return MultilabelCall(x2, weight, bias, params, plan, keep, lead)


def multilabel_loss(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    targets: object, params: ParamSlices | None, **options: Any) -> torch.Tensor:
    """The sliced loss under autograd, for the keywords of `multilabel_call`."""
    c = multilabel_call(x, weight, bias, targets, params, **options)
    return c.all_rows(_LinearLoss.apply(c.x, c.weight, c.bias, c.params, c.plan))
