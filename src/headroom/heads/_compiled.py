"""`linear_cross_entropy` and `linear_loss` inside ``torch.compile``: one opaque operator each.

The passes loop over slices in Python, write into reused buffers and look at the labels' values,
none of which a graph can hold; so each function becomes a custom operator running the eager
forward and backward functions (the sliced path's backward recomputes the forward).

NOTE: each operator's name ends with a fingerprint of this file and of its options' schema:
inductor's on-disk caches key a graph by operator names, not fake kernels, and would load a
graph compiled against an older fake kernel after an upgrade.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import torch
from torch import Tensor

from headroom.heads import _linear_ce as lce
from headroom.heads import _linear_loss as ll
from headroom.heads._slices import TensorParams

__all__ = ["compiled_linear_cross_entropy", "compiled_linear_loss"]

def _fingerprint(schema: str) -> str:
    try:
        text = Path(__file__).read_bytes()
    except OSError:  # no source beside the module (a zipped install)
        from headroom import __version__ as text  # type: ignore[assignment]
        text = str(text).encode()
    return hashlib.sha256(text + schema.encode()).hexdigest()[:12]


# `CrossEntropyOptions` as the operator's plain arguments, one per field in its order
_SCHEMA_TYPES = {"int": "int", "int | None": "int?", "float": "float", "float | None": "float?",
                 "str": "str", "bool": "bool", "torch.Tensor | None": "Tensor?",
                 "torch.dtype | None": "ScalarType?"}
_FIELDS = [f.name for f in dataclasses.fields(lce.CrossEntropyOptions)]
_OPTIONS = ", ".join(f"{_SCHEMA_TYPES[str(f.type)]} {f.name}"
                     for f in dataclasses.fields(lce.CrossEntropyOptions))
# ``needs``: whether x, weight and bias want a gradient, and whether to take the one-pass path
_ARGS = f"Tensor x, Tensor weight, Tensor target, Tensor? bias, {_OPTIONS}, bool[] needs"

_TAG = _fingerprint(_OPTIONS)


def _to_args(opts: lce.CrossEntropyOptions) -> tuple:
    return tuple(getattr(opts, name) for name in _FIELDS)


def _options(args: tuple) -> tuple[lce.CrossEntropyOptions, list[bool]]:
    return lce.CrossEntropyOptions(*args[:len(_FIELDS)]), args[len(_FIELDS)]


def _dense(t: Tensor) -> Tensor:
    """A fake gradient of ``t``: contiguous, as the real ones are (inductor asserts strides)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _fake_grads(x: Tensor, weight: Tensor, bias: Tensor | None, needs: list[bool]
                ) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(x.new_empty(0) if t is None or not need else _dense(t)
                 for t, need in zip((x, weight, bias), needs[:3], strict=True))


def _real(x: Tensor, ts: tuple) -> tuple:
    """Outputs as the fake kernels give them: contiguous, ``None`` an empty tensor."""
    return tuple(x.new_empty(0) if t is None else t.contiguous() for t in ts)


def _plan(x, weight, target, opts, needs) -> lce.Planned:
    """The labels' checks and the plan, with the path chosen outside (``needs[3]``)."""
    # NOTE: shapes, dtypes and devices were checked where the operator is called
    target = lce.check_labels(x, target, opts, num_classes=weight.shape[0])
    return lce.plan(x, target, opts, num_classes=weight.shape[0], one_pass=needs[3])


def _forward_impl(x, weight, target, bias, *args):
    opts, needs = _options(args)
    p = _plan(x, weight, target, opts, needs)
    if p.chunk is not None:
        # as eager: the gradients (for an incoming gradient of 1) formed with the loss
        fwd, gx, gw, gb = lce.rows_forward(p.x, weight, bias, p.target, p.opts, rows=p.chunk,
                                           needs=tuple(needs[:3]))
        grads = (lce.rows_grad(gx, p.keep, x.shape), gw, gb)
    else:
        fwd = lce.sliced_forward(p.x, p.target, _params(weight, bias, x, p.opts), p.opts)
        grads = (None, None, None)
    out = p.all_rows(lce.outputs(fwd, p.opts, p.target.shape))
    asked = (True, opts.return_lse, opts.return_accuracy, opts.return_predictions)
    return _real(x, (*(t if want else None for t, want in zip(out, asked, strict=True)), *grads))


def _params(weight, bias, x, opts) -> TensorParams:
    return TensorParams(weight, bias, device=x.device, dtype=opts.accum_dtype,
                        prefetch=opts.prefetch)


_forward = torch.library.custom_op(
    f"headroom::linear_cross_entropy_{_TAG}", _forward_impl, mutates_args=(),
    schema=f"({_ARGS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


@_forward.register_fake
def _(x, weight, target, bias, *args):
    opts, needs = _options(args)
    rows = list(target.shape)
    if opts.shift:
        rows[-1] -= opts.shift
    empty = x.new_empty(0)
    dt = opts.loss_dtype
    loss = x.new_empty(rows if opts.reduction == "none" else [], dtype=dt)
    lse = x.new_empty(rows, dtype=dt) if opts.return_lse else empty
    acc = x.new_empty([], dtype=dt) if opts.return_accuracy else empty
    pred = x.new_empty(rows, dtype=torch.int64) if opts.return_predictions else empty
    grads = _fake_grads(x, weight, bias, needs) if needs[3] else (empty,) * 3
    return loss, lse, acc, pred, *grads


def _backward_impl(grad_loss, grad_lse, x, weight, target, bias, *args):
    """The eager backward on a recomputed forward."""
    opts, needs = _options(args)
    grad_lse = grad_lse if opts.return_lse else None  # else the gradient of a placeholder
    p = _plan(x, weight, target, opts, needs)
    params = _params(weight, bias, x, p.opts)
    fwd = lce.sliced_forward(p.x, p.target, params, p.opts)
    gx, gw, gb = lce.sliced_backward(p.x, p.target, params, fwd[4:], (grad_loss, grad_lse),
                                     p.opts, tuple(needs[:3]))
    return _real(x, (lce.rows_grad(gx, p.keep, x.shape), gw, gb))


_backward = torch.library.custom_op(
    f"headroom::linear_cross_entropy_backward_{_TAG}", _backward_impl, mutates_args=(),
    schema=f"(Tensor? grad_loss, Tensor? grad_lse, {_ARGS}) -> (Tensor, Tensor, Tensor)")


@_backward.register_fake
def _(grad_loss, grad_lse, x, weight, target, bias, *args):
    return _fake_grads(x, weight, bias, _options(args)[1])


def _setup(ctx, inputs: tuple, output: tuple) -> None:
    """Keep an operator's inputs and the gradients its forward formed (its last three outputs)."""
    # NOTE: tensors go through save_for_backward (a compiled graph's backward gets them only
    # so); ctx keeps the other inputs
    ctx.is_tensor = [isinstance(a, Tensor) for a in inputs]
    ctx.inputs = [None if t else a for a, t in zip(inputs, ctx.is_tensor, strict=True)]
    ctx.save_for_backward(*(a for a in inputs if isinstance(a, Tensor)), *output[-3:])


def _grads(ctx, grad: Tensor, backward) -> tuple:
    """The gradients of ``(x, weight, bias)`` for ``grad``: those the forward formed, scaled
    (as eager's one-pass path), or ``backward(*inputs)``'s."""
    saved = iter(ctx.saved_tensors)
    inputs = [next(saved) if t else a for a, t in zip(ctx.inputs, ctx.is_tensor, strict=True)]
    needs = inputs[-1]
    if needs[3]:
        return lce.scale_grads(tuple(saved), grad, tuple(needs[:3]), in_place=False)
    return tuple(g if want else None
                 for g, want in zip(backward(*inputs), needs[:3], strict=True))


def _grad(ctx, grad_loss, grad_lse, _acc, _pred, _gx, _gw, _gb):
    gx, gw, gb = _grads(ctx, grad_loss, lambda *inputs: _backward(grad_loss, grad_lse, *inputs))
    return (gx, gw, None, gb) + (None,) * (len(ctx.inputs) - 4)


_forward.register_autograd(_grad, setup_context=_setup)


def compiled_linear_cross_entropy(
    x: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None,
    opts: lce.CrossEntropyOptions,
) -> Tensor | lce.LinearCrossEntropyOutput:
    """`linear_cross_entropy` as the operator, after `checked` and `check_linear`; the labels'
    values are checked inside it."""
    lce.check_label_shape(target, x, names=("target", "x"))
    grad = torch.is_grad_enabled()
    needs = [grad and t is not None and t.requires_grad for t in (x, weight, bias)]
    one = lce.one_pass(x, weight, bias, opts, batch=math.prod(target.shape))
    out = _forward(x, weight, target, bias, *_to_args(opts), [*needs, one])
    return opts.returned(out[:4])


# ---------------------------------------------------------------------------------------------
# linear_loss


def _ml_call(x, weight, offsets, indices, values, bias, pos_weight_t, pos_weight_f,
             ignore_rows, loss, reduction, slice_size, accum_dtype, prefetch, needs
             ) -> ll.MultilabelCall:
    """The plan of the call, the labels' checks with it (`linear_loss` checked the rest)."""
    targets = (offsets, indices) if values is None else (offsets, indices, values)
    pos_weight = pos_weight_t if pos_weight_t is not None else pos_weight_f
    params = TensorParams(weight, bias, device=x.device, dtype=accum_dtype, prefetch=prefetch)
    return ll.multilabel_call(
        x, weight, bias, targets, params, num_classes=weight.shape[0], loss=loss,
        pos_weight=pos_weight, reduction=reduction, slice_size=slice_size or None,
        ignore_rows=ignore_rows, accum_dtype=accum_dtype, grads=any(needs[:3]))


@torch.library.custom_op(f"headroom::linear_loss_{_TAG}", mutates_args=())
def _ml_forward(
    x: Tensor, weight: Tensor, offsets: Tensor, indices: Tensor, values: Tensor | None,
    bias: Tensor | None, pos_weight_t: Tensor | None, pos_weight_f: float | None,
    ignore_rows: Tensor | None, loss: str, reduction: str, slice_size: int,
    accum_dtype: torch.dtype, prefetch: int, needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    c = _ml_call(x, weight, offsets, indices, values, bias, pos_weight_t, pos_weight_f,
                 ignore_rows, loss, reduction, slice_size, accum_dtype, prefetch, needs)
    out, grads, _, _ = ll.loss_forward(c.x, c.params, c.plan, tuple(needs[:3]))
    if grads is None:
        grads = (None, None, None)
    else:  # as eager: formed in forward, for an incoming gradient of 1
        gx = None if grads[0] is None else grads[0].to(x.dtype)
        grads = (lce.rows_grad(gx, c.keep, x.shape), *grads[1:])
    return _real(x, (c.all_rows(out), *grads))  # type: ignore[return-value]


@_ml_forward.register_fake
def _(x, weight, offsets, indices, values, bias, pos_weight_t, pos_weight_f, ignore_rows, loss,
      reduction, slice_size, accum_dtype, prefetch, needs):
    out = x.new_empty(list(x.shape[:-1]) if reduction == "none" else [])
    empty = x.new_empty(0)
    return out, *(_fake_grads(x, weight, bias, needs) if needs[3] else (empty,) * 3)


@torch.library.custom_op(f"headroom::linear_loss_backward_{_TAG}", mutates_args=())
def _ml_backward(
    grad: Tensor, x: Tensor, weight: Tensor, offsets: Tensor, indices: Tensor,
    values: Tensor | None, bias: Tensor | None, pos_weight_t: Tensor | None,
    pos_weight_f: float | None, ignore_rows: Tensor | None, loss: str, reduction: str,
    slice_size: int, accum_dtype: torch.dtype, prefetch: int, needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    c = _ml_call(x, weight, offsets, indices, values, bias, pos_weight_t, pos_weight_f,
                 ignore_rows, loss, reduction, slice_size, accum_dtype, prefetch, needs)
    wanted = tuple(needs[:3])
    _, _, row_max, row_sum = ll.loss_forward(c.x, c.params, c.plan, wanted)
    if c.keep is not None and grad.dim() > 0:
        grad = grad.reshape(-1)[c.keep]  # reduction="none": the rows kept
    _, (gx, gw, gb) = ll.loss_backward(c.x, c.params, c.plan, (row_max, row_sum), grad, wanted)
    gx = lce.rows_grad(None if gx is None else gx.to(x.dtype), c.keep, x.shape)
    return _real(x, (gx, gw, gb))  # type: ignore[return-value]


@_ml_backward.register_fake
def _(grad, x, weight, offsets, indices, values, bias, pos_weight_t, pos_weight_f, ignore_rows,
      loss, reduction, slice_size, accum_dtype, prefetch, needs):
    return _fake_grads(x, weight, bias, needs)


def _ml_grad(ctx, grad, _gx, _gw, _gb):
    gx, gw, gb = _grads(ctx, grad, lambda *inputs: _ml_backward(grad, *inputs))
    return (gx, gw, None, None, None, gb) + (None,) * 9


_ml_forward.register_autograd(_ml_grad, setup_context=_setup)


def compiled_linear_loss(
    x: Tensor, weight: Tensor, targets: object, *, loss: object, bias: Tensor | None,
    pos_weight: float | Tensor | None, reduction: str, slice_size: int | None,
    ignore_rows: Tensor | None, accum_dtype: torch.dtype, prefetch: int,
) -> Tensor:
    """`linear_loss` as the operator: built-in losses and CSR targets of tensors."""
    if not isinstance(loss, str):
        raise TypeError(
            "linear_loss with a loss function does not compile (the function runs once per "
            "slice inside the loss): give a built-in loss name, or keep the call out of the "
            "compiled region (torch.compiler.disable)")
    if not (isinstance(targets, tuple) and len(targets) in (2, 3)
            and all(isinstance(t, Tensor) for t in targets)):
        raise TypeError(
            "under torch.compile, linear_loss takes targets as a CSR tuple of tensors "
            "(offsets, indices) or (offsets, indices, values); convert other forms before "
            "the compiled region")
    offsets, indices, values = (*targets, None)[:3]
    grad = torch.is_grad_enabled()
    needs = [grad and t is not None and t.requires_grad for t in (x, weight, bias)]
    one = any(needs) and reduction != "none" and loss not in ("softmax", "softmax_sum")
    pw_t = pos_weight if isinstance(pos_weight, Tensor) else None
    pw_f = None if pos_weight is None or pw_t is not None else float(pos_weight)
    out = _ml_forward(x, weight, offsets, indices, values, bias, pw_t, pw_f, ignore_rows, loss,
                      reduction, slice_size or 0, accum_dtype, prefetch, [*needs, one])
    return out[0]
