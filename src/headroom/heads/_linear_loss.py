"""Exact linear + multi-label (per-class) losses over many classes, slice by slice.

Separable losses (``"bce"``, ``"squared_hinge"``, a user's function) need only a slice's logits
for its loss and gradient: one pass, three products. An element's loss is
``pw * t * l_pos(z) + (1 - t) * l_neg(z)``; each slice applies ``l_neg`` in bulk, then corrects
its few positives. A multi-label softmax runs the two passes of ``_linear_ce``.
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
    commit_grads,
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

# the separable passes hold the logits and a scratch of their size: half the budget each
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
    """Above this, ``softplus(z)`` rounds to ``z``: torch's 20 for float32 and narrower, 40 for
    float64 (whose ``softplus(25)`` is ``25 + 1.4e-11``)."""
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
    ``r, c, v, a``: the positives' row, column in the slice, value ``t`` and ``pw * t``."""
    zp = z[r, c]
    rows = kind.bulk(z, tmp, want_grad)
    # the bulk counted neg(z) at the positives too
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
        raise TypeError("the loss function must return its slice's summed loss, a 0-d "
                        f"floating tensor; got {got}. End it with .sum()")
    if not want_grad:
        return loss.detach(), z
    if loss.grad_fn is None:
        raise RuntimeError(
            "the loss function's result does not depend on `scores` through autograd (detached, "
            "or computed without grad?), so it would train nothing; compute it from `scores` "
            "with differentiable torch operations")
    if _foreign_leaves(loss, scores):
        raise RuntimeError(
            "the loss function uses tensors that require grad besides `scores`; headroom "
            "differentiates it only with respect to `scores`, so they would get no gradient. "
            "Pass them detached, or compute that part of the loss outside")
    (g,) = torch.autograd.grad(loss, scores)
    return loss.detach(), g


# ---------------------------------------------------------------------------------------------
# what to compute, and where the weight rests


@dataclass(frozen=True)
class LossSpec:
    """One call's loss over the positives of the rows that count (`make_plan`).

    ``pos_coef`` is each positive's ``pw * t`` (separable) or softmax weight, ``values`` its
    ``t``; ``class_ids`` the class of each weight row (``None``: the row index);
    ``softmax_scale`` the per-row factor of a softmax row's softmax term.
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
    """One pass over the class slices: the loss (float64, per row for a built-in loss, a 0-d
    sum for a user's) and, with ``scale`` (a number or a per-row factor of the summed loss's
    gradient), the gradients: ``x``'s returned, weight and bias slices to ``sink``."""
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
    # NOTE: a scalar factor rides on x (B x D, once) and on the products' alpha, not on each
    # gradient slice
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
                commit_grads(sink, g, x_w, start, stop, weight=need_weight, bias=need_bias,
                             alpha=alpha)
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
    total = loss.sum()  # 0/0 = nan for no rows, as torch's losses
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
    """The sliced multi-label loss of ``x`` ``(B, D)`` (in its dtype); with ``plan.one_pass``
    the gradients of ``(x, weight, bias)`` for an incoming 1 (``x``'s in the accumulation
    dtype), else ``None``; and a softmax's log-sum-exp parts."""
    grads = row_max = row_sum = None
    if plan.loss in _SOFTMAX:
        loss, row_max, row_sum = _softmax_rows(plan, x.to(plan.accum_dtype),
                                               params.source(plan.slice_size))
    elif plan.one_pass:
        loss, grads = loss_backward(x, params, plan, (None, None), torch.ones(()), needs)
    else:
        loss, _ = separable_pass(plan, x.to(plan.accum_dtype), params.source(plan.slice_size),
                                 scale=None)
    return _reduce(plan, loss).to(x.dtype), grads, row_max, row_sum


def loss_backward(
    x: torch.Tensor, params: ParamSlices, plan: LossSpec,
    saved: tuple[torch.Tensor | None, torch.Tensor | None], grad_out: torch.Tensor,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, Grads]:
    """The gradients of `loss_forward`'s loss by a pass over the slices, with a separable
    loss's per-row loss (that pass forms it; else ``None``); ``saved`` is ``(row_max, row_sum)``
    of `loss_forward`."""
    need_x, need_w, need_b = needs
    row_max, row_sum = saved
    xa = x.to(plan.accum_dtype)
    scale = _gradient_scale(plan, grad_out)
    sink = params.sink(plan.slice_size, weight=need_w, bias=need_b) if (
        need_w or need_b) else None
    loss = None
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
            loss, gx = separable_pass(
                plan, xa, params.source(plan.slice_size), scale=scale, need_x=need_x,
                sink=sink, need_weight=need_w, need_bias=need_b,
            )
    gw, gb = params.landed(sink, weight=need_w, bias=need_b) if sink else (None, None)
    return loss, (gx, gw, gb)


class _LinearLoss(torch.autograd.Function):
    """`loss_forward` and `loss_backward` under autograd."""

    @staticmethod
    def forward(ctx: Any, x, weight, bias, params: ParamSlices, plan: LossSpec):  # type: ignore[override]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ctx.needs = (need_x, need_w, need_b and bias is not None)
        loss, ctx.grads, row_max, row_sum = loss_forward(x, params, plan, ctx.needs)
        # NOTE: the params' tensors are saved too: autograd refuses a backward after an
        # in-place change of them, as for x @ weight.T + bias
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
            ctx.grads = None  # handed out once; a retained graph's second backward recomputes
            if not bool(grad_out == 1):
                g = float(grad_out)
                for t in (gx, gw, gb):
                    if t is not None:
                        t.mul_(g)
        else:
            _, (gx, gw, gb) = loss_backward(x, ctx.params, ctx.plan, (row_max, row_sum),
                                            grad_out, ctx.needs)
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
            "such term, and a loss function applies its own weights: drop it")
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
        raise ValueError("pos_weight requires grad, but the sliced loss does not differentiate "
                         "it; pass pos_weight.detach()")


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
    """The plan of one call; with ``class_ids`` (sorted, holding every positive class) the
    weight rows are those classes only (a sampled loss)."""
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
    """One checked multi-label call (`multilabel_call`): the ``(K, D)`` features of the rows
    that count (``keep``, ``None``: all), what autograd differentiates (a sample's rows in the
    sampled loss), where their slices are, the loss, and ``x``'s shape without features."""

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
    """Validate, drop ignored rows and plan the sliced loss of ``x`` ``(..., D)``.

    ``weight``/``bias`` tell autograd what needs a gradient, ``params`` where their slices are.
    ``sample`` (a sampled loss; ``params`` then ``None``) picks the classes from the positives
    and returns ``(class ids, params, weight, bias)`` of those rows. ``grads``: whether
    gradients are wanted (``None``: from grad mode and ``requires_grad``).
    """
    if not (isinstance(loss, str) and loss in LOSSES) and not callable(loss):
        raise ValueError(
            f"loss must be one of {LOSSES} or a function fn(scores, targets, classes) returning "
            f"the slice's summed loss, got {loss!r}")
    if callable(loss) and reduction == "none":
        raise ValueError(
            "reduction='none' needs per-row losses, and a loss function returns one sum per "
            "slice; use 'sum' or 'mean', or a built-in loss")
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
