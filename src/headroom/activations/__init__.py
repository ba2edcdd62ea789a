"""Saved tensors kept off the device between forward and backward."""

from headroom.activations._offload import offload_activations

__all__ = ["offload_activations"]
