"""Activation offload for every forward of a model, as a plan applies it: a plan returns a
model, not a training loop, so forward hooks enter and leave `hr.offload_activations` (saved
tensors come back whenever their backward runs, so backward needs no wrapping).
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from headroom.activations import DEFAULT_MIN_BYTES, DEFAULT_PREFETCH


class ActivationOffloadHandle:
    """Returned by `offload_activations_in_forward`; ``remove()`` takes its hooks off."""

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
    prefetch=...)``, as ``with hr.offload_activations(...):`` around it in a training loop.

    The options are `hr.offload_activations`' (a `hr.DiskStore` serves every forward in turn).
    A forward that raises leaves the context all the same; saved tensors of a forward whose
    backward never runs are dropped with the graph.

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
