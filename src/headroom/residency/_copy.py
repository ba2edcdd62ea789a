"""``copy.deepcopy`` of an offloaded model (or one of its blocks): a plain model on the CPU.

An exponential moving average of the weights, a frozen reference model or a snapshot is
commonly made with ``copy.deepcopy(model)``. An offloaded model's state (a store, I/O threads,
locks, hooks bound to that state) cannot be duplicated meaningfully: a second offloaded model
would need store keys of its own. So the copy is *plain*: the same module classes without the
offload's guards and hooks, each parameter a new ``nn.Parameter`` on the CPU holding the
master's current value (read from the store, so a `DiskStore` works too), buffers copied to
the CPU. It shares nothing with the offloaded model: no tensor, store key, hook or thread.
Gradients are not copied (as ``copy.deepcopy`` of an ``nn.Parameter`` does not copy them).
Move it with ``.to(device)``, or offload it with a store of its own, to run it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch.nn as nn

from headroom.residency._packed import read_parts

__all__ = ["deepcopy_offloaded"]


def deepcopy_offloaded(module: nn.Module, state: Any, base: type, memo: dict, *,
                       leave_out: tuple[str, ...]) -> nn.Module:
    """``copy.deepcopy(module)`` for a guarded ``module`` (the root or a block) of ``state``.

    Args:
        module: the guarded module being copied.
        state: its model's offload state (`headroom.residency._schedule.Offload`).
        base: the module's original class (the copy gets it back).
        memo: ``copy.deepcopy``'s memo.
        leave_out: the attributes of the offload on the module (the copy has none).

    Raises:
        RuntimeError: called during the model's forward or backward (its device copies are
            in use; copy between steps).
    """
    # another thread's forward or backward finishes first (see headroom.residency._use)
    if not state.use.enter_short(wait_for_backward=True):
        raise _during_forward_or_backward()
    try:
        _map_subtree(state, module, memo)
        new = object.__new__(base)
        memo[id(module)] = new
        # the guard's role and the offload state stay behind; hooks of the offload were
        # mapped to dicts without them by `_map_subtree`
        d = {k: v for k, v in module.__getstate__().items()
             if k not in leave_out}
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
    """Seed ``memo`` so that a deep copy of ``module`` (a part of ``state``'s model) is plain
    and on the CPU: its masters' values read from the store, its buffers copied to the CPU,
    its hook dicts without the offload's hooks."""
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
