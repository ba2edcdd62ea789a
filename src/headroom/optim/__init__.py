"""The host optimizer: optimizer state and the step off the device."""

from headroom.optim._host_optimizer import HostOptimizer

__all__ = ["HostOptimizer"]
