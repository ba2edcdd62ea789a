"""The residency primitive: groups of offloaded parameters, fetched to the device and released.

[Note: masters and device copies] Every offloaded parameter keeps two tensors. The *master* is
the ``nn.Parameter`` the model registers, which optimizers and checkpoints see (``binding(p)``):
with ``store="cpu"`` its data *is* the store's host tensor, with a `DiskStore` it is a
`StoreTensor` whose ops run on the values on disk. Its value is written only through its store
(`HostOptimizer`, ``hr.load``, ``load_state_dict``, ``hr.load_weights``), and whoever writes a
whole value marks ``binding.has_value``. The *device copy*, which autograd sees, is a second
leaf parameter on the compute device whose storage is resized to 0 while its group is not
resident. Autograd saves the device copies themselves, not their bytes, so a group released
after its forward is fetched again, into the same tensors, before its backward (version
counters preserved; FSDP2 frees unsharded parameters the same way).

`Residency` moves groups (`fetch`, `ensure`, `release`); when is the caller's business (the
hooks of `headroom.residency._schedule`). `show` puts a group's device copies into its
modules, `hide` the masters again.

[Note: shared device copies] On a CPU device, a frozen master (no ``requires_grad``, no
gradient) resting in host memory in the compute dtype is not copied: `fetch` points its device
copy at the master's memory (``dev.data = host``, the device copy keeping its version counter)
and `release` gives it back its own empty storage. A write to the master while resident
(``load_state_dict``, ``p.data`` edits) shows at once, where a copy would show it after the
next fetch. Masters with a gradient are not shared; one unfrozen while resident (after
`hr.prefetch`) is written by `HostOptimizer` only once its gradient is complete, when no
backward node reads it. Never resized while shared (that frees the master): `release` is the
only way back. Views of a device copy that autograd saved keep the storage they were made on:
one filled by a copy is filled by a copy again while anything else holds it. A group whose
device copies all show their masters (`Group.free`) stays resident from its forward to the end
of the backward: releasing it would free nothing, fetching it again would cost time.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from headroom.residency._packed import Packed, trains
from headroom.store import HeapTrimmer, Store
from headroom.transfer import Mover, ParamBinding, Ticket, resize_storage

__all__ = ["DeviceCopy", "Group", "Residency", "Slot"]


class DeviceCopy(nn.Parameter):
    """The device-side copy of an offloaded parameter (storage empty while not resident)."""

    def __repr__(self) -> str:
        # Printing a tensor whose storage was resized to 0 reads freed memory.
        resident = self.untyped_storage().nbytes() > 0
        return (f"DeviceCopy(shape={tuple(self.shape)}, dtype={self.dtype},"
                f" device={self.device}, resident={resident})")

    def __deepcopy__(self, memo):
        # Cloning a storage resized to 0 reads freed memory.
        raise RuntimeError(
            "copy.deepcopy() of an offloaded model or module during its forward or backward"
            " (the device copies of its parameters are shown then); copy it between steps"
        )


class Slot:
    """One unique offloaded parameter: master, device copy, where it is registered."""

    __slots__ = ("name", "owners", "param", "dev", "binding", "ticket", "group", "nbytes",
                 "own", "shared")

    def __deepcopy__(self, memo):
        return self  # offload bookkeeping is shared by copies of hooks, never copied

    def __init__(self, name: str, owners: list[tuple[nn.Module, str]], param: nn.Parameter,
                 dev: nn.Parameter, b: ParamBinding) -> None:
        self.name = name
        self.owners = owners
        self.param = param
        self.dev = dev
        self.binding = b
        self.ticket: Ticket | None = None
        self.group: Group | None = None
        self.nbytes = dev.numel() * dev.element_size()
        # the device copy's own storage, kept while it shows its master's (`shared`)
        self.own: torch.Tensor | None = None
        self.shared = False

    def show(self, t: nn.Parameter) -> None:
        # NOTE: not `setattr`, which re-registers and refuses a swap while the module runs;
        # `dict.__setitem__` skips a ParamDict's own (`_outside`), which guards moves to meta.
        for module, attr in self.owners:
            dict.__setitem__(module._parameters, attr, t)


class Group:
    """Parameters fetched and released together: a block, or the parameters outside blocks."""

    def __deepcopy__(self, memo):
        return self  # offload bookkeeping is shared by copies of hooks, never copied

    def __init__(self, name: str, module: nn.Module | None) -> None:
        self.name = name
        self.module = module
        self.slots: list[Slot] = []
        # quantized parameters resting packed (see [Note: packed parameters]); frozen
        self.packed: list[Packed] = []
        self.resident = False
        self.free = False  # resident, every device copy showing its master's memory
        self.grads_left = 0
        self.inputs_pending = 0  # forward calls whose input gradients are not computed yet

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots) + sum(q.nbytes for q in self.packed)


class Residency:
    """Moves groups of offloaded parameters between ``store`` and the compute ``device``."""

    def __init__(self, device: torch.device, store: Store) -> None:
        self.device = device
        self.store = store
        # thread-safe: an optimizer's worker may wait for gradients (`Mover.synchronize`) the
        # backward thread pushes
        self.mover = Mover(device, store)
        # NOTE: on the CPU, device copies are host memory freed and allocated group after
        # group (see headroom.store._heap). Not trimmed when the masters rest in host memory
        # too: the model is in RAM then, and trimming cost 10-20% of a step of
        # benchmarks/offload_overhead.py. Every 32 MiB, not every block: a trim also hands
        # back what autograd just freed. GPT-2 small from a DiskStore under Trainer
        # (benchmarks/trainer_finetune.py, 2048 tokens, checkpointed), step time and RSS vs
        # plain: trim per 28 MiB block 1.46x/0.54x, per 32 MiB 1.24x/0.57x, never 1.04x/0.91x.
        self._trimmer = (HeapTrimmer(32 << 20) if device.type == "cpu"
                         and not store.holds_host_memory else None)
        # See [Note: shared device copies].
        self.shares = device.type == "cpu" and store.holds_host_memory

    def fetch(self, group: Group) -> None:
        """Start bringing a group to the device (no wait; the modules still hold the masters);
        on an accelerator its copies share one event before them and one after."""
        if group.resident:
            return
        group.resident = True  # first: a fetch that fails half-way is released whole
        copied, items = [], []
        with torch._C.DisableTorchFunctionSubclass():  # masters' reads as plain tensors'
            for s in group.slots:
                _check_master(s)
                if not (self.shares and self._share(s)):
                    resize_storage(s.dev, s.nbytes)
                    copied.append(s)
                    items.append((s.binding.handle, s.dev))
        for q in group.packed:
            _check_packed(q)
            items += q.items()
        group.free = not items
        tickets = self.mover.fetch_many(items)
        for s, t in zip(copied, tickets, strict=False):
            s.ticket = t
        i = len(copied)
        for q in group.packed:
            q.tickets = tickets[i:i + len(q.parts)]
            i += len(q.parts)

    def _share(self, s: Slot) -> bool:
        """Make ``s``'s device copy show its master's memory if it may ([Note: shared device
        copies]); masters read as plain tensors."""
        p = s.param
        if p.requires_grad or s.dev.requires_grad or p.grad is not None or s.binding.has_grad:
            return False
        host = self.store.host_tensor(s.binding.handle)
        if host is None or host.dtype != s.dev.dtype:
            return False
        if s.own is None:
            s.own = s.dev.detach()  # keeps the device copy's own (empty) storage
        if torch._C._storage_Use_Count(s.own.untyped_storage()._cdata) > _OWN_ONLY:
            # views autograd saved (a forward that copied, its backward to come) read it
            return False
        s.dev.data = host  # the version counter stays the device copy's
        s.shared = True
        return True

    def ensure(self, group: Group) -> None:
        """Make a group resident and ready for compute (the current stream is ordered after
        its copies; modules may be shown its device copies from then on)."""
        self.fetch(group)
        for s in group.slots:
            if s.ticket is not None:
                self.mover.wait(s.ticket)
                s.ticket = None
        for q in group.packed:
            while q.tickets:
                self.mover.wait(q.tickets[0])
                q.tickets.pop(0)

    def release(self, group: Group, *, quiet: bool = False) -> None:
        """Free a group's device copies (the modules get the masters back); ``quiet``: on a
        failure path, where a fetch that failed must not hide the error being raised."""
        if not group.resident:
            return
        hide(group)
        for s in group.slots:
            if s.shared:  # its master's memory stays; the device copy gets its own back
                s.dev.data = s.own
                s.shared = False
                continue
            if s.ticket is not None:  # a prefetch that was never used
                # waited even when quiet: a disk read may still land in the storage
                try:
                    self.mover.wait(s.ticket)
                except Exception:
                    if not quiet:
                        raise
                s.ticket = None
            resize_storage(s.dev, 0)
        for q in group.packed:
            for t in q.tickets:  # a prefetch that was never used
                try:
                    self.mover.wait(t)
                except Exception:
                    if not quiet:
                        raise
            q.tickets = []
            q.free()
        group.resident = group.free = False
        if self._trimmer is not None:
            self._trimmer.freed(group.nbytes)

    def push_grad(self, grad: torch.Tensor, b: ParamBinding, *, accumulate: bool) -> None:
        """Hand a finished gradient to the store (see `headroom.transfer.Mover.push_grad`)."""
        self.mover.push_grad(grad, b, accumulate=accumulate)


# references to a device copy's own storage held by its two tensors and the asking storage
_OWN_ONLY = 3


def show(group: Group) -> None:
    """The modules compute with the group's device copies (inside a forward), which must be
    ready: `Residency.ensure` first (a prefetch still copying is never shown)."""
    for s in group.slots:
        if s.ticket is not None:
            raise RuntimeError(f"internal: {s.name!r} shown before its copy was waited for")
        s.show(s.dev)
    for q in group.packed:
        if q.tickets:
            raise RuntimeError(f"internal: {q.name!r} shown before its copy was waited for")
        q.show(q.dev)


def hide(group: Group) -> None:
    """The modules hold the masters again (residency unchanged)."""
    for s in group.slots:
        s.show(s.param)
    for q in group.packed:
        q.show(q.param)


def _check_packed(q: Packed) -> None:
    if q.param.requires_grad:
        raise RuntimeError(trains(q.param, q.name, "was set to require grad after hr.offload"))


def _check_master(s: Slot) -> None:
    h = s.binding.handle
    p = s.param
    if tuple(p.shape) != h.shape:
        raise RuntimeError(
            f"offloaded parameter {s.name!r} was resized to {tuple(p.shape)} after hr.offload"
            f" (its stored master is {h.shape}), e.g. by resize_token_embeddings or by"
            " rebinding its .data: the store keeps the shape it was offloaded with. Resize"
            " before hr.offload, or hr.unoffload(model), resize, and offload again"
        )
    if p.dtype != h.dtype or p.device.type not in ("cpu", "meta"):
        raise RuntimeError(
            f"offloaded parameter {s.name!r} was changed to {p.dtype} {tuple(p.shape)} on"
            f" {p.device} after hr.offload (its stored master is {h.dtype} {h.shape}), e.g."
            " by .half()/.to() on a submodule. Offloaded parameters keep their stored dtype:"
            " use hr.offload(..., compute_dtype=...) to compute in another dtype, or"
            " hr.unoffload(model), convert, and offload again"
        )
