"""Store-resident parameters: which store holds a parameter's master copy and its gradient.

A binding also carries the gradient-ready signal from the producer of a store-resident gradient
(the offload layer) to its consumer (an optimizer): `on_grad_ready`, `grad_ready`, `sync_grad`,
`flush_grad`, and a *relay* (data parallel) that may stand between them (`relay_done`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from headroom.store import Handle, Store

__all__ = [
    "ParamBinding", "adopt_grad", "bind", "binding", "flush_grad", "grad_ready",
    "note_value_edit", "on_grad_ready", "relay_done", "sync_grad",
    "unbind", "value_edits", "weak_method", "weak_post_accumulate_grad_hook",
]

# store -> {key: count}; see `value_edits`
_VALUE_EDITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def note_value_edit(store: Store, key: str) -> None:
    """Count a write of the values under ``key`` by someone other than their consumer."""
    counts = _VALUE_EDITS.setdefault(store, {})
    counts[key] = counts.get(key, 0) + 1


def value_edits(store: Store, key: str) -> int:
    """How many times the values under ``key`` were written other than by the optimizer's
    step: whole values (``binding.has_value`` set) and in-place ops through a `StoreTensor`.
    A consumer keeping a copy (an fp32 master) compares counts instead of reading the values;
    values in host memory can also change through the tensor itself, unseen here."""
    counts = _VALUE_EDITS.get(store)
    return 0 if counts is None else counts.get(key, 0)

_ATTR = "_headroom_binding"


@dataclass
class ParamBinding:
    """Where a store-resident parameter rests.

    Attributes:
        store: the store holding the master copy (and the gradient).
        handle: the master copy.
        grad_handle: the accumulated gradient, or ``None`` if the parameter gets none.
        grad_rows: the rows of ``grad_handle`` that may be non-zero (sorted LongTensor; set by
            producers of sparse row gradients, consumers touch only these), or ``None``.
        has_grad: a gradient not consumed yet is stored. Producers set it; consumers
            (``zero_grad``) clear it, and the next producer then overwrites.
        grad_sparse: a sparse COO gradient in host memory as autograd accumulates it (not
            coalesced: a sparse step depends on the entries' order), or ``None``; while set,
            ``grad_handle`` holds nothing of it.
        grad_sync: set by the producer: blocks until every gradient handed over so far rests
            in ``grad_handle``. ``None``: in place as soon as `grad_ready` fires.
        grad_flush: set by a producer that may hold sums back on the device: hands them to the
            store now, without waiting. ``None``: nothing is held back.
        grad_adopt: set by the producer: see `adopt_grad`. ``None``: nothing to adopt.
        grad_dtype: the dtype ``grad_handle`` is allocated in (``None``: the parameter's); a
            consumer with fp32 masters sets ``torch.float32``.
        grad_edits: in-place changes made to the stored gradient through a `StoreTensor`
            (clipping, unscaling), so a consumer can tell it changed.
        has_value: ``False`` while ``handle`` holds no value yet (created on ``meta``); whoever
            writes the whole value sets it (counted in `value_edits`).
        listeners: callables ``fn(param)`` that `grad_ready` calls.
        relay: ``fn(param)`` that `grad_ready` calls instead of the listeners (data parallel
            averaging across processes), which calls `relay_done` when final; or ``None``.
    """

    store: Store
    handle: Handle
    grad_handle: Handle | None = None
    grad_rows: torch.Tensor | None = None
    has_grad: bool = False
    grad_sparse: torch.Tensor | None = None
    grad_dtype: torch.dtype | None = None
    has_value: bool = True
    grad_edits: int = 0
    grad_sync: Callable[[], None] | None = field(default=None, repr=False)
    grad_flush: Callable[[], None] | None = field(default=None, repr=False)
    grad_adopt: Callable[[], None] | None = field(default=None, repr=False)
    listeners: list[Callable[[torch.Tensor], None]] = field(default_factory=list, repr=False)
    relay: Callable[[torch.Tensor], None] | None = field(default=None, repr=False)

    def __setattr__(self, name: str, value: Any) -> None:
        # NOTE: a whole value written by anyone but the optimizer is announced by setting
        # has_value (see [Note: masters and device copies]); counting it here keeps every
        # such writer in step with `value_edits` without each having to call it.
        object.__setattr__(self, name, value)
        if name == "has_value" and value:
            note_value_edit(self.store, self.handle.key)


class ListenerHandle:
    """Returned by `on_grad_ready`; ``remove()`` unregisters the listener (idempotent)."""

    __slots__ = ("_binding", "_fn")

    def __init__(self, b: ParamBinding, fn: Callable[[torch.Tensor], None]) -> None:
        # Weakly, as torch's hook handles: a kept handle must not keep the offload state alive.
        self._binding: weakref.ref[ParamBinding] | None = weakref.ref(b)
        self._fn = fn

    def remove(self) -> None:
        b = self._binding() if self._binding is not None else None
        self._binding = None
        if b is not None:
            # By identity, so two registrations of the same function stay independent.
            i = next((i for i, f in enumerate(b.listeners) if f is self._fn), None)
            if i is not None:
                del b.listeners[i]


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
        handle: its master copy; shape must match ``param`` (a DTensor's local shard).
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
    # A DTensor (an FSDP2 shard) rests as its local shard.
    local = param.to_local() if hasattr(param, "to_local") else param
    for h in (handle, grad_handle):
        if h is not None and tuple(local.shape) != h.shape:
            raise ValueError(
                f"shape mismatch binding {h.key!r}: parameter {tuple(local.shape)}, store {h.shape}"
            )
    b = ParamBinding(store=store, handle=handle, grad_handle=grad_handle)
    setattr(param, _ATTR, b)
    return b


def binding(param: torch.Tensor) -> ParamBinding | None:
    """The `ParamBinding` of a store-resident parameter, or ``None``."""
    return getattr(param, _ATTR, None)


def on_grad_ready(param: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> ListenerHandle:
    """Call ``fn(param)`` each time a backward pass has finished ``param``'s gradient.

    Fired from the backward thread once per backward pass (per micro-batch), after the
    gradient was handed to the store; call `sync_grad` before reading it.

    Args:
        param: a store-resident parameter (one that `bind` was called on).
        fn: called with ``param`` inside autograd's backward (keep it short); an exception it
            raises fails the backward pass.

    Returns:
        A handle whose ``remove()`` unregisters ``fn``.

    Raises:
        ValueError: ``param`` is not store-resident.
    """
    b = binding(param)
    if b is None:
        raise ValueError(
            "on_grad_ready needs a store-resident parameter (one offloaded by hr.offload "
            "or bound with headroom.transfer.bind); ordinary parameters have autograd's "
            "register_post_accumulate_grad_hook"
        )
    b.listeners.append(fn)
    return ListenerHandle(b, fn)


def grad_ready(param: torch.Tensor) -> None:
    """Tell ``param``'s listeners (or its relay) that its gradient of this backward pass is
    complete; producers call it after handing the gradient to the store."""
    b = binding(param)
    if b is not None:
        (b.relay if b.relay is not None else relay_done)(param)


def relay_done(param: torch.Tensor) -> None:
    """A relay has finished ``param``'s gradient: tell the listeners (see `grad_ready`)."""
    b = binding(param)
    if b is not None:
        for fn in tuple(b.listeners):
            fn(param)


def flush_grad(b: ParamBinding) -> None:
    """Have ``b``'s producer hand over any gradient it holds back, now, without waiting (for a
    step during ``final_backward``, from that backward's thread)."""
    if b.grad_flush is not None:
        b.grad_flush()


def adopt_grad(b: ParamBinding) -> None:
    """Have ``b``'s producer take what was done to ``param.grad`` since it left it there: a
    tensor assigned becomes the stored gradient, ``None`` clears it (``has_grad`` false). For a
    consumer about to read the gradient or ``has_grad``, between backward passes."""
    if b.grad_adopt is not None:
        b.grad_adopt()


def sync_grad(b: ParamBinding) -> None:
    """Block until every gradient handed over for ``b`` so far rests in its ``grad_handle``."""
    if b.grad_sync is not None:
        b.grad_sync()


def unbind(param: torch.Tensor) -> None:
    """Forget ``param``'s binding (the store keeps its tensors; free them separately)."""
    if hasattr(param, _ATTR):
        delattr(param, _ATTR)


def weak_method(method: Callable[..., None], *args: object) -> Callable[..., None]:
    """``partial(method, *args)`` holding ``method``'s object weakly (calls do nothing once it
    is collected), for a listener or hook that must not keep its owner alive; nor may ``args``."""
    ref = weakref.WeakMethod(method)

    def call(*more: object) -> None:
        fn = ref()
        if fn is not None:
            fn(*args, *more)

    return call


def weak_post_accumulate_grad_hook(tensor: torch.Tensor, method: Callable[..., None],
                                   *args: object) -> torch.utils.hooks.RemovableHandle:
    """``tensor.register_post_accumulate_grad_hook(partial(method, *args))``, holding the
    object of the bound ``method`` weakly (see `weak_method`).

    NOTE: the garbage collector does not see a tensor's post-accumulate-grad hooks, so a hook
    leading back to the tensor makes a cycle never collected: the model, its store, threads
    and folder lock would live until the process ends.
    """
    return tensor.register_post_accumulate_grad_hook(weak_method(method, *args))
