"""Parameters, gradients and optimizer state kept off the device, built on `headroom.transfer`."""

from headroom.offload._checkpoint import CheckpointCorruptError, load, save
from headroom.offload._optimizer import HostOptimizer
from headroom.offload._params import describe, offload, unoffload
from headroom.offload._weights import load_weights, save_weights

__all__ = [
    "CheckpointCorruptError",
    "HostOptimizer",
    "describe",
    "load",
    "load_weights",
    "offload",
    "save",
    "save_weights",
    "unoffload",
]

