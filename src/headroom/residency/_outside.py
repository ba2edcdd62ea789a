"""Offloaded parameters read from outside their block's forward: fetched on use.

[Note: uses outside a block] Code may read an offloaded parameter without calling its module
(TRL's fused LM head reads ``lm_head.weight``; a penalty reads a weight before backward), which
would compute with the master and bypass the store. So the module's parameter dict is a
`ParamDict`: while the model is in use (a forward or backward, or between a forward with
gradients and its backward), reading a master returns its device copy, fetched first, its group
resident until the backward ends and its gradient landing in the store. Reads at rest (an
optimizer, ``state_dict``, ``requires_grad_``) get the master.
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
    """A module's ``_parameters`` whose item reads (``module.weight``) ask the offload state
    for the tensor to use; iteration, ``items()`` and ``values()`` see the masters."""

    __slots__ = ("_state",)

    def __getitem__(self, name: str) -> Any:
        value = dict.__getitem__(self, name)
        # a shown device copy, None and plain parameters are no masters (those have classes of
        # their own, `_autograd.mark`); traced code sees the dict as it is (blocks share graphs)
        if type(value) in _AS_IS or is_compiling():
            return value
        state = self._state()
        if state is not None and state.reads_outside:
            return state.use_outside(value)
        return value

    def __setitem__(self, name: str, value: Any) -> None:
        # NOTE: ``Module._apply`` writes a moved parameter here, past the registration hooks; a
        # move of a master to ``meta`` (PEFT moves new adapters to the base weight's device, a
        # placeholder on disk) would lose its values: masters stay, as Offload.apply keeps them.
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
    """Keep an adapter on the compute device as an ordinary parameter (``adapters="device"``),
    watched so that a move to ``meta`` leaves it in place; returns it."""
    dev = state.device
    if p.device != dev:
        with torch.no_grad():
            p.data = p.data.to(dev)
    state.kept[id(p)] = p
    for m, _ in owners:
        install(state, m)
    return p
