"""The public losses, `linear_cross_entropy` and `linear_loss`: the eager passes
(`_linear_ce`, `_linear_loss`) or, inside ``torch.compile``, one opaque operator each
(`_compiled`, which builds on the eager passes).
"""

from __future__ import annotations

import torch

from headroom.heads._linear_ce import (
    CrossEntropyOptions,
    LinearCrossEntropyOutput,
    check_linear,
    check_slicing,
    compute_dtype,
    linear_cross_entropy_eager,
)
from headroom.heads._linear_loss import SliceLoss, multilabel_loss
from headroom.heads._slices import TensorParams

__all__ = ["linear_cross_entropy", "linear_loss"]


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
    softcap: float | None = None,
    shift: bool | int = False,
    z_loss: float = 0.0,
    class_weight: torch.Tensor | None = None,
    return_lse: bool = False,
    return_accuracy: bool = False,
    return_predictions: bool = False,
    loss_dtype: torch.dtype | None = None,
    accum_dtype: torch.dtype | None = None,
    prefetch: int = 1,
) -> torch.Tensor | LinearCrossEntropyOutput:
    """Exact ``F.cross_entropy(x @ weight.T + bias, target)`` without the ``B x C`` logits.

    Peak extra memory: one ``B x slice_size`` buffer (two with ``softcap``) and a few ``B``- and
    ``B x D``-sized tensors, whatever ``C``. See docs/huge_classifier.md, "How it works",
    "Language models" and "torch.compile".

    Args:
        x: ``(..., D)`` features, on the compute device.
        weight: ``(C, D)``, on ``x``'s device, or in host memory while ``x`` is on an
            accelerator (slices stream there, ``prefetch`` ahead; the gradient streams back).
        target: ``x.shape[:-1]`` integer class indices in ``[0, C)`` or ``ignore_index``.
        bias: optional ``(C,)``, same device and dtype as ``weight``.
        slice_size: classes per slice; ``None``: from :data:`DEFAULT_LOGITS_BUDGET`, at most a
            few thousand. Larger costs memory without speeding up the products.
        ignore_index: target value whose rows contribute neither loss nor gradient.
        label_smoothing: ``eps`` in ``[0, 1]``, as in ``F.cross_entropy``.
        reduction: ``"mean"`` (over non-ignored rows), ``"sum"`` or ``"none"`` (shape of target;
            with ``shift``, without its last ``shift`` positions).
        softcap: the loss sees ``softcap * tanh(logits / softcap)``; ``None``: no cap.
        shift: ``True`` (or an int ``k``): row ``t`` of each sequence predicts ``target`` at
            ``t + k`` (the labels move, not ``x``); the last ``k`` positions predict nothing.
        z_loss: adds ``z_loss * lse**2`` per row not ignored (``"mean"``: divided by their
            count, also with ``class_weight``).
        class_weight: ``(C,)``, as ``weight=`` of ``F.cross_entropy`` (label smoothing's uniform
            part weighted per class too).
        return_lse: also return each row's log-sum-exp (differentiable).
        return_accuracy: also return the fraction of rows not ignored whose top logit is the target.
        return_predictions: also return each row's predicted class (-1 on ignored rows).
        loss_dtype: dtype of the loss (and lse); ``None``: float32 for float16/bfloat16 inputs,
            ``x``'s dtype otherwise (the loss accumulates in float64 either way).
        accum_dtype: dtype of logits, softmax and accumulation; ``None``: float32, float64 for
            float64 inputs. Gradients have the input dtype.
        prefetch: slices of a host weight copied ahead to the accelerator: ``1`` hides each copy,
            deeper absorbs uneven times at one slice of device memory (and page-locked staging for
            an unpinned weight) each, ``0`` does not overlap.

    Returns:
        The loss, a scalar or (``reduction="none"``) per row, in ``loss_dtype``. With any
        ``return_*`` flag, a `LinearCrossEntropyOutput` ``(loss, lse, accuracy, predictions)``
        (``None`` for what was not asked for).

    Raises:
        TypeError: ``target`` not an integer tensor; ``x``/``weight`` dtypes differ; a
            ``class_weight`` that is not a floating tensor.
        ValueError: labels outside ``[0, C)`` (other than ``ignore_index``), wrong shapes, bad
            options; all checked before any compute.
        RuntimeError: a backward with ``create_graph=True`` (e.g. a gradient penalty): use
            ``F.cross_entropy`` on dense logits for that term.

    Example:
        >>> x = torch.randn(8, 16, requires_grad=True)
        >>> w = torch.randn(1000, 16, requires_grad=True)
        >>> y = torch.randint(0, 1000, (8,))
        >>> loss = linear_cross_entropy(x, w, y, slice_size=256)
        >>> loss.backward()
        >>> h = torch.randn(2, 5, 16)                       # (batch, seq, features)
        >>> labels = torch.randint(0, 1000, (2, 5))
        >>> out = linear_cross_entropy(h, w, labels, shift=True, softcap=30.0, z_loss=1e-4,
        ...                            return_accuracy=True)
        >>> out.loss, out.accuracy
    """
    opts = CrossEntropyOptions(
        ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction,
        softcap=softcap, shift=shift, z_loss=z_loss, class_weight=class_weight,
        return_lse=return_lse, return_accuracy=return_accuracy,
        return_predictions=return_predictions, loss_dtype=loss_dtype, slice_size=slice_size,
        accum_dtype=accum_dtype, prefetch=prefetch,
    ).checked(num_classes=weight.shape[0] if weight.dim() == 2 else 0,
              dtype=getattr(x, "dtype", torch.float32))
    check_linear(x, weight, bias)
    if torch.compiler.is_compiling():
        # one opaque operator in the graph (the passes are data-dependent Python)
        from headroom.heads._compiled import compiled_linear_cross_entropy

        return compiled_linear_cross_entropy(x, weight, target, bias, opts)
    return linear_cross_entropy_eager(x, weight, target, bias, opts)


def linear_loss(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: object,
    *,
    loss: str | SliceLoss = "bce",
    bias: torch.Tensor | None = None,
    pos_weight: float | torch.Tensor | None = None,
    reduction: str = "mean",
    slice_size: int | None = None,
    ignore_rows: torch.Tensor | None = None,
    accum_dtype: torch.dtype | None = None,
    prefetch: int = 1,
) -> torch.Tensor:
    """Exact multi-label loss of ``x @ weight.T + bias`` without the ``B x C`` logits or targets.

    Equal to the loss on the full logits against the dense target ``T`` (1, or the given value,
    at the positives; 0 elsewhere), one slice of classes at a time. Peak extra memory: two
    ``B x slice_size`` buffers, the gradients of ``weight`` and ``x``, and a few ``B``- and
    ``nnz``-sized tensors. See docs/huge_classifier.md, "Multi-label and per-class losses" (each
    loss's formula, and the passes) and "torch.compile".

    Args:
        x: ``(..., D)`` features on the compute device.
        weight: ``(C, D)``, on ``x``'s device or in host memory while ``x`` is on an accelerator
            (slices then stream, as for `linear_cross_entropy`).
        targets: the positives of each row (of ``x.shape[:-1]`` flattened): CSR ``(offsets,
            indices)`` (row ``b``: ``indices[offsets[b]:offsets[b+1]]``), ``(offsets, indices,
            values)`` with a value per positive, a list of class-id tensors (one per row), or a
            ``torch.sparse_csr_tensor`` ``(rows, C)``. Any order; a class at most once per row.
        loss: ``"bce"``, ``"squared_hinge"``, ``"softmax"``, ``"softmax_sum"``, or a function
            ``fn(scores, targets, classes)`` called per slice with the ``B x S`` logits (in
            ``accum_dtype``, requiring grad), ``T``'s ``B x S`` slice (same dtype) and the
            slice's ``range`` of class ids, returning the slice's summed loss as a 0-d tensor that
            depends on that slice only. ``scores``/``targets`` are reused buffers, valid during
            the call.
        bias: optional ``(C,)``, same device and dtype as ``weight``.
        pos_weight: weight of the positive term of ``"bce"``/``"squared_hinge"``: a float or a
            ``(C,)`` tensor, as in ``F.binary_cross_entropy_with_logits`` (not differentiated).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-row sums, shape ``x.shape[:-1]``).
            ``"mean"`` divides as PyTorch's dense loss does: by counted rows x ``C`` for
            ``"bce"``/``"squared_hinge"``, by counted rows otherwise.
        slice_size: classes per slice; ``None``: from `DEFAULT_LOGITS_BUDGET`, at most a few
            thousand.
        ignore_rows: optional bool tensor shaped like ``x.shape[:-1]``: ``True`` rows contribute
            neither loss nor gradient (nor count for ``"mean"``).
        accum_dtype: dtype of logits, loss and accumulation; ``None``: float32, float64 for
            float64 inputs. Results in ``x``'s dtype.
        prefetch: slices copied ahead when a host weight streams to an accelerator.

    Returns:
        The loss: a scalar, or (``reduction="none"``) one per row, in ``x``'s dtype.

    Raises:
        TypeError: targets of an unknown form or with non-integer indices; ``x``/``weight``
            dtypes differ; a function that does not return a 0-d floating tensor.
        ValueError: a class outside ``[0, C)`` or twice in a row, malformed offsets, shapes that
            disagree, a bad option (``pos_weight`` that requires grad, or with a softmax); all
            before any compute.
        RuntimeError: a function whose loss uses other tensors requiring grad or does not depend
            on ``scores``; a double backward (``create_graph=True``).

    Example:
        >>> x = torch.randn(4, 16, requires_grad=True)
        >>> w = torch.randn(1000, 16, requires_grad=True)
        >>> offsets = torch.tensor([0, 2, 3, 3, 5])       # row 2 has no positive
        >>> indices = torch.tensor([7, 912, 5, 0, 999])
        >>> loss = linear_loss(x, w, (offsets, indices), loss="bce", slice_size=256)
        >>> loss.backward()
    """
    accum_dtype = compute_dtype(getattr(x, "dtype", torch.float32), accum_dtype=accum_dtype)
    check_slicing(reduction=reduction, slice_size=slice_size, prefetch=prefetch,
                  accum_dtype=accum_dtype)
    check_linear(x, weight, bias)
    if torch.compiler.is_compiling():
        # one opaque operator in the graph (the passes are data-dependent Python)
        from headroom.heads._compiled import compiled_linear_loss

        return compiled_linear_loss(
            x, weight, targets, loss=loss, bias=bias, pos_weight=pos_weight,
            reduction=reduction, slice_size=slice_size, ignore_rows=ignore_rows,
            accum_dtype=accum_dtype, prefetch=prefetch)
    params = TensorParams(weight, bias, device=x.device, dtype=accum_dtype, prefetch=prefetch)
    return multilabel_loss(
        x, weight, bias, targets, params, num_classes=weight.shape[0], loss=loss,
        pos_weight=pos_weight, reduction=reduction, slice_size=slice_size,
        ignore_rows=ignore_rows, accum_dtype=accum_dtype,
    )
