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

    Forward keeps an online log-sum-exp over slices of classes; backward recomputes each slice's
    logits for the exact gradients. Peak extra memory is one ``B x slice_size`` buffer (two with
    ``softcap``) and a few ``B``- and ``B x D``-sized tensors, whatever ``C``. With automatic
    slices, a scalar loss, gradients wanted and the weight on ``x``'s device in ``accum_dtype``,
    chunks of rows (at most half, within the same budget) give loss and gradients in one pass of
    three products instead of four. Ignored rows skip the products when the loss is reduced and
    the lse not returned. Under ``torch.compile`` (``fullgraph=True`` too) the call is one
    custom operator running this eager code.

    For language models: ``shift=True`` predicts token ``t + 1`` from position ``t`` (``x`` is
    ``(..., seq, D)``, ``target`` the unshifted labels, as a Hugging Face model's ``labels``),
    ``softcap`` caps the logits as Gemma 2/3 do, ``z_loss`` adds PaLM's ``z_loss * lse**2``, and
    the extra outputs give log-sum-exp, accuracy and predicted tokens without the logits.

    Args:
        x: ``(..., D)`` features, on the compute device.
        weight: ``(C, D)``, on ``x``'s device, or in host memory while ``x`` is on an
            accelerator (slices then stream there in both passes, ``prefetch`` ahead on a side
            stream, and the weight gradient streams back).
        target: ``x.shape[:-1]`` integer class indices in ``[0, C)`` or ``ignore_index``.
        bias: optional ``(C,)``, same device and dtype as ``weight``.
        slice_size: classes per slice; ``None``: from :data:`DEFAULT_LOGITS_BUDGET`, at most a
            cache-friendly few thousand. Larger ones cost memory without speeding up the
            products; below a few hundred the products get inefficient.
        ignore_index: target value whose rows contribute neither loss nor gradient.
        label_smoothing: ``eps`` in ``[0, 1]``, as in ``F.cross_entropy``: the target becomes
            ``(1 - eps) * onehot + eps / C``.
        reduction: ``"mean"`` (over non-ignored rows), ``"sum"`` or ``"none"`` (shape of target;
            with ``shift``, without its last ``shift`` positions).
        softcap: the loss sees ``softcap * tanh(logits / softcap)`` (Gemma 2/3); ``None``: the
            logits as they are.
        shift: ``True`` (or an int ``k``): row ``t`` of each sequence predicts ``target`` at
            ``t + k``; the last ``k`` positions predict nothing (the labels move, not ``x``).
        z_loss: adds ``z_loss * lse**2`` per row not ignored, averaged over those rows for
            ``"mean"`` (by their count, also with ``class_weight``).
        class_weight: ``(C,)``, as ``weight=`` of ``F.cross_entropy``: a row's loss is scaled
            by its target's weight and ``"mean"`` divides by their sum; label smoothing's
            uniform part is weighted per class too.
        return_lse: also return each row's log-sum-exp (differentiable).
        return_accuracy: also return the fraction of rows not ignored whose largest logit is
            the target.
        return_predictions: also return each row's predicted class (-1 on ignored rows).
        loss_dtype: dtype of the returned loss (and lse). ``None``: float32 for float16/bfloat16
            inputs, ``x``'s dtype otherwise (the loss accumulates in float64 either way).
        accum_dtype: dtype of logits, softmax and gradient accumulation. ``None``: float32 for
            float32/bf16/fp16 inputs (each weight slice upcast), float64 for float64 inputs.
            Gradients have the input dtype.
        prefetch: with a host weight on an accelerator, slices copied ahead of the one
            computing: ``1`` hides each copy behind one slice of compute; deeper absorbs uneven
            times at one more slice of device memory (and page-locked staging for a weight not
            pinned); ``0`` does not overlap. Unused for a weight on ``x``'s device.

    Returns:
        The loss, a scalar or (``reduction="none"``) shaped like ``target`` (with ``shift``,
        without its last ``shift`` positions), in ``loss_dtype``. With any ``return_*`` flag, a
        `LinearCrossEntropyOutput` ``(loss, lse, accuracy, predictions)`` holding what was
        asked for (``None`` elsewhere).

    Raises:
        TypeError: ``target`` not an integer tensor; ``x``/``weight`` dtypes differ; a
            ``class_weight`` that is not a floating tensor.
        ValueError: labels outside ``[0, C)`` (other than ``ignore_index``), feature sizes that
            disagree, wrong shapes, bad options. All checked before any compute.
        RuntimeError: from a backward with ``create_graph=True`` (e.g. a gradient penalty):
            use ``F.cross_entropy`` on dense logits for that term.

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
    at the positives; 0 elsewhere), computed one slice of classes at a time:

    * ``"bce"``: ``F.binary_cross_entropy_with_logits(logits, T, pos_weight=pos_weight)``.
    * ``"squared_hinge"``: ``pw * T * max(0, 1 - z)**2 + (1 - T) * max(0, 1 + z)**2`` per
      element (DiSMEC's loss with labels ``2T - 1``).
    * ``"softmax"``: ``F.cross_entropy(logits, T / T.sum(1, keepdim=True))``: the mean of
      ``-log p`` over a row's positives (weighted by their values); 0 for a row without any.
    * ``"softmax_sum"``: ``F.cross_entropy(logits, T)``: their sum.
    * a function ``fn(scores, targets, classes)``: called per slice with its ``B x S`` logits
      ``scores`` (in ``accum_dtype``, requiring grad), its ``B x S`` ``targets`` (``T``'s, in
      the scores' dtype) and ``classes``, its ``range`` of class ids; it returns the slice's
      summed loss (a 0-d tensor), which may depend on that slice only, and autograd
      differentiates it. ``scores`` and ``targets`` are reused buffers, valid during the call.

    With gradients wanted and ``reduction`` not ``"none"``, the separable losses and a function
    form loss and gradients in forward's one pass (three products per slice, as the dense
    computation); backward scales them. A softmax runs a pass in forward and one in backward.
    Peak extra memory: two ``B x slice_size`` buffers, the gradients of ``weight`` and ``x``,
    and a few ``B``- and ``nnz``-sized tensors. Under ``torch.compile`` the call is one custom
    operator running this eager code (built-in losses, CSR targets of tensors).

    Args:
        x: ``(..., D)`` features on the compute device.
        weight: ``(C, D)``, on ``x``'s device or in host memory while ``x`` is on an accelerator
            (slices then stream, as for `linear_cross_entropy`).
        targets: the positives of each row (of ``x.shape[:-1]`` flattened): CSR ``(offsets,
            indices)`` (row ``b``'s classes are ``indices[offsets[b]:offsets[b+1]]``),
            ``(offsets, indices, values)`` with a target value per positive, a list of one
            tensor of class ids per row, or a ``torch.sparse_csr_tensor`` ``(rows, C)``. Any
            order within a row; a class at most once per row.
        loss: ``"bce"``, ``"squared_hinge"``, ``"softmax"``, ``"softmax_sum"`` or a function.
        bias: optional ``(C,)``, same device and dtype as ``weight``.
        pos_weight: weight of the positive term of ``"bce"``/``"squared_hinge"``: a float or a
            ``(C,)`` tensor, as in ``F.binary_cross_entropy_with_logits`` (not differentiated).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-row sums over the classes, shape
            ``x.shape[:-1]``). ``"mean"`` divides by what PyTorch's dense loss divides by:
            counted rows x ``C`` for ``"bce"``/``"squared_hinge"``, counted rows otherwise.
        slice_size: classes per slice; ``None``: from `DEFAULT_LOGITS_BUDGET` for the buffers,
            at most a cache-friendly few thousand.
        ignore_rows: optional bool tensor shaped like ``x.shape[:-1]``: rows that are ``True``
            contribute neither loss nor gradient (nor count for ``"mean"``).
        accum_dtype: dtype of logits, loss and gradient accumulation. ``None``: float32 for
            float32/bf16/fp16 inputs, float64 for float64 inputs; results in ``x``'s dtype.
        prefetch: slices copied ahead when a host weight streams to an accelerator.

    Returns:
        The loss: a scalar, or (``reduction="none"``) one per row, in ``x``'s dtype.

    Raises:
        TypeError: targets of an unknown form or with non-integer indices; ``x``/``weight``
            dtypes differ; a function that does not return a 0-d floating tensor.
        ValueError: a class outside ``[0, C)``, a class listed twice in a row, malformed
            offsets, shapes that disagree, a bad option (``pos_weight`` that requires grad, or
            with a softmax); all before any compute.
        RuntimeError: a function whose loss uses other tensors requiring grad (they would
            get no gradient) or does not depend on ``scores``; a double backward
            (``create_graph=True``).

    Example:
        >>> x = torch.randn(4, 16, requires_grad=True)
        >>> w = torch.randn(1000, 16, requires_grad=True)
        >>> offsets = torch.tensor([0, 2, 3, 3, 5])       # row 2 has no positive
        >>> indices = torch.tensor([7, 912, 5, 0, 999])
        >>> loss = linear_loss(x, w, (offsets, indices), loss="bce", slice_size=256)
        >>> loss.backward()
    """
    accum_dtype = compute_dtype(getattr(x, "dtype", torch.float32), accum_dtype=accum_dtype)
    if torch.compiler.is_compiling():
        # one opaque operator in the graph (the passes are data-dependent Python)
        from headroom.heads._compiled import compiled_linear_loss

        return compiled_linear_loss(
            x, weight, targets, loss=loss, bias=bias, pos_weight=pos_weight,
            reduction=reduction, slice_size=slice_size, ignore_rows=ignore_rows,
            accum_dtype=accum_dtype, prefetch=prefetch)
    check_slicing(reduction=reduction, slice_size=slice_size, prefetch=prefetch,
                  accum_dtype=accum_dtype)
    check_linear(x, weight, bias)
    params = TensorParams(weight, bias, device=x.device, dtype=accum_dtype, prefetch=prefetch)
    return multilabel_loss(
        x, weight, bias, targets, params, num_classes=weight.shape[0], loss=loss,
        pos_weight=pos_weight, reduction=reduction, slice_size=slice_size,
        ignore_rows=ignore_rows, accum_dtype=accum_dtype,
    )
