"""Exact losses over huge numbers of classes, streamed slice by slice over the classes: one
label per row, multi-label, a head whose weight rests in a store, a causal LM's loss."""

from headroom.heads._causal_lm import CausalLMPatch, patch_causal_lm
from headroom.heads._classifier import HugeClassifier
from headroom.heads._dry import patch_causal_lm_dry_run
from headroom.heads._entry import linear_cross_entropy, linear_loss
from headroom.heads._linear_ce import (
    DEFAULT_LOGITS_BUDGET,
    LinearCrossEntropyOutput,
    pick_slice_size,
)
from headroom.heads._linear_loss import LOSSES

__all__ = [
    "DEFAULT_LOGITS_BUDGET", "CausalLMPatch", "HugeClassifier", "LOSSES",
    "LinearCrossEntropyOutput", "linear_cross_entropy", "linear_loss", "patch_causal_lm",
    "patch_causal_lm_dry_run", "pick_slice_size",
]
