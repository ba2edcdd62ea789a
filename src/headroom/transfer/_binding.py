"""Store-resident parameters: which store holds a parameter's master copy and its gradient."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headroom.transfer._handle import Handle
from headroom.transfer._store import Store

__all__ = ["ParamBinding", "bind", "binding", "unbind"]

_ATTR = "_headroom_binding"


@dataclass
class ParamBinding:
    """Where a store-resident parameter rests.

    Attributes:
        store: the store holding the master copy (and the gradient).
        handle: the master copy.
        grad_handle: the accumulated gradient, or ``None`` if the parameter gets none.
        grad_rows: rows of ``grad_handle`` that hold a non-zero gradient (sorted LongTensor), or
            ``None`` for a dense gradient. Producers of sparse row gradients set it; consumers
            may touch only those rows.
        has_grad: ``grad_handle`` holds a gradient that has not been consumed yet. Producers set
            it when they write a gradient; consumers (an optimizer's ``zero_grad``) clear it,
            and the next producer then overwrites instead of accumulating.
    """

    store: Store
    handle: Handle
    grad_handle: Handle | None = None
    grad_rows: torch.Tensor | None = None
    has_grad: bool = False


def bind(
    param: torch.Tensor,
    handle: Handle,
    *,
    grad_handle: Handle | None = None,
    store: Store | None = None,
) -> ParamBinding:
    """Record that ``param``'s master copy rests in a store under ``handle``.

    Args:
        param: the parameter (usually an ``nn.Parameter``) as the user and optimizers see it.
        handle: its master copy; shape must match ``param``.
        grad_handle: where its gradient accumulates; same shape.
        store: the store; defaults to the store that issued ``handle``.

    Returns:
        The new `ParamBinding` (also available as ``binding(param)``).

    Raises:
        ValueError: shapes differ, or no store is known for ``handle``.
    """
    store = store if store is not None else handle.store
    if store is None:
        raise ValueError(f"handle {handle.key!r} has no store; pass store=")
    for h in (handle, grad_handle):
        if h is not None and tuple(param.shape) != h.shape:
            raise ValueError(
                f"shape mismatch binding {h.key!r}: parameter {tuple(param.shape)}, store {h.shape}"
            )
    b = ParamBinding(store=store, handle=handle, grad_handle=grad_handle)
    setattr(param, _ATTR, b)
    return b


def binding(param: torch.Tensor) -> ParamBinding | None:
    """The `ParamBinding` of a store-resident parameter, or ``None``."""
    return getattr(param, _ATTR, None)


def unbind(param: torch.Tensor) -> None:
    """Forget ``param``'s binding (the store keeps its tensors; free them separately)."""
    if hasattr(param, _ATTR):
        delattr(param, _ATTR)
