"""Offloaded parameters read from outside their block's forward: fetched on use.

[Note: uses outside a block] Code may read an offloaded parameter without calling the module
that holds it: TRL's fused LM head reads ``lm_head.weight`` inside the model's forward, a value
head or a penalty reads a weight between forward and backward. Outside its block's forward a
module holds the parameter's master (in host memory or on disk), so such a read would compute
with the master and its gradient would bypass the store. Instead, the module's parameter dict
is a `ParamDict`: while the model is in use (a forward or backward of the root or a block, or
between a forward with gradients and its backward, with grad mode on), reading a master there
returns its device copy, fetched first, and the group stays resident until the backward ends.
The gradient lands in the store as any device copy's does. Reads at rest (building an
optimizer, ``state_dict``, freezing with ``requires_grad_``) get the master, as before.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.compiler import is_compiling

from headroom.residency._group import DeviceCopy

__all__ = ["ParamDict", "install", "keep_on_device", "remove"]


_AS_IS = (DeviceCopy, nn.Parameter, type(None))


class ParamDict(dict):
    """A module's ``_parameters`` whose item reads (``module.weight`` goes through
    ``Module.__getattr__`` to ``_parameters[name]``) ask the offload state for the tensor to
    use. Iteration, ``items()`` and ``values()`` (``named_parameters``, ``state_dict``,
    ``_apply``) see the stored objects, the masters."""

    __slots__ = ("_state",)

    def __getitem__(self, name: str) -> Any:
        value = dict.__getitem__(self, name)
        # A device copy shown in a forward is what to use already, and neither ``None`` nor a
        # plain parameter is a master (hr.offload gives masters classes of their own:
        # `_autograd.mark`; quantized ones have theirs); traced code sees the dict as it is
        # (NOTE: blocks share graphs).
        if type(value) in _AS_IS or is_compiling():
            return value
        state = self._state()
        if state is not None and state.reads_outside:
            return state.use_outside(value)
        return value

    def __setitem__(self, name: str, value: Any) -> None:
        # NOTE: ``Module._apply`` (``.to()``) writes a moved parameter straight into this dict,
        # past the registration hooks. A move to ``meta`` of an offloaded master would leave the
        # module without its values: PEFT moves new adapters to the device of the base weight,
        # a ``meta`` placeholder for a bitsandbytes weight resting on disk. Masters stay where
        # their store keeps them (as `.to()` of an offloaded model leaves them, Offload.apply).
        # A meta parameter registered in its place goes through the hooks, which adopt it.
        state = self._state()
        if state is not None and isinstance(value, torch.Tensor) and value.is_meta:
            old = dict.get(self, name)
            if old is not None and old is not value and not old.is_meta \
                    and state.keeps_place(old, value):
                return
        dict.__setitem__(self, name, value)

    # Copies and pickles are plain dicts: they hold no reference to the offload.
    def __reduce_ex__(self, protocol: int):
        return dict, (list(dict.items(self)),)

    def __deepcopy__(self, memo: dict) -> dict:
        return copy.deepcopy(dict(dict.items(self)), memo)

    def copy(self) -> dict:
        return dict(dict.items(self))


def install(state: Any, module: nn.Module) -> None:
    """Route reads of ``module``'s parameters through ``state`` (see the note above)."""
    params = module.__dict__.get("_parameters")
    if type(params) is dict:
        new = ParamDict(params)
        new._state = weakref.ref(state)
        module.__dict__["_parameters"] = new


def remove(module: nn.Module) -> None:
    """Undo `install`: a plain dict again."""
    params = module.__dict__.get("_parameters")
    if type(params) is ParamDict:
        module.__dict__["_parameters"] = dict(dict.items(params))


def keep_on_device(state: Any, p: nn.Parameter, owners: list) -> nn.Parameter:
    """An adapter stays on the compute device, an ordinary parameter (``adapters="device"``):
    moved there if it is elsewhere, and watched so that a move to ``meta`` (PEFT moves new
    adapters to the base weight's device) leaves it in place. Returns the parameter kept."""
    dev = state.device
    if p.device != dev:
        with torch.no_grad():
            p.data = p.data.to(dev)
    state.kept[id(p)] = p
    for m, _ in owners:
        install(state, m)
    return p
