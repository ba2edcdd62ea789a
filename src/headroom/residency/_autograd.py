"""``torch.autograd.grad`` and ``backward(inputs=...)`` over the masters of an offloaded model.

Autograd differentiates the device copies (see [Note: masters and device copies]); the masters
that ``model.parameters()`` yields are not in the graph, so on their own these calls would find
them unused (``allow_unused=True`` would return ``None`` for every one). Each master therefore
becomes an instance of a subclass of its class (`OffloadedParameter` for ``nn.Parameter``,
`StoredParameter` for a `StoreTensor` on disk) whose ``__torch_function__`` receives those two
calls, which torch hands to it because a master is among their tensors, and runs them with
every master replaced by its device copy:

- ``torch.autograd.grad(loss, params)``: the device copies' gradients, in each master's dtype
  and on its device (bitwise those of the plain model on the same device in fp32);
  ``allow_unused``, ``materialize_grads``, ``retain_graph`` and ``grad_outputs`` as torch does;
- ``loss.backward(inputs=params)``, ``torch.autograd.backward(..., inputs=params)``: only the
  named parameters' gradients accumulate, and reach the store as any backward's do.

Every other function runs as for the base class (results are ordinary tensors).
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

    # NOTE: a master is never in an autograd graph (the device copies are), so ``p.data`` can
    # share its version counter, which plain ``.data`` does not: an in-place write through it
    # (``p.data.mul_(m)``, older initializers) is then seen as a write to the parameter, and an
    # optimizer's fp32 master follows it (see headroom.optim._follow).
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
    """Let ``master`` take part in ``torch.autograd.grad`` / ``backward(inputs=...)``.

    Masters of other classes (quantized weights resting packed) are left alone: they do not
    train, and torch refuses them as inputs (they do not require grad)."""
    sub = _SUBCLASS.get(type(master))
    if sub is not None:
        master.__class__ = sub


def unmark(master: torch.Tensor) -> None:
    """Give ``master`` its own class back (`hr.unoffload`)."""
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
    """Run ``torch.autograd.grad`` / ``backward`` with masters in ``inputs`` replaced by their
    device copies; convert the gradients ``grad`` returns to the masters' dtype and device."""
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
        # NOTE: a master frozen before the forward has a device copy outside the graph: it
        # stays itself, a leaf the graph does not use, which torch reports (or returns None
        # for, or zeros) exactly as for an unused parameter of a plain model; one frozen
        # since is refused by torch as not requiring grad, as in plain PyTorch.
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
