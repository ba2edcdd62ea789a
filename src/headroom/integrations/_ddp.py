"""DistributedDataParallel over an offloaded model, refused whichever came first.

Autograd runs on the device copies while DDP hooks the stored parameters, so no gradient would
be all-reduced and the replicas would silently diverge. ``hr.data_parallel`` runs DDP for the
parameters on the device itself (it sets ``Offload.ddp_allowed``); any other DDP is refused:

- DDP built over an offloaded root or block: its constructor asks the module for
  ``_ddp_params_and_buffers_to_ignore`` (``hasattr``, which lets any error but
  ``AttributeError`` through), a property of the guarded classes (`residency._guard`).
- DDP built first, or over a module above an offloaded one: the offloaded model's forward sees
  DDP's forward running (DDP sets ``DistributedDataParallel._get_active_ddp_module()`` around
  its call of the module), whose module holds it. DDP's experimental Python reducer (compiled
  autograd with ``optimize_ddp="python_reducer"``) sets no such flag: there only a DDP built
  over an offloaded root or block is refused.
"""

from __future__ import annotations

import sys

import torch.nn as nn

from headroom.residency import Offload, events, guarded_state

__all__ = ["refuse"]

_IGNORE = "_ddp_params_and_buffers_to_ignore"


def refuse(state: Offload, module: nn.Module) -> None:
    """Raise the error for DDP wrapping ``module`` of ``state``'s model (unless it is
    ``hr.data_parallel``'s own)."""
    if state.ddp_allowed:
        return  # hr.data_parallel's own DDP, over the parameters that are not offloaded
    raise RuntimeError(
        f"DistributedDataParallel cannot wrap a model offloaded with hr.offload (here"
        f" {type(module).__name__}), whichever came first: autograd runs on the device"
        " copies while DDP hooks the stored parameters, so no gradient would be all-reduced"
        " and the replicas would silently diverge. Use model = hr.data_parallel(model)"
        " instead of DistributedDataParallel(model), after hr.offload: it runs DDP for the"
        " parameters on the device and all-reduces the offloaded ones itself (with"
        " accelerate: before accelerator.prepare, which then gets the optimizer and data"
        " loaders only)"
    )


def _refuse_role(module: nn.Module) -> None:
    state = guarded_state(module)
    if state is not None:
        refuse(state, module)


def _ignore_get(self: nn.Module):
    _refuse_role(self)
    try:
        return self.__dict__[_IGNORE]
    except KeyError:
        raise AttributeError(_IGNORE) from None


def _ignore_set(self: nn.Module, value) -> None:
    _refuse_role(self)
    self.__dict__[_IGNORE] = value


def _under_ddp(state: Offload, module: nn.Module) -> None:
    """Before a forward: refuse when a DDP forward over this module is running."""
    if state.ddp_allowed:
        return
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return  # no DDP can run
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    active = ddp.DistributedDataParallel._get_active_ddp_module() if ddp is not None else None
    # NOTE: the flag is process-wide: a DDP forward of another model on another thread
    # is not this module's wrapper
    if active is not None and any(m is module for m in active.module.modules()):
        refuse(state, module)


events.guard_members[_IGNORE] = property(_ignore_get, _ignore_set)
events.before_forward.append(_under_ddp)
