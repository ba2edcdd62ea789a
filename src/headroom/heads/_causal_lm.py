"""`patch_causal_lm`: a causal language model's training loss without its logits.

Hooks only: the model's pre-hook takes ``labels`` out, the output layer's pre-hook computes the
loss from its hidden states with `linear_cross_entropy` (while its weight is there, also when
offloaded) and passes on an empty slice, so the model builds no logits; the model's hook puts
the loss into the output. The first call compares one position's logits with the patch's.
"""

# NOTE: an offloaded output layer's weight is fetched again for backward by a hook on the
# layer's output, so the loss's backward must run after that hook: the loss reaches the caller
# through the layer's (empty) output, `_Carry` and `_Take` linking the two in autograd.

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from headroom.heads._entry import linear_cross_entropy
from headroom.transfer import binding

__all__ = ["CausalLMPatch", "patch_causal_lm"]

_MARK = "_headroom_causal_lm_patch"


@dataclass
class _Call:
    """One patched training forward: its labels and loss options, then the loss."""

    labels: torch.Tensor | None
    shift_labels: torch.Tensor | None
    num_items_in_batch: Any
    ignore_index: int
    check: bool
    offloaded: bool
    loss: torch.Tensor | None = None
    expected: torch.Tensor | None = None  # the check's logits (one position per sequence)
    low_precision: bool = False  # the check's hidden states are not fp32
    grad: list = field(default_factory=list)  # the loss's incoming gradient, _Take to _Carry


class _Carry(torch.autograd.Function):
    """The output layer's output, made to depend on the loss (see the NOTE at the top)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, loss: torch.Tensor, call: _Call):  # type: ignore[override]
        ctx.call = call
        return out.clone()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        got = ctx.call.grad
        return grad_out, (got.pop() if got else None), None


class _Take(torch.autograd.Function):
    """The loss, taken from the model's logits (which carry it, `_Carry`)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, loss: torch.Tensor, call: _Call):  # type: ignore[override]
        ctx.call, ctx.like = call, dict(size=logits.shape, dtype=logits.dtype, device=logits.device)
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        ctx.call.grad[:] = [grad]
        # zeros (not None) so that backward goes on through the logits to `_Carry`
        return torch.zeros(**ctx.like), None, None


class CausalLMPatch:
    """What `patch_causal_lm` returns: ``remove()`` (or leaving a ``with`` block) undoes it.

    Attributes:
        model: the patched model.
        lm_head: its output layer.
        softcap: the final-logit soft cap the loss applies (``None``: none).
    """

    def __init__(self, model: nn.Module, lm_head: nn.Linear, softcap: float | None,
                 slice_size: int | None) -> None:
        self.model, self.lm_head, self.softcap, self.slice_size = (
            model, lm_head, softcap, slice_size)
        self._call: _Call | None = None
        self._checked = False
        self._names = _leading_arg_names(model)
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            lm_head.register_forward_pre_hook(self._head),
            # before hr.offload's own hook on the layer's output (it fetches for backward)
            lm_head.register_forward_hook(self._head_out, prepend=True),
            model.register_forward_hook(self._after, with_kwargs=True, always_call=True),
        ]
        setattr(lm_head, _MARK, self)

    @property
    def active(self) -> bool:
        """Whether the patch is still in place."""
        return bool(self._handles)

    def remove(self) -> None:
        """Undo the patch: the model computes logits and its own loss again. Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._call = None
        if getattr(self.lm_head, _MARK, None) is self:
            delattr(self.lm_head, _MARK)

    def __enter__(self) -> CausalLMPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (f"CausalLMPatch({type(self.model).__name__}, softcap={self.softcap}, "
                f"active={self.active})")

    # ------------------------------------------------------------------ hooks
    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        self._call = None  # a forward that raised left nothing that counts
        if not module.training:
            return None
        if "labels" not in kwargs and "labels" in self._names[: len(args)]:
            # labels given by position: name every leading positional argument
            named = dict(zip(self._names, args, strict=False))
            args, kwargs = args[len(named):], {**named, **kwargs}
        if kwargs.get("labels") is None:
            return None
        head = _output_layer(self.model)
        if head is not self.lm_head:
            raise RuntimeError(
                f"patch_causal_lm: the model's output layer is now {type(head).__name__}, not "
                "the nn.Linear that was patched (wrapped, e.g. by LoRA on lm_head?). Remove the "
                "patch (handle.remove()), or keep lm_head out of the adapter's target_modules")
        kwargs = dict(kwargs)
        labels = kwargs.pop("labels")
        self._call = _Call(
            labels=labels, shift_labels=kwargs.get("shift_labels"),
            num_items_in_batch=kwargs.get("num_items_in_batch"),
            ignore_index=int(kwargs.get("ignore_index", -100)), check=not self._checked,
            # the output layer holds its stored master here (read as held: the attribute would
            # fetch the layer, see [Note: uses outside a block])
            offloaded=binding(dict.get(self.lm_head._parameters, "weight")) is not None)
        return args, kwargs

    def _head(self, module: nn.Module, args: tuple) -> tuple | None:
        call = self._call
        if call is None or call.loss is not None or not args:
            return None
        if not _in_forward_of(self.model):
            # a forward stopped by KeyboardInterrupt left its call armed; lm_head called directly
            self._call = None
            return None
        hidden = args[0]
        # the weight as the layer computes with it now (an offloaded one's device copy)
        weight, bias = module.weight, module.bias
        call.loss = self._loss(call, hidden, weight, bias)
        if call.check:
            call.expected = self._logits(hidden[..., -1:, :], weight, bias)
            call.low_precision = hidden.dtype != torch.float32
        # one position per sequence on the first call (checked in _after), then none
        keep = hidden[..., -1:, :] if call.check else hidden[..., :0, :]
        return (keep, *args[1:])

    def _head_out(self, module: nn.Module, args: tuple, output: Any) -> Any:
        call = self._call
        if (call is None or not call.offloaded or call.loss is None or not call.loss.requires_grad
                or not isinstance(output, torch.Tensor)):
            return None
        return _Carry.apply(output, call.loss, call)

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        call, self._call = self._call, None
        if call is None or output is None:
            return None
        if call.loss is None:
            raise RuntimeError(
                f"patch_causal_lm: {type(module).__name__}'s forward never called its output "
                "layer (get_output_embeddings()), so there is no loss: remove the patch")
        logits = output[0] if isinstance(output, tuple) else output["logits"]
        if call.check:
            self._check(call, logits)
            self._checked = True
        loss = call.loss
        if call.offloaded and loss.requires_grad:
            if not (isinstance(logits, torch.Tensor) and logits.requires_grad):
                raise RuntimeError(
                    "patch_causal_lm: the model's logits do not depend on its output layer's "
                    "output in autograd, through which an offloaded layer's weight is fetched "
                    "for backward; remove the patch, or keep the output layer out of hr.offload")
            loss = _Take.apply(logits, loss, call)
        if isinstance(output, tuple):
            return (loss, *output[1:])
        fields = dict(output.items())
        fields["loss"], fields["logits"] = loss, None
        return type(output)(**fields)

    # ------------------------------------------------------------------ the loss
    @staticmethod
    def _features(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if hidden.dtype != weight.dtype:  # autocast: upcasting is exact
            hidden = hidden.to(weight.dtype)
        return hidden

    def _loss(self, call: _Call, hidden: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        hidden = self._features(hidden, weight)
        shift = call.shift_labels is None
        target = call.labels if shift else call.shift_labels
        assert target is not None
        target = target.to(hidden.device)
        if tuple(target.shape) != tuple(hidden.shape[:-1]):
            raise ValueError(
                f"patch_causal_lm: labels of shape {tuple(target.shape)} for hidden states of "
                f"shape {tuple(hidden.shape)}; they must be (batch, seq) for the whole sequence "
                "(logits_to_keep must stay 0 in training)")
        n = call.num_items_in_batch
        loss = linear_cross_entropy(
            hidden, weight, target, bias, shift=shift,
            softcap=self.softcap, ignore_index=call.ignore_index,
            reduction="mean" if n is None else "sum", slice_size=self.slice_size)
        assert isinstance(loss, torch.Tensor)
        if n is not None:  # as transformers: over the whole accumulated batch's tokens
            loss = loss / (n.to(loss.device) if torch.is_tensor(n) else n)
        return loss

    def _logits(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor:
        """What the patch takes the logits of ``hidden`` to be (fp32, for `_check`)."""
        with torch.no_grad():
            z = self._features(hidden, weight).float() @ weight.float().T
            if bias is not None:
                z = z + bias.float()
            if self.softcap is not None:
                z = torch.tanh(z / self.softcap) * self.softcap
            return z

    def _check(self, call: _Call, logits: torch.Tensor) -> None:
        z = call.expected
        assert z is not None
        with torch.no_grad():
            got = logits.detach().float()
            if got.shape != z.shape:
                raise RuntimeError(
                    f"patch_causal_lm: the model's logits have shape {tuple(got.shape)} where "
                    f"lm_head gives {tuple(z.shape)}: it post-processes them in a way the patch "
                    "does not know; remove the patch (handle.remove())")
            low = call.low_precision or logits.dtype != torch.float32
            tol = 3e-2 if low else 1e-4
            err = float((got - z).abs().max())
            scale = 1.0 + float(z.abs().max())
            if not err <= tol * scale:
                raise RuntimeError(
                    "patch_causal_lm: the model's logits are not lm_head(hidden)"
                    + (f" soft-capped at {self.softcap}" if self.softcap else "")
                    + f" (largest difference {err:.3g} at logits up to {scale - 1:.3g}): the "
                    "model transforms them in a way the patch does not know (a logit scale, a "
                    "soft cap not in its config), so its loss would differ: remove the patch")


def _in_forward_of(model: nn.Module, depth: int = 64) -> bool:
    """Whether ``model``'s ``__call__`` is on this thread's stack (within ``depth`` frames)."""
    frame = sys._getframe(1)
    while frame is not None and depth > 0:
        if frame.f_code is _CALL_CODE and frame.f_locals.get("self") is model:
            return True
        frame, depth = frame.f_back, depth - 1
    return False


_CALL_CODE = nn.Module._call_impl.__code__


def _output_layer(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def _leading_arg_names(model: nn.Module) -> list[str]:
    """Names of the forward's leading positional-or-keyword parameters."""
    names = []
    for p in inspect.signature(model.forward).parameters.values():
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            break
        names.append(p.name)
    return names


def _softcap(model: nn.Module) -> float | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text, "final_logit_softcapping", None)
    return None if cap is None or cap == 0 else float(cap)


def patch_causal_lm(model: nn.Module, *, slice_size: int | None = None) -> CausalLMPatch:
    """Make ``model(input_ids, labels=labels).loss`` never build the ``tokens x vocab`` logits.

    For ``transformers`` causal LMs (also inside ``peft``) whose logits are
    ``get_output_embeddings()(hidden)``, maybe soft-capped: in training mode with ``labels`` the
    loss is the model's own, by `linear_cross_entropy` in fp32, and ``logits`` is ``None``; in
    eval mode or without ``labels`` the model runs as before. See docs/huge_classifier.md, "One
    line for a Hugging Face model".

    Args:
        model: a causal LM (a ``transformers`` ``PreTrainedModel`` or a ``peft`` model around
            one) whose ``get_output_embeddings()`` is an ``nn.Linear``.
        slice_size: vocabulary entries per slice (``None``: from the logits budget, as in
            `linear_cross_entropy`).

    Returns:
        A `CausalLMPatch`; ``handle.remove()`` (or ``with hr.patch_causal_lm(model):``) undoes
        the patch.

    Raises:
        TypeError: the model has no ``get_output_embeddings()`` returning an ``nn.Linear``
            (e.g. LoRA on ``lm_head``).
        RuntimeError: the model is already patched. From a forward: the output layer was
            replaced after patching, or the first call's logits show a transformation the patch
            does not know (a logit scale).

    Example:
        >>> handle = hr.patch_causal_lm(model)
        >>> model.train()
        >>> loss = model(input_ids, labels=input_ids).loss    # no batch x seq x vocab logits
        >>> loss.backward()
        >>> handle.remove()
    """
    head = _output_layer(model)
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        raise TypeError(
            "patch_causal_lm needs a causal LM whose get_output_embeddings() is a plain "
            f"nn.Linear (lm_head), got {type(head).__name__}"
            + (" (LoRA or another adapter on lm_head changes its output; keep lm_head out of "
               "target_modules)" if head is not None else "")
        )
    if getattr(head, _MARK, None) is not None:
        raise RuntimeError(
            f"{type(model).__name__}'s output layer is already patched by patch_causal_lm "
            "(maybe through a wrapper); remove the first patch (handle.remove()) first")
    return CausalLMPatch(model, head, _softcap(model), slice_size)
