"""Exact linear + cross-entropy over many classes, computed slice by slice over the classes.

``linear_cross_entropy(x, weight, target)`` equals ``F.cross_entropy(x @ weight.T + bias, target)``
(same ``ignore_index``, ``label_smoothing`` and ``reduction`` semantics) without ever holding the
``batch x num_classes`` logits:

* forward: one pass over class slices keeps an online log-sum-exp per row (running max and
  running sum of exponentials), picks out the target logit and, with label smoothing, the sum of
  the logits. Only the per-row log-sum-exp is saved for backward.
* backward: a second pass recomputes each slice's logits, turns them into
  ``scale * (softmax - (1 - eps) * onehot - eps / C)`` in place, and does
  ``grad_x += g @ W_s`` and ``grad_W_s = g.T @ x``.

That is four matrix products where the dense version needs three; everything else works in place
on one reused ``batch x slice`` buffer (no extra passes, no allocation per slice).
"""

from __future__ import annotations

import math
from contextlib import closing
from typing import Any, Protocol

import torch

from headroom.heads._slices import (
    GradSink,
    SliceSource,
    TensorGradSink,
    TensorSlices,
    landing,
    slice_bounds,
)

__all__ = ["DEFAULT_LOGITS_BUDGET", "linear_cross_entropy", "pick_slice_size"]

# A few hundred MB is the default budget; within that, slices of a few thousand
# classes keep the reused buffer in the last-level cache for the elementwise passes, which run
# at cache speed instead of memory speed. Larger slices do not make the matrix products faster.
DEFAULT_LOGITS_BUDGET = 256 * 2**20
_CACHE_FRIENDLY_SLICE = 8192

_REDUCTIONS = ("mean", "sum", "none")


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
    # One host sync on an accelerator; an out-of-range label would otherwise silently
    # read another row (or nothing) and give a wrong loss.
    if bool(bad.any()):
        first = target[bad].flatten()[0].item()
        count = int(bad.sum())
        raise ValueError(
            f"target has {count} label(s) outside [0, {num_classes}) (first: {first}) that are "
            f"not ignore_index={ignore_index}; fix the labels or num_classes"
        )


def check_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    reduction: str,
    accum_dtype: torch.dtype,
    slice_size: int | None,
    prefetch: int,
) -> None:
    """Checks shared by the sliced losses: shapes, dtypes and devices of ``x @ weight.T + bias``."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if slice_size is not None and (not isinstance(slice_size, int) or slice_size < 1):
        raise ValueError(f"slice_size must be a positive int or None, got {slice_size!r}")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    if not accum_dtype.is_floating_point:
        raise TypeError(f"accum_dtype must be a floating dtype, got {accum_dtype}")
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


def _check_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    accum_dtype: torch.dtype,
    slice_size: int | None,
    prefetch: int,
) -> None:
    check_linear(x, weight, bias, reduction=reduction, accum_dtype=accum_dtype,
                 slice_size=slice_size, prefetch=prefetch)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    check_label_shape(target, x, names=("target", "x"))
    _check_target(target, weight.shape[0], ignore_index)


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
    """One target class per row (rows whose scale is 0 may hold anything).

    Args:
        target: ``(B,)`` int64 on the compute device.
    """

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target
        self.logits = torch.zeros(0)

    def _local(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Column of each row's target within ``start:stop`` (clamped) and whether it lies there."""
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


def lse_pass(
    x: torch.Tensor,
    source: SliceSource,
    targets: LabelTargets,
    *,
    slice_size: int,
    want_logit_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Online log-sum-exp over class slices; ``targets`` records its logits on the way.

    Args:
        x: ``(B, D)`` in the accumulation dtype on the compute device.
        source: the weight slices.
        targets: where the target logits are (`OneHot`, or several positives per row).
        slice_size: classes per slice.
        want_logit_sum: also return the sum of each row's logits (label smoothing).

    Returns:
        ``(row_max, row_sum, logit_sum or None)``: each row's largest logit ``m`` (accumulation
        dtype), ``sum(exp(z - m))`` (float64) and the sum of its logits; see `log_sum_exp`.
    """
    batch = x.shape[0]
    dt, dev = x.dtype, x.device
    run_max = torch.full((batch,), -math.inf, dtype=dt, device=dev)
    run_sum = torch.zeros(batch, dtype=torch.float64, device=dev)
    z_sum = torch.zeros(batch, dtype=dt, device=dev) if want_logit_sum else None
    flat = torch.empty(batch * min(slice_size, source.num_classes), dtype=dt, device=dev)
    bounds = slice_bounds(source.num_classes, slice_size)
    targets.prepare(bounds, dt)
    with closing(source.slices(bounds)) as slices:
        for i, (start, stop, w, b) in enumerate(slices):
            z = flat[: batch * (stop - start)].view(batch, stop - start)
            if b is None:
                torch.mm(x, w.t(), out=z)
            else:
                torch.addmm(b, x, w.t(), out=z)
            targets.gather(i, z, start, stop)
            if z_sum is not None:
                z_sum += z.sum(1)
            new_max = torch.maximum(run_max, z.amax(1))
            # Rescale the running sum to the new max before adding this slice (online
            # softmax); the B-sized running sum is float64, so the many slices of a huge class
            # count add no rounding of their own.
            run_sum.mul_(torch.exp((run_max - new_max).double()))
            z.sub_(new_max.unsqueeze(1)).exp_()
            run_sum += z.sum(1)
            run_max = new_max
    return run_max, run_sum, z_sum


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
    *,
    slice_size: int,
    label_smoothing: float,
    need_x: bool,
    sink: GradSink | None,
    need_weight: bool,
    need_bias: bool,
    target_scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Recompute each slice's logits and form the gradients of x, weight and bias.

    The gradient of the loss with respect to logit ``z[b, c]`` is
    ``scale[b] * (softmax[b, c] - eps / C) - target_scale[b] * target[b, c]``, where
    ``target_scale`` defaults to ``(1 - eps) * scale``.

    Args:
        x: ``(B, D)`` in the accumulation dtype on the compute device.
        source: the weight slices.
        targets: where the targets are (rows with ``scale == 0`` may hold anything).
        row_max: ``(B,)`` from :func:`lse_pass`.
        row_sum: ``(B,)`` from :func:`lse_pass`.
        scale: ``(B,)`` per-row factor (incoming gradient, ``1/n`` for mean, 0 for ignored rows).
        slice_size: classes per slice.
        label_smoothing: ``eps``.
        need_x: whether to return the gradient of ``x``.
        sink: receives the weight and bias gradient slices (``None``: neither is wanted).
        need_weight: whether to form the weight gradient (one matrix product per slice).
        need_bias: whether to hand bias gradient slices to the sink.
        target_scale: ``(B,)`` factor of the target term, if not ``(1 - eps) * scale``.

    Returns:
        The ``(B, D)`` gradient of ``x`` in the accumulation dtype, or ``None``.
    """
    batch = x.shape[0]
    dt, dev = x.dtype, x.device
    num_classes = source.num_classes
    scale = scale.to(dt)
    # Softmax * scale as exp(z - m) * (scale / sum), m the row's largest logit: where the
    # softmax is large, z - m is small, so rounding its argument costs what the dense softmax's
    # does. Folding the log-sum-exp into the exponent (one pass less) rounds the argument at
    # the log-sum-exp's magnitude, further from float64 than PyTorch's dense fp32.
    factor = (scale.double() / row_sum).to(dt).unsqueeze(1)
    neg_max = (-row_max).unsqueeze(1)
    if target_scale is None:
        target_scale = (1.0 - label_smoothing) * scale
    target_scale = target_scale.to(dt)
    uniform = None
    if label_smoothing > 0:
        uniform = ((label_smoothing / num_classes) * scale).unsqueeze(1)

    grad_x = torch.zeros_like(x) if need_x else None
    flat = torch.empty(batch * min(slice_size, num_classes), dtype=dt, device=dev)
    bounds = slice_bounds(num_classes, slice_size)
    targets.prepare(bounds, dt)
    with closing(source.slices(bounds)) as slices:
        for i, (start, stop, w, b) in enumerate(slices):
            g = flat[: batch * (stop - start)].view(batch, stop - start)
            if b is None:
                torch.addmm(neg_max, x, w.t(), out=g)
            else:
                torch.add(b.unsqueeze(0), neg_max, out=g)
                g.addmm_(x, w.t())
            g.exp_().mul_(factor)
            if uniform is not None:
                g.sub_(uniform)
            targets.subtract(i, g, start, stop, target_scale)
            if grad_x is not None:
                grad_x.addmm_(g, w)
            if sink is not None:
                gb = g.sum(0) if need_bias else None
                gw = None
                if need_weight:
                    gw = sink.out(start, stop)
                    torch.mm(g.t(), x, out=gw)
                sink.commit(start, stop, gw, gb)
    return grad_x


def row_losses(
    lse: torch.Tensor,
    z_target: torch.Tensor,
    z_sum: torch.Tensor | None,
    valid: torch.Tensor,
    *,
    num_classes: int,
    label_smoothing: float,
) -> torch.Tensor:
    """Per-row loss ``(1-eps) * (lse - z_y) + eps * (lse - mean(z))``, 0 on ignored rows."""
    loss = lse - z_target
    if label_smoothing > 0:
        assert z_sum is not None
        smooth = lse - z_sum / num_classes
        loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
    return torch.where(valid, loss, torch.zeros_like(loss))


def reduce_loss(
    rows: torch.Tensor, valid: torch.Tensor, reduction: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce per-row losses like ``F.cross_entropy``; also return the valid-row count."""
    n_valid = valid.sum().to(rows.dtype)
    if reduction == "none":
        return rows, n_valid
    total = rows.sum()
    # "mean" divides by the number of non-ignored rows (nan when there are none), which is
    # what F.cross_entropy does, label smoothing included.
    return (total / n_valid if reduction == "mean" else total), n_valid


def row_scale(
    grad_out: torch.Tensor, valid: torch.Tensor, n_valid: torch.Tensor, reduction: str
) -> torch.Tensor:
    """Per-row factor of d(loss)/d(row loss) times the incoming gradient; 0 on ignored rows."""
    if reduction == "none":
        g = grad_out.reshape(-1).to(n_valid.dtype)
    elif reduction == "mean":
        g = (grad_out.to(n_valid.dtype) / n_valid).expand(valid.shape)
    else:
        g = grad_out.to(n_valid.dtype).expand(valid.shape)
    return torch.where(valid, g, torch.zeros_like(g))


# ---------------------------------------------------------------------------------------------
# autograd


def _refuse_double_backward(what: str, dense: str) -> None:
    """Raise when a backward runs with grad mode on, that is under ``create_graph=True``."""
    # The passes write into reused buffers (``out=``, in-place exp), which autograd cannot
    # differentiate; without this check a double backward fails deep inside with "addmm():
    # functions with out=... arguments don't support automatic differentiation", which names
    # neither the cause nor the fix.
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{what} does not support double backward: a backward with create_graph=True (a "
            "gradient penalty through the loss, a Hessian-vector product) ran through it, and "
            "its sliced backward is not differentiable. Compute such a penalty on "
            f"{dense} (it materializes the batch x classes logits), or take the penalty of "
            "another term; a plain backward (create_graph=False) is supported"
        )


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        slice_size: int,
        ignore_index: int,
        label_smoothing: float,
        reduction: str,
        accum_dtype: torch.dtype,
        prefetch: int,
    ) -> torch.Tensor:
        lead_shape = target.shape
        x2 = x.reshape(-1, x.shape[-1])
        t = target.reshape(-1).long()
        xa = x2.to(accum_dtype)
        source = TensorSlices(weight, bias, device=x.device, dtype=accum_dtype,
                              prefetch=prefetch)
        targets = OneHot(t)
        row_max, row_sum, z_sum = lse_pass(
            xa, source, targets, slice_size=slice_size, want_logit_sum=label_smoothing > 0
        )
        valid = t != ignore_index
        rows = row_losses(log_sum_exp(row_max, row_sum), targets.logits, z_sum, valid,
                          num_classes=weight.shape[0], label_smoothing=label_smoothing)
        loss, n_valid = reduce_loss(rows, valid, reduction)
        ctx.save_for_backward(x, weight, bias, t, row_max, row_sum, n_valid)
        ctx.opts = (slice_size, ignore_index, label_smoothing, reduction, accum_dtype, prefetch)
        if reduction == "none":
            loss = loss.reshape(lead_shape)
        return loss.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        _refuse_double_backward(
            "linear_cross_entropy", "F.cross_entropy(x @ weight.T + bias, target)"
        )
        x, weight, bias, t, row_max, row_sum, n_valid = ctx.saved_tensors
        slice_size, ignore_index, label_smoothing, reduction, accum_dtype, prefetch = ctx.opts
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        valid = t != ignore_index
        scale = row_scale(grad_out, valid, n_valid, reduction)
        x2 = x.reshape(-1, x.shape[-1])
        xa = x2.to(accum_dtype)
        source = TensorSlices(weight, bias, device=x.device, dtype=accum_dtype,
                              prefetch=prefetch)
        need_b = need_b and bias is not None
        sink = None
        if need_w or need_b:
            sink = TensorGradSink(
                weight, bias if need_b else None, device=x.device, dtype=accum_dtype,
                need_weight=need_w, prefetch=prefetch,
            )
        with landing(sink):
            grad_x = grad_pass(
                xa, source, OneHot(t), row_max, row_sum, scale, slice_size=slice_size,
                label_smoothing=label_smoothing, need_x=need_x, sink=sink, need_weight=need_w,
                need_bias=need_b,
            )
        gx = None if grad_x is None else grad_x.to(x.dtype).reshape(x.shape)
        gw = None if sink is None else sink.grad_weight
        gb = None if sink is None else sink.grad_bias
        return gx, gw, gb, None, None, None, None, None, None, None


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    slice_size: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    accum_dtype: torch.dtype = torch.float32,
    prefetch: int = 1,
) -> torch.Tensor:
    """Exact ``F.cross_entropy(x @ weight.T + bias, target)`` without the ``B x C`` logits.

    The classes are processed in slices: a forward pass keeps an online log-sum-exp, and backward
    recomputes each slice's logits to form the exact gradients of ``x``, ``weight`` and ``bias``.
    Peak extra memory is one ``B x slice_size`` buffer plus a few ``B``- and ``B x D``-sized
    tensors, whatever the number of classes.

    Args:
        x: ``(..., D)`` features, on the compute device.
        weight: ``(C, D)`` class weights, on ``x``'s device, or in host memory while ``x`` is on
            an accelerator (then slices are streamed to the device in both passes, the next
            ``prefetch`` copied on a side stream while the current one computes, and the weight
            gradient streams back to host memory the same way).
        target: ``x.shape[:-1]`` integer class indices in ``[0, C)`` or ``ignore_index``.
        bias: optional ``(C,)``, same device and dtype as ``weight``.
        slice_size: classes per slice. ``None`` picks one from a logits budget
            (:data:`DEFAULT_LOGITS_BUDGET`, capped at a cache-friendly few thousand classes).
            Larger slices cost more memory and do not speed up the matrix products; very small
            slices (below a few hundred) make the products inefficient.
        ignore_index: target value whose rows contribute neither loss nor gradient.
        label_smoothing: ``eps`` in ``[0, 1]``, as in ``F.cross_entropy``: the target becomes
            ``(1 - eps) * onehot + eps / C``.
        reduction: ``"mean"`` (over non-ignored rows), ``"sum"`` or ``"none"`` (shape of target).
        accum_dtype: dtype of logits, softmax and gradient accumulation. With bf16/fp16 inputs the
            default fp32 keeps the loss and gradients accurate at the cost of upcasting each
            weight slice; the returned loss and gradients have the input dtype.
        prefetch: with a host weight on an accelerator, how many slices are copied ahead of
            the one computing. ``1`` hides each copy behind one slice of compute; deeper
            absorbs uneven copy or compute times at one more slice of device memory (and of
            page-locked staging, for a weight that is not pinned) per step; ``0`` does not
            overlap. Ignored when the weight is on ``x``'s device.

    Returns:
        The loss, a scalar or (``reduction="none"``) shaped like ``target``, in ``x``'s dtype.

    Raises:
        TypeError: ``target`` not an integer tensor; ``x``/``weight`` dtypes differ.
        ValueError: labels outside ``[0, C)`` (other than ``ignore_index``), feature sizes that
            disagree, wrong shapes, bad options. All checked before any compute.
        RuntimeError: from backward, when it runs with ``create_graph=True`` (double backward,
            e.g. a gradient penalty through the loss), which is not supported: use
            ``F.cross_entropy`` on dense logits for that term.

    Example:
        >>> x = torch.randn(8, 16, requires_grad=True)
        >>> w = torch.randn(1000, 16, requires_grad=True)
        >>> y = torch.randint(0, 1000, (8,))
        >>> loss = linear_cross_entropy(x, w, y, slice_size=256)
        >>> loss.backward()
    """
    _check_inputs(
        x, weight, target, bias, ignore_index=ignore_index, label_smoothing=label_smoothing,
        reduction=reduction, accum_dtype=accum_dtype, slice_size=slice_size, prefetch=prefetch,
    )
    batch = math.prod(target.shape)
    num_classes = weight.shape[0]
    if slice_size is None:
        slice_size = pick_slice_size(batch, num_classes, accum_dtype=accum_dtype)
    slice_size = max(1, min(slice_size, num_classes))
    return _LinearCrossEntropy.apply(
        x, weight, bias, target, slice_size, ignore_index, float(label_smoothing), reduction,
        accum_dtype, prefetch,
    )
