"""The dry run of `patch_causal_lm`: the patch on a ``meta`` copy of the model, as it runs in
steady state."""

from __future__ import annotations

from torch import nn

from headroom.heads._causal_lm import CausalLMPatch, patch_causal_lm


def patch_causal_lm_dry_run(model: nn.Module) -> CausalLMPatch:
    """`patch_causal_lm` on ``model`` (a ``meta`` copy), as every patched training call after
    the first runs: the first one also keeps the logits of one position per sequence to check
    them against the patch's, a comparison of values that a dry run does not have and that no
    later step makes."""
    handle = patch_causal_lm(model)
    handle._checked = True
    return handle
