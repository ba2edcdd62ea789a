"""Parameters kept off the device: residency of groups of parameters, blocks, `offload`."""

from headroom.residency._offload import describe, offload, unoffload

__all__ = ["describe", "offload", "unoffload"]
