"""The host optimizer: optimizer state and the step off the device."""

from headroom.optim._dry import DryHostOptimizer
from headroom.optim._host_optimizer import HostOptimizer, HostOptimizerOptions
from headroom.optim._state import ParamState, SavedView, saved_view

__all__ = ["DryHostOptimizer", "HostOptimizer", "HostOptimizerOptions", "ParamState",
           "SavedView", "saved_view"]
