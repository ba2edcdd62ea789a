"""``copy.deepcopy`` of an offloaded model (or one of its blocks): a plain model on the CPU.

A store, its threads and hooks cannot be duplicated meaningfully, so the copy (an EMA, a frozen
reference) is *plain*: the same module classes without guards or hooks, each parameter a new
``nn.Parameter`` on the CPU holding the master's current value, buffers on the CPU, no
gradients. It shares no tensor, store key, hook or thread with the offloaded model.
"""

from __future__ import annotations

import copy
from typing import Any

import torch.nn as nn

from headroom.residency._packed import read_parts

__all__ = ["deepcopy_offloaded"]


def deepcopy_offloaded(module: nn.Module, state: Any, base: type, memo: dict, *,
                       leave_out: tuple[str, ...]) -> nn.Module:
    """``copy.deepcopy(module)`` for a guarded ``module`` of ``state``, as a ``base`` without
    the ``leave_out`` attributes; refused during the model's forward or backward."""
    if not state.use.enter_short(wait_for_backward=True):
        raise _during_forward_or_backward()
    try:
        _map_subtree(state, module, memo)
        new = object.__new__(base)
        memo[id(module)] = new
        d = {k: v for k, v in module.__getstate__().items() if k not in leave_out}
        new.__setstate__(copy.deepcopy(d, memo))
        return new
    finally:
        state.use.exit_forward()


def _during_forward_or_backward() -> RuntimeError:
    return RuntimeError(
        "copy.deepcopy of an offloaded model during its forward or backward is not"
        " supported (its device copies are in use); copy it between steps"
    )


def _map_subtree(state: Any, module: nn.Module, memo: dict) -> None:
    """Seed ``memo`` so that a deep copy of ``module`` is plain: masters' values read from the
    store, buffers on the CPU, hook dicts without the offload's hooks."""
    if state.in_forward:  # this thread's forward (the use is ours)
        raise _during_forward_or_backward()
    state.init_pending()  # values for parameters created on meta, as state_dict() does
    modules = {id(m): m for m in module.modules()}
    for slot in state.slots:
        if id(slot.param) in memo or not any(id(m) in modules for m, _ in slot.owners):
            continue
        b = slot.binding
        value = b.store.read(b.handle).result()
        if value.device.type != "cpu" or value.data_ptr() == slot.param.data_ptr():
            value = value.to("cpu", copy=True)
        p = nn.Parameter(value, requires_grad=slot.param.requires_grad)
        memo[id(slot.param)] = p
        memo[id(slot.dev)] = p  # a module showing its device copy gets the same value
    for q in state.packed:  # quantized: the same class over host copies of its parts
        if id(q.param) not in memo and any(id(m) in modules for m, _ in q.owners):
            memo[id(q.param)] = memo[id(q.dev)] = q.packing.rebuild(read_parts(q, state.store))
    ours = {h.id for h in state.handles}
    for m in modules.values():
        for buf in m._buffers.values():
            if buf is not None and id(buf) not in memo:
                memo[id(buf)] = buf.detach().to("cpu", copy=True)
        for name, v in m.__dict__.items():
            if "hooks" in name and isinstance(v, dict) and id(v) not in memo \
                    and any(k in ours for k in v):
                memo[id(v)] = type(v)(
                    (k, copy.deepcopy(h, memo)) for k, h in v.items() if k not in ours)
