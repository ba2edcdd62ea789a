"""``torch.autograd.grad`` and ``backward(inputs=...)`` over the masters of an offloaded model.

Autograd differentiates the device copies ([Note: masters and device copies]), so the masters
would be unused inputs. Each master becomes an instance of a subclass of its class
(`OffloadedParameter`, `StoredParameter` on disk) whose ``__torch_function__`` runs those two
calls with every master replaced by its device copy: ``grad`` returns gradients in each master's
dtype and on its device (bitwise the plain model's in fp32), ``backward(inputs=...)``
accumulates only the named ones, into the store. Every other function runs as for the base class.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

from headroom.residency._schedule import _LIVE
from headroom.transfer import StoreTensor

__all__ = ["OffloadedParameter", "StoredParameter", "mark", "unmark"]

_GRAD = torch.autograd.grad
_BACKWARD = torch.autograd.backward
_SIGNATURES = {f: inspect.signature(f) for f in (_GRAD, _BACKWARD)}
_base_torch_function = torch._C._disabled_torch_function_impl


def _torch_function(cls, func, types, args=(), kwargs=None):
    if func is _GRAD or func is _BACKWARD:
        return _redirect(func, args, kwargs or {})
    return _base_torch_function(func, types, args, kwargs or {})


class OffloadedParameter(nn.Parameter):
    """An ``nn.Parameter`` whose values rest in host memory, offloaded by `hr.offload`."""

    __torch_function__ = classmethod(_torch_function)

    # NOTE: a master is never in a graph, so ``p.data`` shares its version counter: an in-place
    # write through it (``p.data.mul_(m)``) is seen, and an fp32 master follows it (optim._follow)
    @property
    def data(self) -> torch.Tensor:
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        torch.Tensor.data.__set__(self, value)

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        # as nn.Parameter.__deepcopy__, but the copy is a plain parameter (no offload)
        if id(self) not in memo:
            memo[id(self)] = nn.Parameter(
                self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        return memo[id(self)]


class StoredParameter(StoreTensor):
    """A parameter whose values rest in a `DiskStore`, offloaded by `hr.offload`."""

    __torch_function__ = classmethod(_torch_function)


_SUBCLASS = {nn.Parameter: OffloadedParameter, StoreTensor: StoredParameter}
_BASE = {sub: base for base, sub in _SUBCLASS.items()}


def mark(master: torch.Tensor) -> None:
    """Let ``master`` take part in ``torch.autograd.grad`` / ``backward(inputs=...)`` (other
    classes, quantized weights that do not train, are left alone)."""
    sub = _SUBCLASS.get(type(master))
    if sub is not None:
        master.__class__ = sub


def unmark(master: torch.Tensor) -> None:
    """Give ``master`` its own class back."""
    base = _BASE.get(type(master))
    if base is not None:
        master.__class__ = base


def _slot_of(t: Any) -> tuple[Any, Any] | None:
    """The live offload state and slot whose master is ``t``, if any."""
    if not isinstance(t, (OffloadedParameter, StoredParameter)):
        return None
    for state in tuple(_LIVE):
        slot = state.by_param.get(id(t))
        if slot is not None and slot.param is t:
            return state, slot
    return None


def _redirect(func, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` with masters in ``inputs`` replaced by their device copies; ``grad``'s
    results in the masters' dtype and device."""
    bound = _SIGNATURES[func].bind(*args, **kwargs)
    inputs = bound.arguments.get("inputs")
    single = isinstance(inputs, torch.Tensor)
    items = [inputs] if single else list(inputs or ())
    swapped: dict[int, torch.Tensor] = {}  # position in inputs -> master
    states = []
    for i, t in enumerate(items):
        hit = _slot_of(t)
        if hit is None:
            continue
        state, slot = hit
        # NOTE: a master frozen before the forward stays itself, unused by the graph, as torch
        # reports an unused parameter; one frozen since is refused by torch, as plainly
        if not (t.requires_grad and slot.dev.requires_grad):
            continue
        items[i] = slot.dev
        swapped[i] = t
        state.watch_captures(slot)
        if state not in states:
            states.append(state)
    if swapped:
        bound.arguments["inputs"] = items[0] if single else tuple(items)
    for state in states:
        state.captures_in_flight += 1
    try:
        # no second call of this function for masters among the other tensors
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*bound.args, **bound.kwargs)
    finally:
        for state in states:
            state.captures_in_flight -= 1
    if func is _BACKWARD or not swapped:
        return out
    out = list(out)
    for i, master in swapped.items():
        g = out[i]
        if g is not None:
            out[i] = g.to(device=master.device, dtype=master.dtype)
    return tuple(out)
