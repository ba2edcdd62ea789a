"""The dry run of `patch_causal_lm`: the patch on a ``meta`` copy of the model, as it runs in
steady state."""

from __future__ import annotations

from torch import nn

from headroom.heads._causal_lm import CausalLMPatch, patch_causal_lm


def patch_causal_lm_dry_run(model: nn.Module) -> CausalLMPatch:
    """`patch_causal_lm` on ``model`` (a ``meta`` copy) as calls after the first run: without
    the first call's check of logit values, which a dry run does not have."""
    handle = patch_causal_lm(model)
    handle._checked = True
    return handle
