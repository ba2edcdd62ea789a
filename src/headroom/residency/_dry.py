"""`hr.offload`'s schedule in a dry run: what an offloaded model keeps on the device, when.

The dry run's ``meta`` copy of the model gets the groups `hr.offload` would make (the same
`headroom.residency._plan.layout`), a master and a device copy per parameter, and hooks that
fetch and release them exactly where `headroom.residency._schedule` does: the outside group from
the start of forward to the end of backward, each block for its forward and again for its
backward, ``prefetch`` blocks ahead in either direction, and a block released once all its
gradients have gone to the store. Device copies are resized, not replaced, as in the real
schedule, so autograd's saved references stay valid and the tracker sees every byte come and go.

Bytes move at once: a fetch is complete when it starts, and a gradient written to disk is gone
from memory when it is handed over (a real disk write keeps it until written). On an accelerator
the gradients handed to the host stay on the device until the copies are reaped: past 256 MiB
in flight, and at the end of backward (`headroom.transfer.Mover`). With
``grad_accumulation="device"`` the gradients that rest as StoreTensors are held on the device
(in the stored gradient's dtype) until the host optimizer's step reads them (`flush`). A
quantized parameter rests as its parts, and its device copy is its class over parts resized like
any other (`headroom.residency._packed`), so it weighs its packed bytes; adapters kept on the
device (``adapters="device"``) are ordinary parameters of the copy, there for the whole step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from headroom.memory import annotate
from headroom.residency._packed import Packed, is_packed, packing_of, part_key
from headroom.residency._schedule import _AfterBackward, _outputs
from headroom.residency._schedule import in_backward as _in_backward
from headroom.store import MetaStore, Places
from headroom.transfer import MAX_STAGED_BYTES as _MAX_STAGED_BYTES
from headroom.transfer import weak_post_accumulate_grad_hook

# headroom.transfer's mover reaps device gradients in flight to the host past this many bytes


@dataclass(frozen=True)
class OffloadConfig:
    """The options of one `hr.offload` call, as a dry run replays them.

    Attributes:
        module: qualified name of the offloaded module (``""``: the model itself).
        store: ``"host"`` or ``"disk"``.
        prefetch: blocks fetched ahead.
        blocks: qualified names (inside ``module``) of the blocks, or ``None``: found as
            `hr.offload` finds them.
        compute_dtype: the device copies' dtype for floating-point parameters, or ``None``.
        grad_accumulation: ``"store"`` or ``"device"`` (see `hr.offload`).
        adapters: ``"device"`` or ``"store"`` (see `hr.offload`).
        kept: qualified names (inside ``module``) of the parameters kept on the device, as
            an offloaded model keeps them, or ``None``: as ``adapters`` says.
    """

    module: str = ""
    store: str = "host"
    prefetch: int = 1
    blocks: tuple[str, ...] | None = None
    compute_dtype: torch.dtype | None = None
    grad_accumulation: str = "store"
    adapters: str = "device"
    kept: tuple[str, ...] | None = None


def configs_of(model: nn.Module) -> list[OffloadConfig]:
    """The `OffloadConfig` of every `hr.offload` applied to ``model`` or its submodules."""
    from headroom.residency._offload import offload_states

    out = []
    for name, m, state in offload_states(model):
        inner = {id(sub): n for n, sub in m.named_modules()}
        kept = tuple(n for n, p in m.named_parameters(remove_duplicate=False)
                     if state.kept.get(id(p)) is p)
        out.append(OffloadConfig(
            module=name,
            store="host" if state.store.holds_host_memory else "disk",
            prefetch=state.prefetch,
            blocks=tuple(inner[id(b.module)] for b in state.blocks),
            compute_dtype=state.compute_dtype,
            grad_accumulation=state.grad_accumulation,
            adapters=getattr(state, "adapters", "device"),
            kept=kept,
        ))
    return out


def is_offload_hook(fn: Any) -> bool:
    """Whether a module hook belongs to an `hr.offload` state (not copied into dry runs)."""
    from headroom.residency._schedule import Offload

    # hr.offload registers its hooks wrapped by torch.compiler.disable
    fn = getattr(fn, "_torchdynamo_orig_callable", fn)
    while isinstance(fn, partial):
        if any(isinstance(a, Offload) for a in fn.args):
            return True
        fn = fn.func
    if isinstance(getattr(fn, "__self__", None), Offload):
        return True
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            if isinstance(cell.cell_contents, Offload):
                return True
        except ValueError:  # an empty cell
            continue
    return False


class _Slot:
    __slots__ = ("owners", "master", "dev", "nbytes", "handle", "grad_handle", "has_grad",
                 "group", "listeners", "marker", "grad_dtype")

    def __init__(self, owners, master, dev, handle, group) -> None:
        self.owners = owners
        self.master = master
        self.dev = dev
        self.nbytes = dev.numel() * dev.element_size()
        self.handle = handle
        self.grad_handle = None
        self.grad_dtype: torch.dtype | None = None  # fp32 for a host optimizer's master
        self.has_grad = False
        self.group = group
        self.listeners: list[Callable[[torch.Tensor], None]] = []
        self.marker: torch.Tensor | None = None  # param.grad of a gradient not in its dtype

    def show(self, t: nn.Parameter) -> None:
        for module, attr in self.owners:
            module._parameters[attr] = t


class _PackedSlot(_Slot):
    """A quantized parameter: its parts in the store, its device copy a `Packed`'s (the same
    class over ``meta`` parts resized as the real schedule resizes them)."""

    __slots__ = ("packed",)

    def __init__(self, owners, master, packed: Packed, group) -> None:
        super().__init__(owners, master, packed.dev, None, group)
        self.packed = packed
        self.nbytes = packed.nbytes


class _Group:
    def __init__(self, module: nn.Module | None) -> None:
        self.module = module
        self.slots: list[_Slot] = []
        self.resident = False
        self.grads_left = 0
        self.inputs_pending = 0


class OffloadDryRun:
    """`hr.offload(module, ...)` on a dry run's ``meta`` copy (see the module docstring).

    Args:
        root: the meta copy of the whole model.
        config: what to offload and how.
        places: where the dry run's tensors stand (host masters and gradients, disk
            placeholders).
        accelerated: the target is an accelerator (gradients reaped from the device late).
    """

    def __init__(self, root: nn.Module, config: OffloadConfig, places: Places, *,
                 accelerated: bool) -> None:
        from headroom.residency._plan import layout

        module = root.get_submodule(config.module) if config.module else root
        given = None if config.blocks is None else [module.get_submodule(n)
                                                     for n in config.blocks]
        lay = layout(module, device=torch.device("meta"), blocks=given,
                     prefetch=config.prefetch, compute_dtype=config.compute_dtype,
                     adapters=_kept(module, config))
        self.config = config
        self.places = places
        self.accelerated = accelerated
        self.prefetch = config.prefetch
        self.store = MetaStore(places, host=config.store == "host")
        self.blocks = [_Group(m) for m in lay.block_modules]
        self.rest = _Group(None)
        self.slots: list[_Slot] = []
        self.by_dev: dict[int, _Slot] = {}
        self.by_master: dict[int, _Slot] = {}
        self.order: list[_Group] = []
        self._order_now: list[_Group] = []
        self._root_running = False
        self._bwd = False
        self._bwd_task = -1
        self._bwd_seen: set[int] = set()
        self._in_flight: deque = deque()
        self._staged = 0
        self._held: dict[int, tuple[_Slot, torch.Tensor]] = {}
        for pid, p in lay.params.items():
            g = lay.group_of[pid]
            group = self.blocks[g] if g >= 0 else self.rest
            if is_packed(p):
                self._add_packed(p, lay.names[pid], lay.owners[pid], group)
                continue
            cdtype = (config.compute_dtype if config.compute_dtype is not None
                      and p.is_floating_point() else p.dtype)
            dev = nn.Parameter(torch.empty(p.shape, dtype=cdtype, device="meta"),
                               requires_grad=p.requires_grad)
            torch.ops.inductor.resize_storage_bytes_(dev, 0)
            if self.store.host:
                master = p  # the store's host tensor is the parameter's data
                handle = self.store.adopt(lay.names[pid], p.data)
            else:
                master = nn.Parameter(
                    places.no_memory(torch.empty(p.shape, dtype=p.dtype, device="meta")),
                    requires_grad=p.requires_grad)
                handle = self.store.alloc(lay.names[pid], tuple(p.shape), p.dtype)
            slot = _Slot(lay.owners[pid], master, dev, handle, group)
            # param.grad of a gradient that cannot be it (on disk, or fp32 for a host
            # optimizer's master): made here, before any tracker; a meta tensor, no memory
            slot.marker = places.no_memory(
                torch.empty((), dtype=p.dtype, device="meta")).expand(p.shape)
            slot.show(master)
            group.slots.append(slot)
            self.slots.append(slot)
            self.by_dev[id(dev)] = slot
            self.by_master[id(master)] = slot
            if p.is_floating_point() or p.is_complex():
                rg = dev.requires_grad
                dev.requires_grad_(True)
                weak_post_accumulate_grad_hook(dev, self._grad_hook)  # see its NOTE
                dev.requires_grad_(rg)
        module.register_forward_pre_hook(self._root_pre_forward, prepend=True)
        module.register_forward_hook(self._root_post_forward)
        for b in self.blocks:
            b.module.register_forward_pre_hook(partial(self._pre_forward, b), with_kwargs=True,
                                               prepend=True)
            b.module.register_forward_hook(partial(self._post_forward, b))

    def _add_packed(self, p: torch.Tensor, name: str, owners: list, group: _Group) -> None:
        """A quantized parameter's parts rest in the store; it does not train."""
        packing, parts = packing_of(p, name, owners)
        handles = {}
        for k, t in parts.items():
            key = part_key(name, k)
            if self.store.host:  # the store's host tensors are the master's parts
                handles[k] = self.store.adopt(key, t)
            else:
                self.places.no_memory(t)  # at rest on disk
                handles[k] = self.store.alloc(key, tuple(t.shape), t.dtype)
        packed = Packed(name, owners, packing, handles, p, torch.device("meta"))
        slot = _PackedSlot(owners, p, packed, group)
        slot.show(p)
        group.slots.append(slot)
        self.slots.append(slot)
        self.by_dev[id(slot.dev)] = slot
        self.by_master[id(p)] = slot

    # ------------------------------------------------------------------ residency
    def _fetch(self, g: _Group) -> None:
        if g.resident:
            return
        g.resident = True
        for s in g.slots:
            if isinstance(s, _PackedSlot):
                self._fetch_packed(s)
                continue
            torch.ops.inductor.resize_storage_bytes_(s.dev, s.nbytes)
            host = self.store.host_tensor(s.handle)
            if host is not None:
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(s.dev):
                    s.dev.detach().copy_(host)
                if self.accelerated:
                    self.store.read_bytes += s.nbytes  # over the host link
            else:
                self.store.read(s.handle, out=s.dev)

    def _fetch_packed(self, s: _PackedSlot) -> None:
        for handle, target in s.packed.items():
            host = self.store.host_tensor(handle)
            if host is not None:
                with torch.no_grad():
                    target.copy_(host)
                if self.accelerated:
                    self.store.read_bytes += handle.nbytes  # over the host link
            else:
                self.store.read(handle, out=target)

    def _release(self, g: _Group) -> None:
        if not g.resident:
            return
        _hide(g)
        for s in g.slots:
            if isinstance(s, _PackedSlot):
                s.packed.free()
            else:
                torch.ops.inductor.resize_storage_bytes_(s.dev, 0)
        g.resident = False

    def _prefetch(self, order: list[_Group], start: int, step: int) -> None:
        i = start
        for _ in range(self.prefetch):
            i += step
            if not 0 <= i < len(order):
                return
            if step < 0 and id(order[i]) in self._bwd_seen:
                continue
            self._fetch(order[i])

    # ------------------------------------------------------------------ forward
    def _root_pre_forward(self, module, args) -> None:
        if _in_backward():
            self._fetch(self.rest)
            _show(self.rest)
            return
        for b in self.blocks:
            self._release(b)
        self._root_running = True
        self._order_now = []
        self._fetch(self.rest)
        _show(self.rest)
        self._prefetch(self.order or self.blocks, -1, 1)

    def _root_post_forward(self, module, args, output) -> None:
        if _in_backward():
            return
        self._root_running = False
        self.order = self._order_now or self.order
        for b in self.blocks:
            self._release(b)
        outs = _outputs(output) if torch.is_grad_enabled() else []
        if outs:
            _hide(self.rest)
            hook = partial(self._pre_backward, self.rest)
            for t in outs:
                t.register_hook(hook)
        else:
            self._release(self.rest)

    def _pre_forward(self, block: _Group, module, args, kwargs):
        if _in_backward():  # recomputation inside backward (activation checkpointing)
            self._fetch(block)
            _show(block)
            return None
        self._fetch(block)
        _show(block)
        for s in block.slots:
            if s.dev.requires_grad != s.master.requires_grad:
                s.dev.requires_grad_(s.master.requires_grad)
        self._order_now.append(block)
        order = self.order if block in self.order else self.blocks
        self._prefetch(order, order.index(block), 1)
        if torch.is_grad_enabled() and any(not s.dev.requires_grad for s in block.slots):
            return self._watch_inputs(block, args, kwargs)
        return None

    def _watch_inputs(self, block: _Group, args, kwargs):
        idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        keys = [k for k, a in kwargs.items() if isinstance(a, torch.Tensor) and a.requires_grad]
        if not idx and not keys:
            return None
        block.inputs_pending += 1
        outs = _AfterBackward.apply(partial(self._inputs_done, block),
                                    *[args[i] for i in idx], *[kwargs[k] for k in keys])
        outs = outs if isinstance(outs, tuple) else (outs,)
        args = list(args)
        for j, i in enumerate(idx):
            args[i] = outs[j]
        kwargs = dict(kwargs)
        for j, k in enumerate(keys):
            kwargs[k] = outs[len(idx) + j]
        return tuple(args), kwargs

    def _inputs_done(self, block: _Group) -> None:
        block.inputs_pending = max(0, block.inputs_pending - 1)
        self._maybe_release(block)

    def _maybe_release(self, block: _Group) -> None:
        if id(block) in self._bwd_seen and block.grads_left == 0 and block.inputs_pending == 0:
            self._release(block)

    def _post_forward(self, block: _Group, module, args, output) -> None:
        if _in_backward():
            return
        if torch.is_grad_enabled():
            hook = partial(self._pre_backward, block)
            for t in _outputs(output):
                t.register_hook(hook)
        self._release(block)

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, block: _Group, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if not self._bwd or task != self._bwd_task:
            for s in self.slots:
                if s.dev.requires_grad and s.grad_handle is None:
                    s.grad_handle = self.store.alloc(f"{s.handle.key}.grad", s.handle.shape,
                                                     s.grad_dtype or s.handle.dtype)
            self._bwd = True
            self._bwd_task = task
            self._bwd_seen = set()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if id(block) in self._bwd_seen:
            return
        self._bwd_seen.add(id(block))
        block.grads_left = sum(1 for s in block.slots if s.dev.requires_grad)
        self._fetch(block)
        _show(block)
        if block is not self.rest and block in self.order:
            self._prefetch(self.order, self.order.index(block), -1)

    def _grad_hook(self, dev: torch.Tensor) -> None:
        slot = self.by_dev[id(dev)]
        g = dev.grad
        dev.grad = None
        if g is None:
            return
        p = slot.master
        host = self.store.host_tensor(slot.grad_handle)
        accumulate = p.grad is not None
        if (self.config.grad_accumulation == "device"
                and (host is None or host.dtype != p.dtype)):
            # held on the device, in the stored gradient's dtype, until the step reads it
            held = self._held.get(id(slot))
            if held is None or not accumulate:
                acc = g if g.dtype == slot.grad_handle.dtype else g.to(slot.grad_handle.dtype)
                annotate(acc, "gradients")
                self._held[id(slot)] = (slot, acc, not accumulate)
            else:
                with torch.no_grad():
                    held[1].add_(g)
            if not accumulate:
                p.grad = slot.marker
        else:
            self._push(slot, g, accumulate)
        slot.has_grad = True
        del g
        for fn in slot.listeners:
            fn(p)
        block = slot.group
        if id(block) in self._bwd_seen:
            block.grads_left -= 1
            if block.grads_left == 0 and any(s.dev.requires_grad for s in block.slots):
                self._maybe_release(block)

    def _push(self, slot: _Slot, g: torch.Tensor, accumulate: bool) -> None:
        """Hand a gradient to the store, as `headroom.transfer.Mover.push_grad` does."""
        p = slot.master
        host = self.store.host_tensor(slot.grad_handle)
        if self.accelerated:
            # the device gradient stays until its copy to the host is reaped
            self._in_flight.append(g)
            self._staged += g.numel() * g.element_size()
            while self._staged > _MAX_STAGED_BYTES:
                done = self._in_flight.popleft()
                self._staged -= done.numel() * done.element_size()
        if host is not None:
            with torch.no_grad():
                if accumulate:
                    host.add_(g)
                else:
                    host.copy_(g)
            if not accumulate:
                p.grad = host if host.dtype == p.dtype else slot.marker
            if self.accelerated:
                self.store.written_bytes += slot.grad_handle.nbytes  # over the host link
        else:
            if accumulate:  # read, add, write back
                self.store.read_bytes += slot.grad_handle.nbytes
            if g.dtype != slot.grad_handle.dtype:
                g = g.to(slot.grad_handle.dtype)  # the disk write gets a copy in its dtype
            self.store.write(slot.grad_handle, g)
            if not accumulate:
                p.grad = slot.marker

    def flush(self, slot: _Slot | None = None) -> None:
        """Hand the gradients held on the device (``slot``'s, or all) to the store, as a read
        of the stored gradient makes `hr.offload`'s schedule do; cleared ones are dropped."""
        if slot is None:
            todo, self._held = list(self._held.values()), {}
        else:
            one = self._held.pop(id(slot), None)
            todo = [] if one is None else [one]
        for s, acc, fresh in todo:
            if s.master.grad is None or not s.has_grad:
                continue
            self._push(s, acc, not fresh)
        del todo

    def _end_backward(self) -> None:
        self._bwd = False
        self._bwd_seen = set()
        for b in self.blocks:
            b.inputs_pending = 0
            self._release(b)
        self._release(self.rest)
        self._in_flight.clear()
        self._staged = 0


def _kept(module: nn.Module, config: OffloadConfig) -> str | set[int]:
    """What `layout` keeps on the device in the ``meta`` copy: the parameters an offloaded
    model keeps, or the adapters `hr.offload` would keep.

    NOTE: every parameter of the copy is ``meta``, which `layout` takes for an adapter still
    without values (one that rests in the store): the adapters are named here instead.
    """
    if config.kept is not None:
        named = dict(module.named_parameters(remove_duplicate=False))
        return {id(named[n]) for n in config.kept if n in named}
    if config.adapters != "device":
        return "store"
    from headroom.residency._plan import adapter_modules

    mods = adapter_modules(module)
    owned: dict[int, list[nn.Module]] = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                owned.setdefault(id(p), []).append(m)
    return {pid for pid, ms in owned.items() if all(id(m) in mods for m in ms)}


def _show(g: _Group) -> None:
    for s in g.slots:
        s.show(s.dev)


def _hide(g: _Group) -> None:
    for s in g.slots:
        s.show(s.master)
