"""Activation offload for every forward of a model, as a plan applies it.

`hr.offload_activations` is a context manager around a step's forward (and backward); a plan
returns a model and an optimizer, not a training loop, so `Plan.apply` enters it in a forward
pre-hook of the model and leaves it in a forward hook that runs even when the forward raises.
Tensors saved inside are restored whenever their backward runs, so the backward needs no
wrapping.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from headroom.activations import DEFAULT_MIN_BYTES, DEFAULT_PREFETCH


class ActivationOffloadHandle:
    """Returned by `offload_activations_in_forward`; ``remove()`` takes the hooks off.

    Its hooks enter ``hr.offload_activations(...)`` before the model's forward, leave it after.
    """

    def __init__(self, model: nn.Module, kwargs: dict[str, Any]) -> None:
        self._kwargs = kwargs
        self._stack: list[contextlib.AbstractContextManager] = []
        self._handles = [model.register_forward_pre_hook(self._enter),
                         model.register_forward_hook(self._leave, always_call=True)]

    def _enter(self, module: nn.Module, args: Any) -> None:
        from headroom.activations import offload_activations

        ctx = offload_activations(**self._kwargs)
        ctx.__enter__()
        self._stack.append(ctx)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def offload_activations_in_forward(model: nn.Module, *, store: Any = "cpu",
                                   min_bytes: int = DEFAULT_MIN_BYTES,
                                   prefetch: int = DEFAULT_PREFETCH) -> ActivationOffloadHandle:
    """Run every forward of ``model`` under ``hr.offload_activations(store, min_bytes=...,
    prefetch=...)``: what a training loop would write as ``with hr.offload_activations(...):``
    around its forward.

    The options are `hr.offload_activations`' (see there; a `hr.DiskStore` is used by every
    forward in turn). A forward that raises leaves the context all the same (the hook runs
    always); saved tensors of a forward whose backward never runs are dropped with the graph.

    Raises:
        ValueError: the options `hr.offload_activations` refuses (checked here, before any
            hook is added).

    Example:
        >>> h = offload_activations_in_forward(model, store=hr.DiskStore("/scratch/act"))
        >>> loss_fn(model(x)).backward()        # saved tensors rested on disk in between
        >>> h.remove()
    """
    from headroom.activations import offload_activations

    kwargs = {"store": store, "min_bytes": min_bytes, "prefetch": prefetch}
    with offload_activations(**kwargs):  # the options' own checks, before any hook
        pass
    return ActivationOffloadHandle(model, kwargs)
