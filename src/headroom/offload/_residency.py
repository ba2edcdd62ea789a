"""Residency of offloaded parameters: which block is on the device, and the hooks that move it.

How it works (one concept per piece):

- Every offloaded parameter keeps two tensors. The *master* is the ``nn.Parameter`` object the
  model registers and optimizers see: with ``store="cpu"`` its data *is* the store's host tensor
  (zero-copy), so any ``torch.optim`` optimizer steps it in place; with a `DiskStore` it is a
  ``meta`` placeholder and the values live on disk. The *device copy* is a second leaf parameter
  on the compute device whose storage is resized to 0 while the block is not resident.
- A block's forward pre-hook refills its device copies (waiting for a prefetch started earlier)
  and swaps them into the modules; the forward post-hook swaps the masters back and frees the
  device storage. Autograd saved the device copies themselves, not their bytes, so:
- a hook on the block's outputs fires before the block's backward and refills the same device
  tensors (FSDP2 frees unsharded parameters this way); version counters are preserved, so
  autograd's saved-tensor checks pass and the memory is freed again after the block's backward.
- each device copy's post-accumulate-grad hook moves its finished gradient into the store
  (accumulating in the master dtype when a gradient is already there) and frees it.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from headroom.memory import resize_storage
from headroom.transfer import Mover, ParamBinding, Store, Ticket, grad_ready

__all__ = ["Offload", "Block", "Slot", "DeviceCopy", "in_backward"]


def in_backward() -> bool:
    """True inside an autograd backward pass (e.g. during a checkpoint's recomputation)."""
    return torch._C._current_graph_task_id() != -1


def _outputs(output: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(output)
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        # NOTE: objects pytree does not know (e.g. some model-output classes) are walked by hand.
        leaves = []
        stack = [output]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                leaves.append(x)
            elif isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
            elif hasattr(x, "__dict__") and not isinstance(x, nn.Module):
                stack.extend(vars(x).values())
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


class DeviceCopy(nn.Parameter):
    """The device-side copy of an offloaded parameter (storage empty while not resident)."""

    def __repr__(self) -> str:
        # NOTE: printing a tensor whose storage was resized to 0 reads freed memory.
        resident = self.untyped_storage().nbytes() > 0
        return (f"DeviceCopy(shape={tuple(self.shape)}, dtype={self.dtype},"
                f" device={self.device}, resident={resident})")


class _AfterBackward(torch.autograd.Function):
    """Identity on a block's inputs whose backward reports that their gradients are done."""

    @staticmethod
    def forward(ctx, callback, *xs):
        ctx.callback = callback
        outs = tuple(x.view_as(x) for x in xs)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class Slot:
    """One unique offloaded parameter: master, device copy, where it is registered."""

    __slots__ = ("name", "owners", "param", "dev", "binding", "ticket", "block", "nbytes")

    def __init__(self, name: str, owners: list[tuple[nn.Module, str]], param: nn.Parameter,
                 dev: nn.Parameter, b: ParamBinding) -> None:
        self.name = name
        self.owners = owners
        self.param = param
        self.dev = dev
        self.binding = b
        self.ticket: Ticket | None = None
        self.block: Block | None = None
        self.nbytes = dev.numel() * dev.element_size()

    def show(self, t: nn.Parameter) -> None:
        # NOTE: write the module's parameter dict directly: `setattr` would re-register and
        # refuse swapping a parameter while its module runs.
        for module, attr in self.owners:
            module._parameters[attr] = t


class Block:
    def __init__(self, name: str, module: nn.Module | None) -> None:
        self.name = name
        self.module = module
        self.slots: list[Slot] = []
        self.resident = False
        self.grads_left = 0
        self.inputs_pending = 0  # forward calls whose input gradients are not computed yet

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


class Offload:
    """Per-model state: blocks, the mover and every hook (removed again by `unoffload`)."""

    def __init__(self, model: nn.Module, device: torch.device, store: Store, prefetch: int,
                 compute_dtype: torch.dtype | None, auto: bool) -> None:
        self.model = model
        self.device = device
        self.store = store
        self.mover = Mover(device, store)
        # NOTE: the mover is driven by the backward thread; `sync_grads` may also be called by
        # an optimizer's worker thread (HostOptimizer stepping a block during backward), so
        # every use of the mover holds this lock.
        self.lock = threading.Lock()
        self.prefetch = prefetch
        self.compute_dtype = compute_dtype
        self.auto = auto
        self.blocks: list[Block] = []
        self.rest = Block("(outside blocks)", None)
        self.slots: list[Slot] = []
        self.by_dev: dict[int, Slot] = {}
        self.by_param: dict[int, Slot] = {}
        self.handles: list[Any] = []
        self.order: list[Block] = []  # forward order of the last forward
        self._order_now: list[Block] = []
        self._bwd = False
        self._bwd_task = -1
        self._bwd_seen: set[int] = set()
        self._bypass: list[str] = []
        self.buffers: list[str] = []

    # ------------------------------------------------------------------ residency
    def fetch(self, block: Block) -> None:
        """Start bringing a block to the device (no wait)."""
        if block.resident:
            return
        for s in block.slots:
            resize_storage(s.dev, s.nbytes)
            with self.lock:
                s.ticket = self.mover.fetch(s.binding.handle, s.dev)
            s.show(s.dev)
        block.resident = True

    def ensure(self, block: Block) -> None:
        """Make a block resident and ready for compute."""
        self.fetch(block)
        for s in block.slots:
            if s.ticket is not None:
                with self.lock:
                    self.mover.wait(s.ticket)
                s.ticket = None

    def release(self, block: Block) -> None:
        if not block.resident:
            return
        for s in block.slots:
            if s.ticket is not None:  # a prefetch that was never used
                with self.lock:
                    self.mover.wait(s.ticket)
                s.ticket = None
            resize_storage(s.dev, 0)
            s.show(s.param)
        block.resident = False

    def _prefetch(self, order: list[Block], start: int, step: int) -> None:
        i = start
        for _ in range(self.prefetch):
            i += step
            if not 0 <= i < len(order):
                return
            if step < 0 and id(order[i]) in self._bwd_seen:
                continue
            self.fetch(order[i])

    # ------------------------------------------------------------------ forward hooks
    def root_pre_forward(self, module, args, kwargs):
        if in_backward():
            self.ensure(self.rest)
            return None
        self._order_now = []
        self.ensure(self.rest)
        order = self.order or self.blocks
        self._prefetch(order, -1, 1)
        return None

    def root_post_forward(self, module, args, kwargs, output):
        if in_backward():
            return None
        self.order = self._order_now or self.order
        for b in self.blocks:  # prefetched past the end, or skipped by this forward
            self.release(b)
        outs = _outputs(output) if torch.is_grad_enabled() else []
        if outs:
            hook = partial(self.pre_backward, self.rest)
            for t in outs:
                t.register_hook(hook)
        else:
            self.release(self.rest)
        return None

    def pre_forward(self, block: Block, module, args, kwargs):
        self.ensure(block)
        if in_backward():  # recomputation inside backward (activation checkpointing)
            return None
        for s in block.slots:
            if s.dev.requires_grad != s.param.requires_grad:
                s.dev.requires_grad_(s.param.requires_grad)
        self._order_now.append(block)
        order = self.order if block in self.order else self.blocks
        self._prefetch(order, order.index(block), 1)
        if torch.is_grad_enabled() and any(not s.dev.requires_grad for s in block.slots):
            return self._watch_inputs(block, args, kwargs)
        return None

    def _watch_inputs(self, block: Block, args, kwargs):
        # NOTE: with frozen parameters, "all parameter gradients are in" does not mean the
        # block's backward is over (frozen weights are still needed for input gradients), so
        # the block is also held until the gradients of its inputs are computed.
        idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        keys = [k for k, a in kwargs.items() if isinstance(a, torch.Tensor) and a.requires_grad]
        if not idx and not keys:
            return None
        block.inputs_pending += 1
        outs = _AfterBackward.apply(partial(self.inputs_done, block),
                                    *[args[i] for i in idx], *[kwargs[k] for k in keys])
        outs = outs if isinstance(outs, tuple) else (outs,)
        args = list(args)
        for j, i in enumerate(idx):
            args[i] = outs[j]
        kwargs = dict(kwargs)
        for j, k in enumerate(keys):
            kwargs[k] = outs[len(idx) + j]
        return tuple(args), kwargs

    def inputs_done(self, block: Block) -> None:
        block.inputs_pending = max(0, block.inputs_pending - 1)
        self._maybe_release(block)

    def _maybe_release(self, block: Block) -> None:
        if id(block) in self._bwd_seen and block.grads_left == 0 and block.inputs_pending == 0:
            self.release(block)

    def post_forward(self, block: Block, module, args, kwargs, output):
        if in_backward():
            # NOTE: keep the block: its backward, which triggered this recomputation, runs next.
            return None
        if torch.is_grad_enabled():
            hook = partial(self.pre_backward, block)
            for t in _outputs(output):
                t.register_hook(hook)
        self.release(block)
        return None

    # ------------------------------------------------------------------ backward hooks
    def pre_backward(self, block: Block, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        # NOTE: keyed by the graph task, so a backward that died half-way (an exception in a
        # hook skips the final callback) does not leave the next one without its cleanup.
        if not self._bwd or task != self._bwd_task:
            self._bwd = True
            self._bwd_task = task
            self._bwd_seen = set()
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
        if id(block) in self._bwd_seen:
            return
        self._bwd_seen.add(id(block))
        block.grads_left = sum(1 for s in block.slots if s.dev.requires_grad)
        self.ensure(block)
        if block is not self.rest and block in self.order:
            self._prefetch(self.order, self.order.index(block), -1)

    def grad_hook(self, dev: torch.Tensor) -> None:
        slot = self.by_dev[id(dev)]
        g = dev.grad
        dev.grad = None
        if g is None:
            return
        b = slot.binding
        p = slot.param
        store = self.store
        if b.grad_handle is None:
            key = f"{b.handle.key}.grad"
            b.grad_handle = store.get(key) if key in store else \
                store.alloc(key, b.handle.shape, b.handle.dtype)
        host = store.host_tensor(b.grad_handle)
        cur = p.grad
        if host is not None:
            if cur is not None and cur.data_ptr() != host.data_ptr():
                host.copy_(cur)  # a gradient assigned by the user: accumulate onto it
            with self.lock:
                self.mover.push_grad(g, b, accumulate=cur is not None)
            if cur is None or cur.data_ptr() != host.data_ptr():
                p.grad = host
        else:
            with self.lock:
                self.mover.push_grad(g, b, accumulate=cur is not None)
            if cur is None:
                # NOTE: a meta marker: `zero_grad()` sets it to None, which tells the next
                # backward to overwrite the stored gradient instead of accumulating.
                p.grad = torch.empty(p.shape, dtype=p.dtype, device="meta")
        # NOTE: post-accumulate-grad fires once per backward, after every use of the
        # parameter (tied weights included), so this gradient is complete: tell listeners
        # (HostOptimizer(overlap=True) starts the parameter's step on its worker thread).
        grad_ready(p)
        block = slot.block
        if id(block) in self._bwd_seen:
            block.grads_left -= 1
            if block.grads_left == 0 and any(s.dev.requires_grad for s in block.slots):
                self._maybe_release(block)

    def end_backward(self) -> None:
        self._bwd = False
        self._bwd_seen = set()
        for b in self.blocks:
            b.inputs_pending = 0
            self.release(b)
        self.release(self.rest)
        self.sync_grads()
        if self._bypass:
            names, self._bypass = self._bypass, []
            raise RuntimeError(
                f"parameter(s) {sorted(set(names))} were used outside the forward of their"
                " offloaded block, so their gradient bypassed the store and is wrong; make the"
                " block that uses them contain them (hr.offload(..., blocks=[...])) or call"
                " the block module itself rather than reading its parameters from outside"
            )

    def sync_grads(self) -> None:
        """Wait until every gradient pushed so far rests in the store (any thread)."""
        with self.lock:
            self.mover.synchronize()

    def bypass_hook(self, name: str, p: torch.Tensor) -> None:
        self._bypass.append(name)

    # ------------------------------------------------------------------ state dict
    def state_dict_hook(self, module, state_dict, prefix, local_metadata) -> None:
        for attr, t in module._parameters.items():
            slot = self.by_dev.get(id(t)) or self.by_param.get(id(t))
            if slot is None or prefix + attr not in state_dict:
                continue
            host = self.store.host_tensor(slot.binding.handle)
            state_dict[prefix + attr] = (
                host if host is not None else self.store.read(slot.binding.handle).result()
            )

    def load_state_dict_pre_hook(self, module, state_dict, prefix, *args) -> None:
        for attr, t in module._parameters.items():
            slot = self.by_dev.get(id(t)) or self.by_param.get(id(t))
            key = prefix + attr
            if slot is None or key not in state_dict:
                continue
            value = state_dict[key]
            h = slot.binding.handle
            if tuple(value.shape) != h.shape:
                continue  # the default loader reports the mismatch
            self.store.write(h, value.detach().to("cpu", h.dtype).contiguous()).result()
            # NOTE: the default loader then copies into whatever the module holds; give it a
            # placeholder of the same kind so that copy is a no-op.
            cur = module._parameters[attr]
            if cur.device.type == "meta":
                state_dict[key] = torch.empty(h.shape, dtype=h.dtype, device="meta")
            else:
                state_dict[key] = cur.detach()
