"""Events of an offloaded model that `headroom.integrations` subscribes to.

What the libraries around an offloaded model need (PEFT's merges and adapters, DDP's checks)
lives above residency, in `headroom.integrations`, which appends its callbacks to these lists
when imported; `hr.offload` imports it (through `headroom._providers`) before its first model.
Each list is called in order; a callback that raises stops the operation that emitted it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    import torch.nn as nn

    from headroom.residency._group import Slot
    from headroom.residency._schedule import Offload

__all__ = [
    "before_forward", "between_steps", "guard_members", "lost_values", "on_module_added",
    "on_module_replaced", "on_offload", "on_parameter_registered",
]

#: A model was offloaded (its state complete, its guards installed).
on_offload: list[Callable[[Offload], None]] = []
#: A module joined an offloaded model (each module of what was attached, itself included).
on_module_added: list[Callable[[Offload, nn.Module], None]] = []
#: ``(state, old, keep, slots)``: ``old`` leaves the model and ``keep``, a module inside it,
#: takes its place (an adapter wrapper unloaded); ``slots``: the parameters stored in ``old``.
on_module_replaced: list[Callable[[Offload, nn.Module, nn.Module, list[Slot]], None]] = []
#: ``(module, name, param, keep)``: a parameter registered on any module while a model is
#: offloaded; ``keep``: its values would be lost if a library moved it to ``meta`` now.
on_parameter_registered: list[Callable[[nn.Module, str, nn.Parameter, bool], None]] = []
#: ``(module, name)``: the values of a parameter registered there that is on ``meta`` now
#: (moved there since it was registered), or None.
lost_values: list[Callable[[nn.Module, str], torch.Tensor | None]] = []
#: ``(state, module)``: ``module`` (the offloaded model, or a block called on its own) starts
#: a forward; what joined the model since the last one is placed.
before_forward: list[Callable[[Offload, nn.Module], None]] = []
#: Between steps (before a forward, a state dict, ``hr.init_adapters``): bring the store in
#: line with what changed behind its back.
between_steps: list[Callable[[Offload], None]] = []
#: Class attributes every guarded class gets (see `headroom.residency._guard`).
guard_members: dict[str, Any] = {}


def emit(callbacks: list[Callable[..., Any]], *args: Any) -> None:
    for fn in callbacks:
        fn(*args)


def lost_value(module: nn.Module, name: str) -> torch.Tensor | None:
    """The first values a `lost_values` subscriber has for ``module.<name>``, or None."""
    for fn in lost_values:
        found = fn(module, name)
        if found is not None:
            return found
    return None
