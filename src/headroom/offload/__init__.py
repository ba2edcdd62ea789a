"""Parameters, gradients and optimizer state kept off the device, built on `headroom.transfer`."""

from headroom.offload._checkpoint import CheckpointCorruptError, load, save
from headroom.offload._optimizer import HostOptimizer
from headroom.offload._params import describe, offload, unoffload

__all__ = [
    "CheckpointCorruptError",
    "HostOptimizer",
    "describe",
    "load",
    "offload",
    "save",
    "unoffload",
]

