"""`linear_cross_entropy` and `linear_loss` inside ``torch.compile``: one opaque operator each.

The passes loop over class slices in Python, write into reused buffers and look at the labels'
values (checks, dropping ignored rows), none of which a graph can hold. Under compilation each
function therefore becomes a custom operator (``headroom::linear_cross_entropy``,
``headroom::linear_loss``) that runs the eager code, so ``torch.compile(fullgraph=True)`` keeps
one graph and the numbers are the eager ones: its forward runs the eager forward, and its
backward either scales the gradients the forward formed (the one-pass path, as eager does) or
runs the eager backward on a recomputed forward (the sliced path: one product per slice more
than eager). The autograd Functions are called directly (`Direct`): autograd does not record
inside an operator's implementation.

Each operator's name ends with a fingerprint of this file (``headroom::linear_loss_<hex>``).
Inductor's and AOTAutograd's on-disk caches key a compiled graph by the names of its operators,
not by their fake kernels: under a fixed name, a graph compiled against an older fake kernel
(other output strides, say) would be loaded after an upgrade and fail inductor's stride check.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from torch import Tensor

from headroom.heads import _linear_ce as lce
from headroom.heads import _linear_loss as ll

__all__ = ["compiled_linear_cross_entropy", "compiled_linear_loss"]

def _fingerprint() -> str:
    try:
        text = Path(__file__).read_bytes()
    except OSError:  # no source beside the module (a zipped install): the version stands in
        from headroom import __version__ as text  # type: ignore[assignment]
        text = str(text).encode()
    return hashlib.sha256(text).hexdigest()[:12]


_TAG = _fingerprint()

# option slots of the operator's ``flags`` argument
_LSE, _ACC, _PRED, _NEED_X, _NEED_W, _NEED_B, _ONE_PASS = range(7)


def _dense(t: Tensor) -> Tensor:
    """A fake gradient of ``t``: contiguous whatever ``t``'s strides, as the real ones are (a
    fake output's strides must match the real output's, which inductor asserts)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _eager(x, weight, target, bias, class_weight, slice_size, ignore_index, label_smoothing,
           reduction, softcap, shift, z_loss, flags, loss_dtype, accum_dtype, prefetch):
    """The eager call, its autograd Function run by a `Direct` (autograd does not record in
    an operator's implementation)."""
    direct = lce.Direct((flags[_NEED_X], flags[_NEED_W], flags[_NEED_B] and bias is not None),
                        one_pass=flags[_ONE_PASS])
    out = lce._linear_cross_entropy(
        x, weight, target, bias, slice_size=slice_size or None, ignore_index=ignore_index,
        label_smoothing=label_smoothing, reduction=reduction, softcap=softcap, shift=shift,
        z_loss=z_loss, class_weight=class_weight, return_lse=flags[_LSE],
        return_accuracy=flags[_ACC], return_predictions=flags[_PRED], loss_dtype=loss_dtype,
        accum_dtype=accum_dtype, prefetch=prefetch, direct=direct)
    if not isinstance(out, lce.LinearCrossEntropyOutput):
        out = lce.LinearCrossEntropyOutput(out)
    return out, direct


@torch.library.custom_op(f"headroom::linear_cross_entropy_{_TAG}", mutates_args=())
def _forward(
    x: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, class_weight: Tensor | None,
    slice_size: int, ignore_index: int, label_smoothing: float, reduction: str,
    softcap: float | None, shift: int, z_loss: float, flags: list[bool], loss_dtype: torch.dtype,
    accum_dtype: torch.dtype, prefetch: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    args = (x, weight, target, bias, class_weight, slice_size, ignore_index, label_smoothing,
            reduction, softcap, shift, z_loss, flags, loss_dtype, accum_dtype, prefetch)
    out, direct = _eager(*args)
    grads: tuple = (None, None, None)
    if flags[_ONE_PASS]:
        # as eager: the gradients (for an incoming gradient of 1) formed with the loss
        grads = direct.backward((torch.ones_like(out.loss), None, None, None), x.shape)
    # placeholders for what is not asked for (an operator's outputs may not alias)
    return tuple(x.new_empty(0) if t is None or (i in (1, 2, 3) and not flags[i - 1])
                 else t.contiguous()  # as the fake outputs (a shifted one is a view)
                 for i, t in enumerate((*out, *grads)))  # type: ignore[return-value]


def _shifted(target: Tensor, shift: int) -> list:
    shape = list(target.shape)
    if shift:
        shape[-1] -= shift
    return shape


@_forward.register_fake
def _(x, weight, target, bias, class_weight, slice_size, ignore_index, label_smoothing,
      reduction, softcap, shift, z_loss, flags, loss_dtype, accum_dtype, prefetch):
    rows = _shifted(target, shift)
    empty = x.new_empty(0)
    loss = x.new_empty(rows if reduction == "none" else [], dtype=loss_dtype)
    lse = x.new_empty(rows, dtype=loss_dtype) if flags[_LSE] else empty
    acc = x.new_empty([], dtype=loss_dtype) if flags[_ACC] else empty
    pred = x.new_empty(rows, dtype=torch.int64) if flags[_PRED] else empty
    one = flags[_ONE_PASS]
    gx = _dense(x) if one and flags[_NEED_X] else empty
    gw = _dense(weight) if one and flags[_NEED_W] else empty
    gb = _dense(bias) if one and flags[_NEED_B] and bias is not None else empty
    return loss, lse, acc, pred, gx, gw, gb


@torch.library.custom_op(f"headroom::linear_cross_entropy_backward_{_TAG}", mutates_args=())
def _backward(
    grad_loss: Tensor | None, grad_lse: Tensor | None, x: Tensor, weight: Tensor, target: Tensor,
    bias: Tensor | None, class_weight: Tensor | None, slice_size: int, ignore_index: int,
    label_smoothing: float, reduction: str, softcap: float | None, shift: int, z_loss: float,
    flags: list[bool], loss_dtype: torch.dtype, accum_dtype: torch.dtype, prefetch: int,
) -> tuple[Tensor, Tensor, Tensor]:
    args = (x, weight, target, bias, class_weight, slice_size, ignore_index, label_smoothing,
            reduction, softcap, shift, z_loss, flags, loss_dtype, accum_dtype, prefetch)
    _, direct = _eager(*args)
    got = direct.backward((grad_loss, grad_lse, None, None), x.shape)
    return tuple(x.new_empty(0) if g is None else g.contiguous()  # as the fake ones
                 for g in got)  # type: ignore[return-value]


@_backward.register_fake
def _(grad_loss, grad_lse, x, weight, target, bias, class_weight, slice_size, ignore_index,
      label_smoothing, reduction, softcap, shift, z_loss, flags, loss_dtype, accum_dtype,
      prefetch):
    empty = x.new_empty(0)
    return (_dense(x) if flags[_NEED_X] else empty,
            _dense(weight) if flags[_NEED_W] else empty,
            _dense(bias) if flags[_NEED_B] and bias is not None else empty)


_OPTIONS = ("slice_size", "ignore_index", "label_smoothing", "reduction", "softcap", "shift",
            "z_loss", "flags", "loss_dtype", "accum_dtype", "prefetch")


def _setup(ctx, inputs, output) -> None:
    x, weight, target, bias, class_weight = inputs[:5]
    ctx.options = inputs[5:]
    ctx.save_for_backward(x, weight, target, bias, class_weight, *output[4:])
    ctx.x_shape = x.shape


def _grad(ctx, grad_loss, grad_lse, _acc, _pred, _gx, _gw, _gb):
    x, weight, target, bias, class_weight, gx, gw, gb = ctx.saved_tensors
    flags = ctx.options[_OPTIONS.index("flags")]
    if flags[_ONE_PASS]:
        # eager's backward of this path: the saved gradients times the incoming one
        scale = grad_loss.to(torch.float64)
        gx, gw, gb = (g * scale.to(g.dtype) if need else None
                      for g, need in ((gx, flags[_NEED_X]), (gw, flags[_NEED_W]),
                                      (gb, flags[_NEED_B] and bias is not None)))
    else:
        gx, gw, gb = _backward(grad_loss, grad_lse if flags[_LSE] else None, x, weight, target,
                               bias, class_weight, *ctx.options)
        gx = gx if flags[_NEED_X] else None
        gw = gw if flags[_NEED_W] else None
        gb = gb if flags[_NEED_B] and bias is not None else None
    return (gx, gw, None, gb) + (None,) * (1 + len(_OPTIONS))


_forward.register_autograd(_grad, setup_context=_setup)


def compiled_linear_cross_entropy(
    x: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, *, slice_size: int | None,
    ignore_index: int, label_smoothing: float, reduction: str, softcap: float | None,
    shift: bool | int, z_loss: float, class_weight: Tensor | None, return_lse: bool,
    return_accuracy: bool, return_predictions: bool, loss_dtype: torch.dtype | None,
    accum_dtype: torch.dtype, prefetch: int,
) -> Tensor | lce.LinearCrossEntropyOutput:
    """`linear_cross_entropy` as the operator; the checks of shapes and options run here, those
    of the labels' values inside the operator (they raise from it as in eager)."""
    num_classes = weight.shape[0] if weight.dim() == 2 else 0
    shift = lce.check_options(num_classes=num_classes, softcap=softcap, z_loss=z_loss,
                              shift=shift, class_weight=class_weight, loss_dtype=loss_dtype)
    lce.check_linear(x, weight, bias, reduction=reduction, accum_dtype=accum_dtype,
                     slice_size=slice_size, prefetch=prefetch)
    lce.check_label_shape(target, x, names=("target", "x"))
    grad = torch.is_grad_enabled()
    needs = [grad and t is not None and t.requires_grad for t in (x, weight, bias)]
    one = lce.one_pass(x, weight, bias, batch=math.prod(target.shape),
                       auto_slices=slice_size is None, reduction=reduction,
                       return_lse=return_lse, softcap=softcap, accum_dtype=accum_dtype)
    flags = [return_lse, return_accuracy, return_predictions, *needs, one]
    cw = None if class_weight is None else class_weight.detach()
    out = _forward(x, weight, target, bias, cw, slice_size or 0, ignore_index,
                   float(label_smoothing), reduction, None if softcap is None else float(softcap),
                   shift, float(z_loss), flags, lce.default_loss_dtype(x.dtype, loss_dtype),
                   accum_dtype, prefetch)
    loss, lse, acc, pred = out[:4]
    return lce.wrap_outputs((loss, lse, acc, pred), return_lse=return_lse,
                            return_accuracy=return_accuracy,
                            return_predictions=return_predictions)


# ---------------------------------------------------------------------------------------------
# linear_loss


def _eager_ml(x, weight, offsets, indices, values, bias, pos_weight_t, pos_weight_f,
              ignore_rows, loss, reduction, slice_size, accum_dtype, prefetch, needs):
    direct = lce.Direct((needs[0], needs[1], needs[2] and bias is not None), one_pass=False)
    targets = (offsets, indices) if values is None else (offsets, indices, values)
    pos_weight = pos_weight_t if pos_weight_t is not None else pos_weight_f
    params = ll.TensorParams(weight, bias, device=x.device, dtype=accum_dtype,
                             prefetch=prefetch)
    lce.check_linear(x, weight, bias, reduction=reduction, accum_dtype=accum_dtype,
                     slice_size=slice_size or None, prefetch=prefetch)
    out = ll.multilabel_loss(
        x, weight, bias, targets, params, num_classes=weight.shape[0], loss=loss,
        pos_weight=pos_weight, reduction=reduction, slice_size=slice_size or None,
        ignore_rows=ignore_rows, accum_dtype=accum_dtype, direct=direct)
    return out, direct


def _ml_grads(direct, grad: Tensor, x: Tensor) -> tuple:
    if direct.keep is not None and grad.dim() > 0:
        grad = grad.reshape(-1)[direct.keep]  # reduction="none": the rows kept
    return direct.backward((grad,), x.shape)


@torch.library.custom_op(f"headroom::linear_loss_{_TAG}", mutates_args=())
def _ml_forward(
    x: Tensor, weight: Tensor, offsets: Tensor, indices: Tensor, values: Tensor | None,
    bias: Tensor | None, pos_weight_t: Tensor | None, pos_weight_f: float | None,
    ignore_rows: Tensor | None, loss: str, reduction: str, slice_size: int,
    accum_dtype: torch.dtype, prefetch: int, needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out, direct = _eager_ml(x, weight, offsets, indices, values, bias, pos_weight_t,
                            pos_weight_f, ignore_rows, loss, reduction, slice_size,
                            accum_dtype, prefetch, needs)
    grads: tuple = (None, None, None)
    if needs[3]:
        # as eager: the gradients formed in forward, for an incoming gradient of 1
        grads = _ml_grads(direct, torch.ones_like(out), x)
    return tuple(x.new_empty(0) if t is None else t.contiguous()
                 for t in (out, *grads))  # type: ignore[return-value]


@_ml_forward.register_fake
def _(x, weight, offsets, indices, values, bias, pos_weight_t, pos_weight_f, ignore_rows, loss,
      reduction, slice_size, accum_dtype, prefetch, needs):
    out = x.new_empty(list(x.shape[:-1]) if reduction == "none" else [])
    one = needs[3]
    return (out, _dense(x) if one and needs[0] else x.new_empty(0),
            _dense(weight) if one and needs[1] else x.new_empty(0),
            _dense(bias) if one and needs[2] and bias is not None else x.new_empty(0))


@torch.library.custom_op(f"headroom::linear_loss_backward_{_TAG}", mutates_args=())
def _ml_backward(
    grad: Tensor, x: Tensor, weight: Tensor, offsets: Tensor, indices: Tensor,
    values: Tensor | None, bias: Tensor | None, pos_weight_t: Tensor | None,
    pos_weight_f: float | None, ignore_rows: Tensor | None, loss: str, reduction: str,
    slice_size: int, accum_dtype: torch.dtype, prefetch: int, needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    _, direct = _eager_ml(x, weight, offsets, indices, values, bias, pos_weight_t,
                          pos_weight_f, ignore_rows, loss, reduction, slice_size, accum_dtype,
                          prefetch, needs)
    got = _ml_grads(direct, grad, x)
    return tuple(x.new_empty(0) if g is None else g.contiguous()  # as the fake ones
                 for g in got)  # type: ignore[return-value]


@_ml_backward.register_fake
def _(grad, x, weight, offsets, indices, values, bias, pos_weight_t, pos_weight_f, ignore_rows,
      loss, reduction, slice_size, accum_dtype, prefetch, needs):
    return (_dense(x) if needs[0] else x.new_empty(0),
            _dense(weight) if needs[1] else x.new_empty(0),
            _dense(bias) if needs[2] and bias is not None else x.new_empty(0))


def _ml_setup(ctx, inputs, output) -> None:
    ctx.pos_weight_f, ctx.inputs = inputs[7], inputs[9:]
    ctx.save_for_backward(*inputs[:7], inputs[8], *output[1:])


def _ml_grad(ctx, grad, _gx, _gw, _gb):
    *saved, ignore_rows, gx, gw, gb = ctx.saved_tensors
    saved += [ctx.pos_weight_f, ignore_rows]
    bias = saved[5]
    needs = ctx.inputs[-1]
    if needs[3]:
        # eager's backward of this path: the saved gradients times the incoming one
        gx, gw, gb = (g * grad.to(g.dtype) if want else None
                      for g, want in ((gx, needs[0]), (gw, needs[1]),
                                      (gb, needs[2] and bias is not None)))
    else:
        gx, gw, gb = _ml_backward(grad, *saved, *ctx.inputs)
        gx = gx if needs[0] else None
        gw = gw if needs[1] else None
        gb = gb if needs[2] and bias is not None else None
    return (gx, gw, None, None, None, gb) + (None,) * 9


_ml_forward.register_autograd(_ml_grad, setup_context=_ml_setup)


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
    lce.check_linear(x, weight, bias, reduction=reduction, accum_dtype=accum_dtype,
                     slice_size=slice_size, prefetch=prefetch)
    offsets, indices = targets[0], targets[1]
    values = targets[2] if len(targets) == 3 else None
    grad = torch.is_grad_enabled()
    needs = [grad and t is not None and t.requires_grad for t in (x, weight, bias)]
    one = any(needs) and reduction != "none" and loss not in ("softmax", "softmax_sum")
    pw_t = pos_weight if isinstance(pos_weight, Tensor) else None
    pw_f = None if pos_weight is None or pw_t is not None else float(pos_weight)
    out = _ml_forward(x, weight, offsets, indices, values, bias, pw_t, pw_f, ignore_rows, loss,
                      reduction, slice_size or 0, accum_dtype, prefetch, [*needs, one])
    return out[0]
