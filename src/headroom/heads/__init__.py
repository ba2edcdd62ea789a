"""Exact cross-entropy over huge numbers of classes, streamed slice by slice over the classes."""

from headroom.heads._classifier import HugeClassifier
from headroom.heads._linear_ce import DEFAULT_LOGITS_BUDGET, linear_cross_entropy, pick_slice_size

__all__ = ["DEFAULT_LOGITS_BUDGET", "HugeClassifier", "linear_cross_entropy", "pick_slice_size"]
