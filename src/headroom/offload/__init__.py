"""Parameters, gradients and optimizer state kept off the device, built on `headroom.transfer`."""

import sys
import types

from headroom.offload._checkpoint import load, save
from headroom.offload._optimizer import HostOptimizer
from headroom.offload._params import describe, offload, unoffload

__all__ = ["HostOptimizer", "describe", "load", "offload", "save", "unoffload"]


class _CallableModule(types.ModuleType):
    # NOTE: importing any `headroom.offload.*` submodule makes Python set the package attribute
    # `headroom.offload` to this module, shadowing the lazily exported function of the same
    # name; calling the module forwards to the function so `hr.offload(model, ...)` always works.
    def __call__(self, *args, **kwargs):
        return offload(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
