"""DistributedDataParallel over an offloaded model, refused whichever came first.

DDP would hook the stored parameters while autograd runs on device copies: no all-reduce. Only
``hr.data_parallel``'s own DDP (``Offload.ddp_allowed``) passes. DDP built over an offloaded
root or block asks it for ``_ddp_params_and_buffers_to_ignore``, a guarded property that raises;
DDP built first or above one is seen from forward (``_get_active_ddp_module()``), except under
the Python reducer of compiled autograd, which sets no such flag.
"""

from __future__ import annotations

import sys

import torch.nn as nn

from headroom.residency import Offload, events, guarded_state

__all__ = ["refuse"]

_IGNORE = "_ddp_params_and_buffers_to_ignore"


def refuse(state: Offload, module: nn.Module) -> None:
    """Refuse DDP over ``module`` of ``state``'s model, unless it is ``hr.data_parallel``'s."""
    if state.ddp_allowed:
        return
    raise RuntimeError(
        f"DistributedDataParallel cannot wrap a model offloaded with hr.offload (here"
        f" {type(module).__name__}): DDP hooks the stored parameters while autograd runs on"
        " device copies, so the replicas would silently diverge. Use model ="
        " hr.data_parallel(model) after hr.offload instead (with accelerate: before"
        " accelerator.prepare, which then gets the optimizer and data loaders only)"
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
