"""Saved tensors kept off the device between forward and backward."""

from headroom.activations._offload import (
    DEFAULT_MIN_BYTES,
    DEFAULT_PREFETCH,
    empty_cache,
    offload_activations,
    offload_activations_dry_run,
)

__all__ = ["DEFAULT_MIN_BYTES", "DEFAULT_PREFETCH", "empty_cache", "offload_activations",
           "offload_activations_dry_run"]
