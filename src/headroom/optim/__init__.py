"""The host optimizer: optimizer state and the step off the device."""

from headroom.optim._host_optimizer import HostOptimizer, HostOptimizerOptions

__all__ = ["HostOptimizer", "HostOptimizerOptions"]
