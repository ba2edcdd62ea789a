"""Store-resident parameters: which store holds a parameter's master copy and its gradient.

Besides where things rest, a binding carries one small signal between the code that *produces*
a store-resident gradient (the offload layer) and the code that *consumes* it (an optimizer):
`on_grad_ready` registers a listener, the producer calls `grad_ready` once the parameter's
gradient of one backward pass is complete, and a consumer calls `sync_grad` before reading it
(the producer's writes may still be in flight then; a producer that sums several backward
passes' gradients before the store, ``hr.offload(..., grad_accumulation="device")``, hands
that sum over then, or at once on `flush_grad` from a consumer that reads the gradient as soon
as it is ready). Listeners are removed with the handle
`on_grad_ready` returns, like a ``torch`` hook. A *relay* (data parallel, which averages the
gradient across processes first) may stand between the two: `grad_ready` then hands the
parameter to it alone, and it calls `relay_done` once the gradient is final.
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
    """Record that the values stored under ``key`` were written by someone other than their
    consumer (see `value_edits`)."""
    counts = _VALUE_EDITS.get(store)
    if counts is None:
        counts = _VALUE_EDITS[store] = {}
    counts[key] = counts.get(key, 0) + 1


def value_edits(store: Store, key: str) -> int:
    """How many times the values of a store-resident parameter under ``key`` were written
    other than by its optimizer's step: whole values (whoever writes one sets
    ``binding.has_value``: ``hr.load``, ``hr.load_weights``, ``load_state_dict``,
    initialization) and in-place ops through a `StoreTensor` over them (``p.copy_``,
    ``nn.init.*``, ``p.data = t``). A consumer that keeps a copy of the values (an optimizer's
    fp32 master of a bf16 parameter on disk) compares it with the count it last saw to know
    that the stored values changed, without reading them. Values in host memory can also be
    changed through the tensor itself, unseen here: compare the values there."""
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
        grad_rows: rows of ``grad_handle`` that hold a non-zero gradient (sorted LongTensor), or
            ``None`` for a dense gradient. Producers of sparse row gradients set it; consumers
            may touch only those rows.
        has_grad: ``grad_handle`` (or ``grad_sparse``) holds a gradient that has not been
            consumed yet. Producers set it when they write a gradient; consumers (an
            optimizer's ``zero_grad``) clear it, and the next producer then overwrites instead
            of accumulating.
        grad_sparse: the gradient when it is a sparse COO tensor (``nn.Embedding(sparse=True)``),
            in host memory as autograd accumulates it (entries in order, not coalesced: a
            sparse optimizer step depends on both), or ``None``. While set, it is the gradient
            and ``grad_handle`` holds nothing of it.
        grad_sync: set by the producer: blocks until every gradient it has handed over so far
            rests in ``grad_handle`` (its writes may run in the background; a sum held back
            on the device is handed over first). ``None``: the gradient is in place as soon
            as `grad_ready` fires.
        grad_flush: set by a producer that may hold gradients back (summed on the device
            across backward passes): hands what it holds for this parameter to the store now,
            without waiting for it to land. ``None``: nothing is ever held back.
        grad_adopt: set by the producer: makes the stored gradient what ``param.grad`` says
            where it was changed since the producer left it there (see `adopt_grad`).
            ``None``: ``param.grad`` is not the producer's to watch.
        grad_dtype: the dtype a producer allocates ``grad_handle`` in (``None``: the
            parameter's). A consumer that wants full-precision accumulation of a low-precision
            parameter's gradient (an optimizer with fp32 masters) sets ``torch.float32``.
        grad_edits: how many in-place changes were made to the stored gradient through a
            tensor over it (``param.grad`` a `StoreTensor`: clipping, unscaling, ``mul_``):
            a consumer that started using the gradient can tell that it changed since.
        has_value: ``False`` while ``handle`` holds no value yet (a parameter created on
            ``meta``, still to be loaded or initialized): consumers must not read it then.
            Whoever writes the whole value sets it (which counts in `value_edits`).
        listeners: callables ``fn(param)`` that `grad_ready` calls (see `on_grad_ready`).
        relay: ``fn(param)`` that `grad_ready` calls instead of the listeners, or ``None``: a
            consumer that changes the gradient before anyone may read it (data parallel
            averaging it across processes) calls `relay_done` when it is final.
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
        # Weakly, as torch's hook handles: a handle kept (by a finalizer, say) must not keep
        # the parameter's binding, and through it the model's offload state, alive.
        self._binding: weakref.ref[ParamBinding] | None = weakref.ref(b)
        self._fn = fn

    def remove(self) -> None:
        b = self._binding() if self._binding is not None else None
        self._binding = None
        if b is not None:
            # By identity, so two registrations of the same function stay independent.
            ls = b.listeners
            for i, f in enumerate(ls):
                if f is self._fn:
                    del ls[i]
                    break


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

    The producer of a store-resident gradient (the offload layer) fires it from the backward
    thread, once per backward pass, after handing the gradient to the store; with gradient
    accumulation it fires once per micro-batch, so the listener counts. Before reading the
    gradient (e.g. on another thread), call `sync_grad`.

    Args:
        param: a store-resident parameter (one that `bind` was called on).
        fn: called with ``param``; runs inside autograd's backward, so keep it short and hand
            heavy work to another thread. An exception it raises fails the backward pass.

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
    """Tell ``param``'s listeners that its gradient of this backward pass is complete.

    Producers call it after handing the gradient to the store (`Mover.push_grad`); the
    binding's ``grad_sync`` is what makes the handed-over bytes readable.
    """
    b = binding(param)
    if b is not None:
        if b.relay is not None:
            b.relay(param)
        else:
            relay_done(param)


def relay_done(param: torch.Tensor) -> None:
    """A relay has finished ``param``'s gradient: tell the listeners (see `grad_ready`)."""
    b = binding(param)
    if b is not None:
        for fn in tuple(b.listeners):
            fn(param)


def flush_grad(b: ParamBinding) -> None:
    """Have ``b``'s producer hand over any gradient it holds back, now (does not wait: see
    `sync_grad`). For a consumer about to read the gradient of the backward that just made it
    complete (a step during ``final_backward``), from that backward's thread."""
    if b.grad_flush is not None:
        b.grad_flush()


def adopt_grad(b: ParamBinding) -> None:
    """Have ``b``'s producer take what was done to ``param.grad`` since it left it there: a
    tensor assigned to it becomes the stored gradient (``has_grad``), ``None`` clears the
    stored gradient (``has_grad`` false: an optimizer skips the parameter, as torch's skip a
    parameter whose ``.grad`` is ``None``). For a consumer about to read the gradient or ask
    `ParamBinding.has_grad`, between backward passes."""
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
    """``partial(method, *args)`` holding the object of the bound ``method`` weakly: once it is
    collected, calls do nothing. For a listener (`on_grad_ready`) or hook that must not keep its
    owner alive; ``args`` must not lead to the owner either."""
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

    NOTE: Python's garbage collector does not see a tensor's post-accumulate-grad hooks (torch
    leaves them out of the tensor's traversal), so a hook leading back to the tensor (an offload
    state or an optimizer holding the parameter it is registered on) makes a cycle that is never
    collected: the model, its store, threads and folder lock would live until the process ends.
    """
    return tensor.register_post_accumulate_grad_hook(weak_method(method, *args))
