"""Exact linear + cross-entropy over many classes, slice by slice over the classes.

Forward keeps an online log-sum-exp per row; backward recomputes each slice's logits and turns
them into the gradient in place, in one reused ``batch x slice`` buffer. Chunks of rows over all
classes (`row_pass`) form loss and gradients in one pass where they fit the logits budget.
"""

from __future__ import annotations

import math
from contextlib import closing
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol

import torch

from headroom.heads._slices import (
    GradSink,
    ParamSlices,
    SliceSource,
    TensorParams,
    landing,
    slice_bounds,
)

__all__ = ["DEFAULT_LOGITS_BUDGET", "LinearCrossEntropyOutput", "compute_dtype", "pick_slice_size"]

# NOTE: slices of a few thousand classes keep the reused buffer in the last-level cache for the
# elementwise passes; larger slices do not make the matrix products faster.
DEFAULT_LOGITS_BUDGET = 256 * 2**20
_CACHE_FRIENDLY_SLICE = 8192

_REDUCTIONS = ("mean", "sum", "none")


def compute_dtype(*dtypes: torch.dtype, accum_dtype: torch.dtype | None = None) -> torch.dtype:
    """``accum_dtype`` when given, else the widest of float32 and ``dtypes`` (the inputs')."""
    if accum_dtype is not None:
        return accum_dtype
    out = torch.float32
    for dt in dtypes:
        if dt.is_floating_point:
            out = torch.promote_types(out, dt)
    return out


def pick_slice_size(
    batch: int, num_classes: int, *, accum_dtype: torch.dtype = torch.float32,
    budget_bytes: int = DEFAULT_LOGITS_BUDGET,
) -> int:
    """Classes per slice so that one ``batch x slice`` logits buffer fits ``budget_bytes``.

    Args:
        batch: rows of ``x`` (after flattening leading dimensions).
        num_classes: number of classes.
        accum_dtype: dtype of the logits buffer.
        budget_bytes: bytes the logits buffer may take.

    Returns:
        A slice size between 1 and ``num_classes`` (at most a cache-friendly few thousand).

    Example:
        >>> pick_slice_size(4096, 262144)
        8192
    """
    elem = torch.empty((), dtype=accum_dtype).element_size()
    fit = budget_bytes // max(1, batch * elem)
    return int(max(1, min(num_classes, fit, _CACHE_FRIENDLY_SLICE)))


# ---------------------------------------------------------------------------------------------
# validation (before any compute)


def _check_target(
    target: torch.Tensor, num_classes: int, ignore_index: int
) -> None:
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(
            f"target must hold class indices as an integer tensor, got dtype {target.dtype}; "
            "convert with target.long() (class probabilities are not supported)"
        )
    if target.numel() == 0:
        return
    bad = ((target < 0) | (target >= num_classes)) & (target != ignore_index)
    # one host sync: an out-of-range label would silently read another row
    if bool(bad.any()):
        first = target[bad].flatten()[0].item()
        count = int(bad.sum())
        raise ValueError(
            f"target has {count} label(s) outside [0, {num_classes}) (first: {first}) that are "
            f"not ignore_index={ignore_index}; fix the labels or num_classes"
        )


def check_slicing(
    *, reduction: str, slice_size: int | None, prefetch: int, accum_dtype: torch.dtype
) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if slice_size is not None and (not isinstance(slice_size, int) or slice_size < 1):
        raise ValueError(f"slice_size must be a positive int or None, got {slice_size!r}")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    if not accum_dtype.is_floating_point:
        raise TypeError(f"accum_dtype must be a floating dtype, got {accum_dtype}")


def check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Shapes, dtypes and devices of ``x @ weight.T + bias``."""
    if weight.dim() != 2:
        raise ValueError(
            f"weight must be 2-D (num_classes, in_features), got shape {tuple(weight.shape)}"
        )
    if weight.shape[0] < 1:
        raise ValueError("weight has no classes (num_classes == 0)")
    if x.dim() < 1:
        raise ValueError("x must have a last dimension of features, got a 0-d tensor")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x has {x.shape[-1]} features but weight has {weight.shape[1]} "
            f"(weight shape {tuple(weight.shape)} is (num_classes, in_features)); "
            "pass weight, not weight.T, and check in_features"
        )
    if not x.dtype.is_floating_point or x.dtype != weight.dtype:
        raise TypeError(
            f"x and weight must share one floating dtype, got {x.dtype} and {weight.dtype}; "
            "cast one of them"
        )
    if bias is not None:
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}"
            )
        if bias.device != weight.device or bias.dtype != weight.dtype:
            raise ValueError("bias must have the same device and dtype as weight")
    if weight.device != x.device and not (weight.device.type == "cpu"):
        raise ValueError(
            f"weight is on {weight.device} but x is on {x.device}; weight must be on x's device "
            "or in host memory (then it is streamed slice by slice)"
        )


def check_label_shape(
    labels: torch.Tensor, x: torch.Tensor, *, names: tuple[str, str]
) -> None:
    """One label per row of ``x`` (its shape without the last dimension), on ``x``'s device."""
    if tuple(labels.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"{names[0]} shape {tuple(labels.shape)} must equal {names[1]}'s shape without its "
            f"last dimension, {tuple(x.shape[:-1])}"
        )
    if labels.device != x.device:
        raise ValueError(
            f"{names[0]} is on {labels.device} but {names[1]} is on {x.device}; move it")


# ---------------------------------------------------------------------------------------------
# the two passes (shared with HugeClassifier, which brings its own slice source and sink)


class LabelTargets(Protocol):
    """Where each row's target logits are, for the two passes of a softmax loss."""

    def prepare(self, bounds: list[tuple[int, int]], dtype: torch.dtype) -> None:
        """Called once per pass with the slices it will visit and the logits' dtype."""
        ...

    def gather(self, i: int, z: torch.Tensor, start: int, stop: int) -> None:
        """Record the target logits that lie in slice ``i`` (logits ``z`` of ``start:stop``)."""
        ...

    def subtract(
        self, i: int, g: torch.Tensor, start: int, stop: int, coef: torch.Tensor
    ) -> None:
        """``g[b, c] -= coef[b] * target[b, c]`` for the targets in slice ``i``."""
        ...


class OneHot:
    """One target class per row, ``target`` ``(B,)`` int64 (rows whose scale is 0: anything)."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target
        self.logits = torch.zeros(0)

    def _local(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's target column in ``start:stop`` (clamped), and whether it lies there."""
        inside = (self.target >= start) & (self.target < stop)
        local = (self.target - start).clamp_(0, stop - start - 1)
        return local.unsqueeze(1), inside

    def prepare(self, bounds: list[tuple[int, int]], dtype: torch.dtype) -> None:
        self.logits = torch.zeros(self.target.shape[0], dtype=dtype, device=self.target.device)

    def gather(self, i: int, z: torch.Tensor, start: int, stop: int) -> None:
        local, inside = self._local(start, stop)
        self.logits = torch.where(inside, z.gather(1, local).squeeze(1), self.logits)

    def subtract(
        self, i: int, g: torch.Tensor, start: int, stop: int, coef: torch.Tensor
    ) -> None:
        local, inside = self._local(start, stop)
        g.scatter_add_(1, local, -(coef * inside).unsqueeze(1))


def logits(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
           out: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, w.t(), out=out) if b is None else torch.addmm(b, x, w.t(), out=out)


def _cap_(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(z / softcap)`` in place, in the order dense models compute it."""
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def _cap_with_slope_(z: torch.Tensor, softcap: float, d: torch.Tensor) -> torch.Tensor:
    """`_cap_`, with ``ds/dz = 1 - tanh(z / softcap)**2`` written into ``d``."""
    z.div_(softcap).tanh_()
    torch.mul(z, z, out=d).neg_().add_(1.0)
    return z.mul_(softcap)


def _sub_uniform_(g: torch.Tensor, uniform: torch.Tensor | None,
                  class_weight: torch.Tensor | None) -> None:
    """``g[b, c] -= uniform[b] * class_weight[c]`` (``class_weight`` None: 1)."""
    if uniform is None:
        return
    if class_weight is None:
        g.sub_(uniform.unsqueeze(1))
    else:
        g.addr_(uniform, class_weight, alpha=-1)


def lse_pass(
    x: torch.Tensor,
    source: SliceSource,
    targets: LabelTargets,
    *,
    slice_size: int,
    want_logit_sum: bool,
    softcap: float | None = None,
    class_weight: torch.Tensor | None = None,
    want_argmax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Online log-sum-exp of ``x`` ``(B, D)`` (accumulation dtype) over the class slices.

    ``targets`` records the target logits on the way. Returns each row's largest logit ``m``,
    ``sum(exp(z - m))`` (float64), with ``want_logit_sum`` the sum of its logits (weighted by
    ``class_weight``), with ``want_argmax`` its first largest logit's class (else ``None``).
    """
    batch = x.shape[0]
    dt, dev = x.dtype, x.device
    run_max = torch.full((batch,), -math.inf, dtype=dt, device=dev)
    run_sum = torch.zeros(batch, dtype=torch.float64, device=dev)
    z_sum = torch.zeros(batch, dtype=dt, device=dev) if want_logit_sum else None
    arg = torch.zeros(batch, dtype=torch.int64, device=dev) if want_argmax else None
    flat = torch.empty(batch * min(slice_size, source.num_classes), dtype=dt, device=dev)
    bounds = slice_bounds(source.num_classes, slice_size)
    targets.prepare(bounds, dt)
    with closing(source.slices(bounds)) as slices:
        for i, (start, stop, w, b) in enumerate(slices):
            z = flat[: batch * (stop - start)].view(batch, stop - start)
            _cap_(logits(x, w, b, z), softcap)
            targets.gather(i, z, start, stop)
            if z_sum is not None:
                if class_weight is None:
                    z_sum += z.sum(1)
                else:
                    z_sum.addmv_(z, class_weight[start:stop])
            if arg is not None:
                slice_max, slice_arg = z.max(1)
                # strictly greater: on ties the earlier class wins, as torch.argmax picks
                arg = torch.where(slice_max > run_max, slice_arg + start, arg)
            else:
                slice_max = z.amax(1)
            new_max = torch.maximum(run_max, slice_max)
            # online softmax; the running sum is float64, so many slices add no rounding
            run_sum.mul_(torch.exp((run_max - new_max).double()))
            z.sub_(new_max.unsqueeze(1)).exp_()
            run_sum += z.sum(1)
            run_max = new_max
    return run_max, run_sum, z_sum, arg


def log_sum_exp(row_max: torch.Tensor, row_sum: torch.Tensor) -> torch.Tensor:
    """``(B,)`` float64 log-sum-exp from `lse_pass`'s ``row_max`` and ``row_sum``."""
    return row_max.double() + torch.log(row_sum)


def grad_pass(
    x: torch.Tensor,
    source: SliceSource,
    targets: LabelTargets,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    scale: torch.Tensor,
    target_scale: torch.Tensor,
    *,
    slice_size: int,
    need_x: bool,
    sink: GradSink | None,
    need_weight: bool,
    need_bias: bool,
    softcap: float | None = None,
    class_weight: torch.Tensor | None = None,
    uniform_scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Recompute each slice's logits (after `lse_pass`) and form the gradients.

    The gradient with respect to the (capped) logit ``s[b, c]`` is
    ``scale[b] * softmax[b, c] - uniform_scale[b] * u[c] - target_scale[b] * target[b, c]``,
    ``u`` being ``class_weight`` (or 1); with ``softcap`` times ``1 - tanh(z / softcap)**2``.
    Weight and bias gradient slices go to ``sink``; returns ``x``'s gradient (or ``None``).
    """
    batch = x.shape[0]
    dt, dev = x.dtype, x.device
    num_classes = source.num_classes
    # NOTE: exp(z - m) * (scale / sum), not exp(z - lse): z - m is small where the softmax is
    # large, so it rounds as the dense softmax does; z - lse would round at the lse's magnitude.
    factor = (scale.double() / row_sum).to(dt).unsqueeze(1)
    neg_max = (-row_max).unsqueeze(1)
    target_scale = target_scale.to(dt)
    uniform = None if uniform_scale is None else uniform_scale.to(dt)

    grad_x = torch.zeros_like(x) if need_x else None
    width = min(slice_size, num_classes)
    flat = torch.empty(batch * width, dtype=dt, device=dev)
    dcap = torch.empty(batch * width, dtype=dt, device=dev) if softcap is not None else None
    bounds = slice_bounds(num_classes, slice_size)
    targets.prepare(bounds, dt)
    with closing(source.slices(bounds)) as slices:
        for i, (start, stop, w, b) in enumerate(slices):
            g = flat[: batch * (stop - start)].view(batch, stop - start)
            if softcap is None:
                # the row max folded into the product: addmm writes z - m directly
                if b is None:
                    torch.addmm(neg_max, x, w.t(), out=g)
                else:
                    torch.add(b.unsqueeze(0), neg_max, out=g)
                    g.addmm_(x, w.t())
            else:
                assert dcap is not None
                d = dcap[: batch * (stop - start)].view(batch, stop - start)
                _cap_with_slope_(logits(x, w, b, g), softcap, d).add_(neg_max)
            g.exp_().mul_(factor)
            _sub_uniform_(g, uniform, None if class_weight is None else class_weight[start:stop])
            targets.subtract(i, g, start, stop, target_scale)
            if softcap is not None:
                g.mul_(d)
            if grad_x is not None:
                grad_x.addmm_(g, w)
            if sink is not None:
                commit_grads(sink, g, x, start, stop, weight=need_weight, bias=need_bias)
    return grad_x


def commit_grads(sink: GradSink, g: torch.Tensor, x: torch.Tensor, start: int, stop: int, *,
                 weight: bool, bias: bool, alpha: float = 1.0) -> None:
    """Hand ``g.T @ x`` and ``alpha * g.sum(0)``, slice ``start:stop``'s gradients, to ``sink``."""
    gb = g.sum(0) if bias else None
    if gb is not None and alpha != 1.0:
        gb.mul_(alpha)
    gw = sink.out(start, stop) if weight else None
    if gw is not None:
        torch.mm(g.t(), x, out=gw)
    sink.commit(start, stop, gw, gb)


@dataclass(frozen=True, eq=False)
class CrossEntropyOptions:
    """The keywords of one `linear_cross_entropy` call, as it takes them.

    Checked where a call enters (`checked`, which resolves ``shift``, ``loss_dtype`` and
    ``accum_dtype``); `plan` picks ``slice_size`` and moves ``class_weight`` to the compute
    device. The passes, the autograd Function and the compiled operator take this one object.
    """

    ignore_index: int = -100
    label_smoothing: float = 0.0
    reduction: str = "mean"
    softcap: float | None = None
    shift: int = 0
    z_loss: float = 0.0
    class_weight: torch.Tensor | None = None
    return_lse: bool = False
    return_accuracy: bool = False
    return_predictions: bool = False
    loss_dtype: torch.dtype | None = None
    slice_size: int | None = None
    accum_dtype: torch.dtype | None = None
    prefetch: int = 1

    @property
    def want_argmax(self) -> bool:
        return self.return_accuracy or self.return_predictions

    def given(self) -> list[str]:
        """The language-model options set away from their defaults (all but ``ignore_index``,
        ``label_smoothing``, ``reduction`` and the slicing)."""
        set_ = {
            "softcap": self.softcap is not None, "shift": bool(self.shift),
            "z_loss": self.z_loss != 0.0, "class_weight": self.class_weight is not None,
            "return_lse": self.return_lse, "return_accuracy": self.return_accuracy,
            "return_predictions": self.return_predictions,
            "loss_dtype": self.loss_dtype is not None,
        }
        return [k for k, v in set_.items() if v]

    def checked(self, *, num_classes: int, dtype: torch.dtype) -> CrossEntropyOptions:
        """These options checked (before any compute) and normalized for inputs of ``dtype``."""
        softcap, z_loss, shift, cw = self.softcap, self.z_loss, self.shift, self.class_weight
        # NOTE: comparisons, not math.isfinite, which breaks the graph on a symbolic float
        if softcap is not None and not (isinstance(softcap, (int, float))
                                        and 0 < softcap < math.inf):
            raise ValueError(f"softcap must be a positive float or None, got {softcap!r}")
        if not (isinstance(z_loss, (int, float)) and 0 <= z_loss < math.inf):
            raise ValueError(f"z_loss must be a float >= 0, got {z_loss!r}")
        if isinstance(shift, bool):
            shift = int(shift)
        if not isinstance(shift, int) or shift < 0:
            raise ValueError(f"shift must be a bool or an int >= 0, got {shift!r}")
        if self.loss_dtype is not None and not self.loss_dtype.is_floating_point:
            raise TypeError(f"loss_dtype must be a floating dtype or None, got {self.loss_dtype}")
        if cw is not None:
            if not isinstance(cw, torch.Tensor) or not cw.is_floating_point():
                raise TypeError("class_weight must be a floating tensor of one weight per class")
            if tuple(cw.shape) != (num_classes,):
                raise ValueError(
                    f"class_weight must have shape ({num_classes},), one weight per class, got "
                    f"{tuple(cw.shape)}")
            if cw.requires_grad:
                raise ValueError(
                    "class_weight requires grad, but gets no gradient here (as in "
                    "F.cross_entropy); pass class_weight.detach()")
        accum_dtype = compute_dtype(dtype, accum_dtype=self.accum_dtype)
        # half-precision inputs return a float32 loss, as peers do
        half = dtype in (torch.float16, torch.bfloat16)
        loss_dtype = self.loss_dtype or (torch.float32 if half else dtype)
        check_slicing(reduction=self.reduction, slice_size=self.slice_size,
                      prefetch=self.prefetch, accum_dtype=accum_dtype)
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        return replace(
            self, label_smoothing=float(self.label_smoothing), shift=shift,
            softcap=None if softcap is None else float(softcap), z_loss=float(z_loss),
            loss_dtype=loss_dtype, accum_dtype=accum_dtype)

    def returned(
        self, out: tuple[torch.Tensor, ...]
    ) -> torch.Tensor | LinearCrossEntropyOutput:
        """The loss, or with a ``return_*`` flag a `LinearCrossEntropyOutput` of ``out``."""
        loss, lse, acc, pred = out
        if not (self.return_lse or self.want_argmax):
            return loss
        return LinearCrossEntropyOutput(
            loss, lse if self.return_lse else None, acc if self.return_accuracy else None,
            pred if self.return_predictions else None)


class CrossEntropyForward(NamedTuple):
    """Outputs of `ce_forward` and what its backward needs."""

    loss: torch.Tensor          # 0-d, or (N,) for reduction="none"; float64
    lse: torch.Tensor           # (N,) float64
    predictions: torch.Tensor | None   # (N,) int64, -1 on ignored rows
    accuracy: torch.Tensor | None      # 0-d float64
    row_max: torch.Tensor
    row_sum: torch.Tensor
    denominator: torch.Tensor   # what "mean" divides the cross-entropy by (weighted count)
    n_valid: torch.Tensor       # rows not ignored (what "mean" divides the z-loss by)


def _target_weights(t: torch.Tensor, valid: torch.Tensor, opts: CrossEntropyOptions
                    ) -> torch.Tensor:
    """``(N,)`` float64 weight of each row's target class (1, or class_weight), 0 if ignored."""
    if opts.class_weight is None:
        return valid.double()
    w = opts.class_weight.double()[torch.where(valid, t, 0)]
    return torch.where(valid, w, torch.zeros_like(w))


def ce_forward(
    x: torch.Tensor, source: SliceSource, t: torch.Tensor, opts: CrossEntropyOptions, *,
    slice_size: int,
) -> CrossEntropyForward:
    """The loss of ``x`` ``(N, D)`` against ``t`` ``(N,)`` int64, one pass over the slices.

    Per row not ignored, with ``s`` the (capped) logits, ``L`` their log-sum-exp, ``w`` the
    class weights (1 without), ``W = sum(w)`` and ``y`` the target:
    ``(1 - eps) * w_y * (L - s_y) + eps / C * (W * L - sum_c w_c s_c) + z_loss * L**2``.
    ``"mean"`` divides the cross-entropy part by ``sum(w_y)`` (as ``F.cross_entropy`` does)
    and the z-loss part by the number of rows not ignored.
    """
    targets = OneHot(t)
    row_max, row_sum, logit_sum, argmax = lse_pass(
        x, source, targets, slice_size=slice_size, want_logit_sum=opts.label_smoothing > 0,
        softcap=opts.softcap, class_weight=opts.class_weight, want_argmax=opts.want_argmax)
    return _finish(t, opts, source.num_classes, log_sum_exp(row_max, row_sum), targets.logits,
                   logit_sum, argmax, row_max, row_sum)


def _counts(t: torch.Tensor, opts: CrossEntropyOptions
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(valid, w_y, denominator, n_valid)``: what "mean" divides the two parts by."""
    valid = t != opts.ignore_index
    wy = _target_weights(t, valid, opts)
    n_valid = valid.sum().double()
    denominator = wy.sum() if opts.class_weight is not None else n_valid
    return valid, wy, denominator, n_valid


def _finish(
    t: torch.Tensor, opts: CrossEntropyOptions, num_classes: int, lse: torch.Tensor,
    z_target: torch.Tensor, logit_sum: torch.Tensor | None, argmax: torch.Tensor | None,
    row_max: torch.Tensor, row_sum: torch.Tensor,
) -> CrossEntropyForward:
    """The loss and extra outputs from each row's log-sum-exp and target logit."""
    eps = opts.label_smoothing
    valid, wy, denominator, n_valid = _counts(t, opts)
    rows = wy * (lse - z_target.double())
    if eps > 0:
        assert logit_sum is not None
        if opts.class_weight is None:
            smooth = lse - logit_sum.double() / num_classes
        else:
            total_w = opts.class_weight.double().sum()
            smooth = (total_w * lse - logit_sum.double()) / num_classes
        rows = (1.0 - eps) * rows + eps * smooth
    rows = torch.where(valid, rows, torch.zeros_like(rows))
    zrows = None
    if opts.z_loss:
        zrows = torch.where(valid, opts.z_loss * lse * lse, torch.zeros_like(lse))
    if opts.reduction == "none":
        loss = rows if zrows is None else rows + zrows
    else:
        # nan when every row is ignored, as F.cross_entropy
        loss = rows.sum() / denominator if opts.reduction == "mean" else rows.sum()
        if zrows is not None:
            loss = loss + (zrows.sum() / n_valid if opts.reduction == "mean" else zrows.sum())
    predictions = accuracy = None
    if argmax is not None:
        predictions = torch.where(valid, argmax, torch.full_like(argmax, -1))
        accuracy = ((predictions == t) & valid).sum().double() / n_valid
    return CrossEntropyForward(loss, lse, predictions, accuracy, row_max, row_sum,
                               denominator, n_valid)


def grad_coefficients(
    t: torch.Tensor, lse: torch.Tensor, denominator: torch.Tensor, n_valid: torch.Tensor,
    grad_loss: torch.Tensor | None, grad_lse: torch.Tensor | None, opts: CrossEntropyOptions,
    num_classes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row factors of the softmax, the target and the uniform term of the gradient.

    With ``r`` the factor of a row's cross-entropy in the reduced loss and ``r_z`` that of its
    z-loss, the gradient with respect to the logit ``s_c`` is
    ``p_c * (r * ((1 - eps) * w_y + eps * W / C) + 2 * z_loss * L * r_z + dlse)
    - r * (1 - eps) * w_y * [c == y] - r * eps / C * w_c``: the three row factors (float64).
    """
    eps = opts.label_smoothing
    valid = t != opts.ignore_index
    zeros = torch.zeros(t.shape[0], dtype=torch.float64, device=t.device)
    if grad_loss is None:
        r = r_z = zeros
    else:
        g = grad_loss.double()
        if opts.reduction == "none":
            r = r_z = g.reshape(-1)
        elif opts.reduction == "mean":
            r, r_z = (g / denominator).expand_as(zeros), (g / n_valid).expand_as(zeros)
        else:
            r = r_z = g.expand_as(zeros)
        r = torch.where(valid, r, zeros)
        r_z = torch.where(valid, r_z, zeros)
    wy = _target_weights(t, valid, opts)
    if opts.class_weight is None:
        coef = r.clone()  # (1 - eps) + eps * C / C
    else:
        total_w = opts.class_weight.double().sum()
        coef = r * ((1.0 - eps) * wy + eps * total_w / num_classes)
    if opts.z_loss and grad_loss is not None:
        coef = coef + 2.0 * opts.z_loss * lse * r_z
    if grad_lse is not None:
        coef = coef + grad_lse.reshape(-1).double()
    uniform = r * (eps / num_classes) if eps > 0 else None
    return coef, r * (1.0 - eps) * wy, uniform


# ---------------------------------------------------------------------------------------------
# the one-pass path: chunks of rows over the whole vocabulary


# NOTE: below this many rows per chunk, accumulating the weight gradient once per chunk costs
# more memory traffic than the recomputed product it saves.
_MIN_CHUNK_ROWS = 256


def rows_per_chunk(n_rows: int, num_classes: int, *, softcap: bool,
                   budget_bytes: int = DEFAULT_LOGITS_BUDGET, itemsize: int = 4) -> int | None:
    """Rows whose full logits fit the budget (at most half of them: whole logits are what this
    avoids), or ``None`` when the one-pass path does not pay; ``itemsize``: bytes per logit."""
    fit = budget_bytes // (num_classes * itemsize * (2 if softcap else 1))
    rows = min(fit, -(-n_rows // 2))
    if not (rows >= min(_MIN_CHUNK_ROWS, -(-n_rows // 2)) and rows >= 1):
        return None
    # chunks of equal size: a short last chunk runs its products less efficiently
    chunks = -(-n_rows // rows)
    return -(-n_rows // chunks)


def row_pass(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, t: torch.Tensor,
    opts: CrossEntropyOptions, *, rows: int, need_x: bool, need_weight: bool, need_bias: bool,
) -> tuple[CrossEntropyForward, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Loss and gradients (for an incoming gradient of 1) in one pass over chunks of rows.

    Each chunk's logits over all classes come from one product, the gradients from two more
    (the class-sliced passes need four). For a scalar loss: backward scales the gradients.
    """
    n = x.shape[0]
    num_classes = weight.shape[0]
    dt, dev = x.dtype, x.device
    eps, cap, cw = opts.label_smoothing, opts.softcap, opts.class_weight
    _, _, denominator, n_valid = _counts(t, opts)
    lse = torch.empty(n, dtype=torch.float64, device=dev)
    row_sum = torch.empty(n, dtype=torch.float64, device=dev)
    row_max = torch.empty(n, dtype=dt, device=dev)
    z_target = torch.empty(n, dtype=dt, device=dev)
    logit_sum = torch.empty(n, dtype=dt, device=dev) if eps > 0 else None
    argmax = torch.empty(n, dtype=torch.int64, device=dev) if opts.want_argmax else None
    grad_x = torch.empty_like(x) if need_x else None
    grad_w = torch.empty_like(weight) if need_weight else None  # the first chunk writes it
    grad_b = torch.zeros_like(bias) if (need_bias and bias is not None) else None
    want_grad = need_x or need_weight or grad_b is not None
    one = torch.ones((), dtype=torch.float64, device=dev)
    flat = torch.empty(min(rows, n) * num_classes, dtype=dt, device=dev)
    dflat = torch.empty_like(flat) if cap is not None else None
    for a in range(0, n, rows):
        b = min(a + rows, n)
        xs, ts = x[a:b], t[a:b]
        z = logits(xs, weight, bias, flat[: (b - a) * num_classes].view(b - a, num_classes))
        d = None
        if cap is not None:
            assert dflat is not None
            d = dflat[: (b - a) * num_classes].view(b - a, num_classes)
            _cap_with_slope_(z, cap, d)
        valid = ts != opts.ignore_index
        local = torch.where(valid, ts, torch.zeros_like(ts)).unsqueeze(1)
        z_target[a:b] = z.gather(1, local).squeeze(1)
        if logit_sum is not None:
            logit_sum[a:b] = z.sum(1) if cw is None else z @ cw
        if argmax is not None:
            m, argmax[a:b] = z.max(1)
        else:
            m = z.amax(1)
        row_max[a:b] = m
        z.sub_(m.unsqueeze(1)).exp_()
        sums = z.sum(1).double()
        row_sum[a:b] = sums
        chunk_lse = m.double() + torch.log(sums)
        lse[a:b] = chunk_lse
        if not want_grad:
            continue
        coef, target_scale, uniform = grad_coefficients(
            ts, chunk_lse, denominator, n_valid, one, None, opts, num_classes)
        z.mul_((coef / sums).to(dt).unsqueeze(1))
        _sub_uniform_(z, None if uniform is None else uniform.to(dt), cw)
        z.scatter_add_(1, local, -target_scale.to(dt).unsqueeze(1))
        if d is not None:
            z.mul_(d)
        if grad_x is not None:
            torch.mm(z, weight, out=grad_x[a:b])
        if grad_w is not None:
            if a == 0:
                torch.mm(z.t(), xs, out=grad_w)
            else:
                grad_w.addmm_(z.t(), xs)
        if grad_b is not None:
            grad_b += z.sum(0)
    fwd = _finish(t, opts, num_classes, lse, z_target, logit_sum, argmax, row_max, row_sum)
    return fwd, grad_x, grad_w, grad_b


class LinearCrossEntropyOutput(NamedTuple):
    """What `linear_cross_entropy` returns when asked for more than the loss.

    Attributes:
        loss: the loss, as without the extra outputs.
        lse: each row's log-sum-exp of the (capped) logits, shaped like the per-row loss
            (differentiable; ``None`` unless ``return_lse``).
        accuracy: the fraction of rows not ignored whose largest logit is the target (0-d;
            nan when every row is ignored; ``None`` unless ``return_accuracy``).
        predictions: each row's class with the largest logit (int64, the first on ties), -1
            on ignored rows (``None`` unless ``return_predictions``).
    """

    loss: torch.Tensor
    lse: torch.Tensor | None = None
    accuracy: torch.Tensor | None = None
    predictions: torch.Tensor | None = None


def shift_target(target: torch.Tensor, shift: int, ignore_index: int) -> torch.Tensor:
    """``target[..., shift:]`` padded back to its length with ``ignore_index``: the features
    need no copy, the last ``shift`` positions are ignored instead of dropped."""
    if shift == 0:
        return target
    if target.dim() < 1 or target.shape[-1] <= shift:
        raise ValueError(
            f"shift={shift} needs a sequence dimension longer than {shift}: target shape "
            f"{tuple(target.shape)} (x is (..., seq, features), target (..., seq))")
    pad = target.new_full((*target.shape[:-1], shift), ignore_index)
    return torch.cat([target[..., shift:], pad], dim=-1)


def unshift_rows(rows: torch.Tensor, shape: torch.Size, shift: int) -> torch.Tensor:
    """Per-row values of the shifted rows, shaped ``shape[:-1] + (seq - shift,)``."""
    rows = rows.reshape(shape)
    return rows[..., : shape[-1] - shift] if shift else rows


def outputs(
    fwd: CrossEntropyForward, opts: CrossEntropyOptions, shape: torch.Size
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The autograd outputs ``(loss, lse, accuracy, predictions)`` of a forward, reshaped."""
    loss, shift = fwd.loss, opts.shift
    if opts.reduction == "none":
        loss = unshift_rows(loss, shape, shift)
    lse = unshift_rows(fwd.lse, shape, shift).to(opts.loss_dtype)
    empty = torch.zeros(0, device=loss.device)
    acc = empty if fwd.accuracy is None else fwd.accuracy.to(opts.loss_dtype)
    pred = empty if fwd.predictions is None else unshift_rows(fwd.predictions, shape, shift)
    return loss.to(opts.loss_dtype), lse, acc, pred


def grad_rows(grad: torch.Tensor | None, shape: torch.Size, shift: int) -> torch.Tensor | None:
    """A per-row incoming gradient back on all ``N`` rows (0 where shifted out)."""
    if grad is None or shift == 0:
        return None if grad is None else grad.reshape(-1)
    full = grad.new_zeros(shape)
    full[..., : shape[-1] - shift] = grad
    return full.reshape(-1)


# ---------------------------------------------------------------------------------------------
# one call: its checks, the rows it computes, and its two passes as plain functions (run by
# the autograd Function below and by the compiled operator)


def check_labels(x: torch.Tensor, target: torch.Tensor, opts: CrossEntropyOptions, *,
                 num_classes: int, names: tuple[str, str] = ("target", "x")) -> torch.Tensor:
    """The checks of a call's labels (its options are `checked`); returns them shifted."""
    if opts.shift and x.dim() < 2:
        raise ValueError(f"shift={opts.shift} needs {names[1]} of shape (..., seq, features), "
                         f"got {tuple(x.shape)}")
    if isinstance(target, torch.Tensor) and not (
            target.dtype.is_floating_point or target.dtype == torch.bool):
        target = shift_target(target, opts.shift, opts.ignore_index)
    check_label_shape(target, x, names=names)
    _check_target(target, num_classes, opts.ignore_index)
    return target


def one_pass(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, opts: CrossEntropyOptions,
    *, batch: int,
) -> bool:
    """Whether `linear_cross_entropy` takes the one-pass path (`row_pass`)."""
    return (opts.slice_size is None and opts.reduction != "none" and not opts.return_lse
            and torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad
                 or (bias is not None and bias.requires_grad))
            and weight.device == x.device and x.dtype == opts.accum_dtype
            and rows_per_chunk(batch, weight.shape[0], softcap=opts.softcap is not None,
                               itemsize=x.element_size()) is not None)


def _kept_rows(target: torch.Tensor, ignore_index: int) -> torch.Tensor | None:
    """Indices of the rows not ignored, or ``None`` when none or all of them are."""
    if torch.compiler.is_compiling():
        return None  # a data-dependent shape: a compiled graph computes every row
    flat = target.reshape(-1)
    keep = (flat != ignore_index).nonzero().squeeze(1)
    return keep if 0 < keep.numel() < flat.numel() else None


class Planned(NamedTuple):
    """The rows one call computes (``x``, or the ``(K, D)`` rows ``keep``), their shifted
    labels, the options for them (`plan`), all rows' label ``shape`` and ``shift``, and the
    rows per ``chunk`` of the one-pass path (``None``: the class-sliced path)."""

    x: torch.Tensor
    target: torch.Tensor
    opts: CrossEntropyOptions
    keep: torch.Tensor | None
    shape: torch.Size
    shift: int
    chunk: int | None

    def all_rows(self, out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The outputs with the predictions of the rows not kept put back (-1)."""
        if self.keep is None or not self.opts.return_predictions:
            return out
        pred = torch.full((math.prod(self.shape),), -1, dtype=torch.int64,
                          device=out[3].device)
        pred[self.keep] = out[3]
        return (*out[:3], unshift_rows(pred, self.shape, self.shift))


def rows_grad(gx: torch.Tensor | None, keep: torch.Tensor | None, x_shape: torch.Size
              ) -> torch.Tensor | None:
    """The gradient of an ``x_shape`` input from ``gx``, that of its rows ``keep``."""
    if gx is not None and keep is not None:
        full = gx.new_zeros((math.prod(x_shape[:-1]), x_shape[-1]))
        gx = full.index_add_(0, keep, gx.reshape(-1, x_shape[-1]))
    return None if gx is None else gx.reshape(x_shape)


def plan(
    x: torch.Tensor, target: torch.Tensor, opts: CrossEntropyOptions, *, num_classes: int,
    one_pass: bool,
) -> Planned:
    """The rows a checked call computes (with the labels ``target``, shifted) and how."""
    shape, shift = target.shape, opts.shift
    keep = _kept_rows(target, opts.ignore_index) if (
        opts.reduction != "none" and not opts.return_lse) else None
    if keep is not None:
        # NOTE: ignored rows add nothing to a reduced loss and get a zero gradient, so only
        # the rest go through the products (the index_select's backward puts the zeros back).
        x = x.reshape(-1, x.shape[-1]).index_select(0, keep)
        target, shift = target.reshape(-1)[keep], 0
    batch = math.prod(target.shape)
    chunk = None
    if one_pass:
        # decided on all rows (a compiled graph needs a fact of shapes), chunked on those kept
        chunk = rows_per_chunk(batch, num_classes, softcap=opts.softcap is not None,
                               itemsize=x.element_size())
        assert chunk is not None
    slice_size = opts.slice_size
    if slice_size is None:
        # with softcap, backward keeps ds/dz beside the logits
        budget = DEFAULT_LOGITS_BUDGET // (2 if opts.softcap is not None else 1)
        slice_size = pick_slice_size(batch, num_classes, accum_dtype=opts.accum_dtype,
                                     budget_bytes=budget)
    cw = opts.class_weight
    planned = replace(
        opts, slice_size=max(1, min(slice_size, num_classes)), shift=shift,
        class_weight=None if cw is None else cw.detach().to(x.device, opts.accum_dtype))
    return Planned(x, target, planned, keep, shape, opts.shift, chunk)


def sliced_forward(
    x: torch.Tensor, target: torch.Tensor, params: ParamSlices, opts: CrossEntropyOptions
) -> CrossEntropyForward:
    """`ce_forward` of ``x`` ``(..., D)`` against ``target`` (its shape without ``D``)."""
    with no_autocast(x.device):
        return ce_forward(x.reshape(-1, x.shape[-1]).to(opts.accum_dtype),
                          params.source(opts.slice_size), target.reshape(-1).long(), opts,
                          slice_size=opts.slice_size)


def sliced_backward(
    x: torch.Tensor, target: torch.Tensor, params: ParamSlices, saved: tuple[torch.Tensor, ...],
    grads: tuple[torch.Tensor | None, torch.Tensor | None], opts: CrossEntropyOptions,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The gradients of ``(x, weight, bias)`` (as ``needs`` asks) for ``grads``, those of the
    loss and the lse, by `grad_pass`; ``saved`` is ``CrossEntropyForward[4:]``."""
    need_x, need_w, need_b = needs
    grad_loss, grad_lse = grads
    if opts.reduction == "none":
        grad_loss = grad_rows(grad_loss, target.shape, opts.shift)
    grad_lse = grad_rows(grad_lse, target.shape, opts.shift)
    if grad_loss is None and grad_lse is None:
        return None, None, None
    source = params.source(opts.slice_size)
    sink = params.sink(opts.slice_size, weight=need_w, bias=need_b) if (
        need_w or need_b) else None
    t = target.reshape(-1).long()
    row_max, row_sum, denominator, n_valid = saved
    with landing(sink), no_autocast(x.device):
        coef, target_scale, uniform = grad_coefficients(
            t, log_sum_exp(row_max, row_sum), denominator, n_valid, grad_loss, grad_lse, opts,
            source.num_classes)
        grad_x = grad_pass(
            x.reshape(-1, x.shape[-1]).to(opts.accum_dtype), source, OneHot(t), row_max,
            row_sum, coef, target_scale, slice_size=opts.slice_size, need_x=need_x, sink=sink,
            need_weight=need_w, need_bias=need_b, softcap=opts.softcap,
            class_weight=opts.class_weight, uniform_scale=uniform)
    gw, gb = params.landed(sink, weight=need_w, bias=need_b) if sink else (None, None)
    return (None if grad_x is None else grad_x.to(x.dtype).reshape(x.shape)), gw, gb


def rows_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    opts: CrossEntropyOptions, *, rows: int, needs: tuple[bool, bool, bool],
) -> tuple[CrossEntropyForward, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """`row_pass` of ``x`` ``(..., D)``."""
    with no_autocast(x.device):
        fwd, gx, gw, gb = row_pass(
            x.reshape(-1, x.shape[-1]), weight, bias, target.reshape(-1).long(), opts, rows=rows,
            need_x=needs[0], need_weight=needs[1], need_bias=needs[2])
    return fwd, (None if gx is None else gx.reshape(x.shape)), gw, gb


def scale_grads(
    grads: tuple[torch.Tensor | None, ...], grad_loss: torch.Tensor, needs: tuple[bool, ...],
    *, in_place: bool,
) -> tuple[torch.Tensor | None, ...]:
    """The one-pass path's backward: its gradients (for 1) times the incoming one."""
    scale = grad_loss.to(torch.float64)
    if in_place and bool(scale == 1):
        return tuple(g if need else None for g, need in zip(grads, needs, strict=True))
    return tuple(None if g is None or not need else
                 (g.mul_ if in_place else g.mul)(scale.to(g.dtype))
                 for g, need in zip(grads, needs, strict=True))


# ---------------------------------------------------------------------------------------------
# autograd


def no_autocast(device: torch.device) -> torch.autocast:
    """Autocast off: the passes compute in ``accum_dtype``, into ``out=`` buffers of it (a
    Trainer's ``bf16=True`` would run the products in half precision)."""
    return torch.autocast(device.type, enabled=False)


def _refuse_double_backward(what: str, dense: str) -> None:
    """Raise when a backward runs under ``create_graph=True``."""
    # NOTE: the passes write into reused buffers, which autograd cannot differentiate; it would
    # fail deep inside with an error naming neither the cause nor the fix
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{what} does not support double backward: a backward with create_graph=True (a "
            "gradient penalty, a Hessian-vector product) ran through its sliced backward, which "
            f"is not differentiable. Compute such a penalty on {dense}, which materializes the "
            "logits, or on another term")


_DENSE = ("linear_cross_entropy", "F.cross_entropy(x @ weight.T + bias, target)")


class _LinearCrossEntropy(torch.autograd.Function):
    """`sliced_forward` and `sliced_backward` under autograd, for the slices of ``params`` (a
    tensor's, or a store's); ``dense`` names the call and its dense twin for errors. With
    ``rows``, the one-pass path (`rows_forward`): gradients formed in forward (for a scalar
    loss), scaled in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        target: torch.Tensor, params: ParamSlices | None, opts: CrossEntropyOptions,
        dense: tuple[str, str], rows: int | None = None,
    ):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ctx.needs = (need_x, need_w, need_b and bias is not None)
        if rows is None:
            assert params is not None
            fwd = sliced_forward(x, target, params, opts)
            # NOTE: the params' tensors are saved too: autograd then refuses a backward after an
            # in-place change of them (it would use the changed values)
            ctx.save_for_backward(x, target, *fwd[4:], *params.versioned)
        else:
            fwd, *grads = rows_forward(x, weight, bias, target, opts, rows=rows, needs=ctx.needs)
            ctx.save_for_backward(*grads)
        ctx.params, ctx.opts, ctx.dense, ctx.one_pass = params, opts, dense, rows is not None
        ctx.set_materialize_grads(False)
        out = outputs(fwd, opts, target.shape)
        ctx.mark_non_differentiable(out[2], out[3])
        return out

    @staticmethod
    def backward(ctx: Any, grad_loss, grad_lse, _acc, _pred):  # type: ignore[override]
        _refuse_double_backward(*ctx.dense)
        if not ctx.one_pass:
            x, target, *saved = ctx.saved_tensors
            grads = sliced_backward(x, target, ctx.params, tuple(saved[:4]),
                                    (grad_loss, grad_lse), ctx.opts, ctx.needs)
        elif grad_loss is None:
            grads = (None, None, None)
        else:
            assert grad_lse is None  # the lse is not returned on this path
            # NOTE: scaled in place: they are the saved tensors, so a second backward fails as
            # any freed graph's does
            grads = scale_grads(ctx.saved_tensors, grad_loss, ctx.needs_input_grad[:3],
                                in_place=True)
        return (*grads, None, None, None, None, None)


def linear_cross_entropy_eager(
    x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    opts: CrossEntropyOptions,
) -> torch.Tensor | LinearCrossEntropyOutput:
    """`linear_cross_entropy` outside ``torch.compile``, after `checked` and `check_linear`."""
    target = check_labels(x, target, opts, num_classes=weight.shape[0])
    p = plan(x, target, opts, num_classes=weight.shape[0],
             one_pass=one_pass(x, weight, bias, opts, batch=math.prod(target.shape)))
    params = None if p.chunk is not None else TensorParams(
        weight, bias, device=x.device, dtype=p.opts.accum_dtype, prefetch=p.opts.prefetch)
    out = _LinearCrossEntropy.apply(p.x, weight, bias, p.target, params, p.opts, _DENSE, p.chunk)
    return opts.returned(p.all_rows(out))
