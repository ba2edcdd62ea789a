"""The LM-loss patch (`hr.patch_causal_lm`) as a technique of plans and advice: whether it
applies to a model, and the dry run's copy patched as `Plan.apply` patches the model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


def lm_patch_refusal(model: nn.Module) -> str | None:
    """Why `hr.patch_causal_lm` cannot patch ``model`` for training (``None``: it can)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return ("it takes a causal LM whose get_output_embeddings() is a plain nn.Linear, got"
                f" {type(head).__name__}")
    if not model.training:
        return "the model is in eval mode, where the patch leaves the forward as it is"
    return None


def lm_patching(patched: list[bool] | None = None) -> Callable[[nn.Module], None]:
    """A ``prepare`` for a dry run's copy: `hr.patch_causal_lm` as steps after the first run
    it; ``patched`` gets, per forward, whether the patch computed the loss."""
    from headroom.heads import patch_causal_lm_dry_run

    def prepare(model: nn.Module) -> None:
        patch_causal_lm_dry_run(model)
        if patched is not None:  # after the patch's own hook, which sets the output
            model.register_forward_hook(
                lambda _m, _a, out: patched.append(getattr(out, "logits", 0) is None))

    return prepare


def lm_patch_run(model: nn.Module, run: Callable[[Callable[[nn.Module], None]], Any],
                 ) -> tuple[Any, str | None]:
    """``(run(lm_patching(...)), None)``, or ``(None, why)`` where the patch does not apply."""
    why = lm_patch_refusal(model)
    if why is not None:
        return None, why
    patched: list[bool] = []
    try:
        est = run(lm_patching(patched))
    except Exception as e:  # e.g. a loss_fn reading the logits, None when patched
        first = str(e).splitlines()[0][:200] if str(e) else ""
        return None, f"its dry run fails ({type(e).__name__}: {first})"
    if not any(patched):
        return None, ("the step computes no loss from labels inside the model (pass labels= in"
                      " example_kwargs; loss_fn, if any, reading output.loss)")
    return est, None
