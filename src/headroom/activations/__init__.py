"""Saved tensors kept off the device between forward and backward."""

from headroom.activations._offload import empty_cache, offload_activations

__all__ = ["empty_cache", "offload_activations"]
