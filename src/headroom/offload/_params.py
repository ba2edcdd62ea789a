"""Parameter offload: parameters and gradients rest in a store and visit the device per block.

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

import warnings
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten

from headroom.memory import resize_storage
from headroom.offload._blocks import check_blocks, find_blocks
from headroom.transfer import (
    DiskStore,
    Mover,
    ParamBinding,
    Store,
    Ticket,
    bind,
    binding,
    resolve_store,
    unbind,
)

__all__ = ["describe", "offload", "unoffload"]

_ATTR = "_headroom_offload"


def _in_backward() -> bool:
    """True inside an autograd backward pass (e.g. during a checkpoint's recomputation)."""
    return torch._C._current_graph_task_id() != -1


def _check_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device: {e}") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "meta":
        raise ValueError("device='meta' cannot compute; use 'cpu' or an accelerator")
    acc = torch.accelerator
    if not acc.is_available() or acc.current_accelerator().type != dev.type:
        raise RuntimeError(
            f"device {str(dev)!r} is not available on this machine (no {dev.type} accelerator"
            " found); use device='cpu' — with store=hr.DiskStore(path) to train models bigger"
            " than RAM — or run where the accelerator exists"
        )
    index = dev.index if dev.index is not None else acc.current_device_index()
    if index >= acc.device_count():
        raise RuntimeError(
            f"device {str(dev)!r} is not available: only {acc.device_count()} {dev.type}"
            " device(s); pick an index below that"
        )
    return torch.device(dev.type, index)


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


class _DeviceCopy(nn.Parameter):
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


class _Slot:
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
        self.block: _Block | None = None
        self.nbytes = dev.numel() * dev.element_size()

    def show(self, t: nn.Parameter) -> None:
        # NOTE: write the module's parameter dict directly: `setattr` would re-register and
        # refuse swapping a parameter while its module runs.
        for module, attr in self.owners:
            module._parameters[attr] = t


class _Block:
    def __init__(self, name: str, module: nn.Module | None) -> None:
        self.name = name
        self.module = module
        self.slots: list[_Slot] = []
        self.resident = False
        self.grads_left = 0
        self.inputs_pending = 0  # forward calls whose input gradients are not computed yet

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


class _Offload:
    """Per-model state: blocks, the mover and every hook (removed again by `unoffload`)."""

    def __init__(self, model: nn.Module, device: torch.device, store: Store, prefetch: int,
                 compute_dtype: torch.dtype | None, auto: bool) -> None:
        self.model = model
        self.device = device
        self.store = store
        self.mover = Mover(device, store)
        self.prefetch = prefetch
        self.compute_dtype = compute_dtype
        self.auto = auto
        self.blocks: list[_Block] = []
        self.rest = _Block("(outside blocks)", None)
        self.slots: list[_Slot] = []
        self.by_dev: dict[int, _Slot] = {}
        self.by_param: dict[int, _Slot] = {}
        self.handles: list[Any] = []
        self.order: list[_Block] = []  # forward order of the last forward
        self._order_now: list[_Block] = []
        self._bwd = False
        self._bwd_task = -1
        self._bwd_seen: set[int] = set()
        self._bypass: list[str] = []
        self.buffers: list[str] = []

    # ------------------------------------------------------------------ residency
    def fetch(self, block: _Block) -> None:
        """Start bringing a block to the device (no wait)."""
        if block.resident:
            return
        for s in block.slots:
            resize_storage(s.dev, s.nbytes)
            s.ticket = self.mover.fetch(s.binding.handle, s.dev)
            s.show(s.dev)
        block.resident = True

    def ensure(self, block: _Block) -> None:
        """Make a block resident and ready for compute."""
        self.fetch(block)
        for s in block.slots:
            if s.ticket is not None:
                self.mover.wait(s.ticket)
                s.ticket = None

    def release(self, block: _Block) -> None:
        if not block.resident:
            return
        for s in block.slots:
            if s.ticket is not None:  # a prefetch that was never used
                self.mover.wait(s.ticket)
                s.ticket = None
            resize_storage(s.dev, 0)
            s.show(s.param)
        block.resident = False

    def _prefetch(self, order: list[_Block], start: int, step: int) -> None:
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
        if _in_backward():
            self.ensure(self.rest)
            return None
        self._order_now = []
        self.ensure(self.rest)
        order = self.order or self.blocks
        self._prefetch(order, -1, 1)
        return None

    def root_post_forward(self, module, args, kwargs, output):
        if _in_backward():
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

    def pre_forward(self, block: _Block, module, args, kwargs):
        self.ensure(block)
        if _in_backward():  # recomputation inside backward (activation checkpointing)
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

    def _watch_inputs(self, block: _Block, args, kwargs):
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

    def inputs_done(self, block: _Block) -> None:
        block.inputs_pending = max(0, block.inputs_pending - 1)
        self._maybe_release(block)

    def _maybe_release(self, block: _Block) -> None:
        if id(block) in self._bwd_seen and block.grads_left == 0 and block.inputs_pending == 0:
            self.release(block)

    def post_forward(self, block: _Block, module, args, kwargs, output):
        if _in_backward():
            # NOTE: keep the block: its backward, which triggered this recomputation, runs next.
            return None
        if torch.is_grad_enabled():
            hook = partial(self.pre_backward, block)
            for t in _outputs(output):
                t.register_hook(hook)
        self.release(block)
        return None

    # ------------------------------------------------------------------ backward hooks
    def pre_backward(self, block: _Block, grad: torch.Tensor) -> None:
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
            b.grad_handle = store.alloc(f"{b.handle.key}.grad", b.handle.shape, b.handle.dtype)
        host = store.host_tensor(b.grad_handle)
        cur = p.grad
        if host is not None:
            if cur is not None and cur.data_ptr() != host.data_ptr():
                host.copy_(cur)  # a gradient assigned by the user: accumulate onto it
            self.mover.push_grad(g, b, accumulate=cur is not None)
            if cur is None or cur.data_ptr() != host.data_ptr():
                p.grad = host
        else:
            self.mover.push_grad(g, b, accumulate=cur is not None)
            if cur is None:
                # NOTE: a meta marker: `zero_grad()` sets it to None, which tells the next
                # backward to overwrite the stored gradient instead of accumulating.
                p.grad = torch.empty(p.shape, dtype=p.dtype, device="meta")
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
        self.mover.synchronize()
        if self._bypass:
            names, self._bypass = self._bypass, []
            raise RuntimeError(
                f"parameter(s) {sorted(set(names))} were used outside the forward of their"
                " offloaded block, so their gradient bypassed the store and is wrong; make the"
                " block that uses them contain them (hr.offload(..., blocks=[...])) or call"
                " the block module itself rather than reading its parameters from outside"
            )

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



# ---------------------------------------------------------------------------------- public API
def offload(
    model: nn.Module,
    *,
    device: str | torch.device,
    store: str | Store = "cpu",
    blocks: Iterable[nn.Module] | None = None,
    prefetch: int = 1,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Keep ``model``'s parameters and gradients in a store; stream each block to ``device``.

    Changes the model in place and returns it. Afterwards ``model.parameters()`` yields the
    *masters*: with ``store="cpu"`` they are host tensors whose ``.grad`` is filled by backward,
    so ``torch.optim.AdamW(model.parameters())`` works unchanged and steps on the host (as in
    ZeRO-offload); with a `DiskStore` they are ``meta`` placeholders and an optimizer must go
    through the store (``hr.HostOptimizer``). Inputs must be on ``device``; buffers are moved
    there and stay.

    Args:
        model: the model; its parameters may be anywhere, including the ``meta`` device:
            such modules are initialized one at a time (``reset_parameters()``) right before
            their parameters go to the store, so a model bigger than RAM never exists whole.
        device: where computation runs (``"cuda"``, any ``torch.accelerator``, or ``"cpu"``).
        store: ``"cpu"`` (host memory; pinned from a pool with a byte budget when ``device``
            is an accelerator) or a store such as ``hr.DiskStore(path)`` for models bigger than
            host memory (slower: disk bandwidth bounds each step).
        blocks: the submodules fetched and released together; by default the largest group of
            similar siblings (a transformer's layers, a CNN's stages), plus any module outside
            them holding at least half a block of parameters (an untied embedding or head).
            The remaining parameters, and any shared by several blocks, form one more group that
            is resident from the start of forward to the end of backward. Smaller blocks use
            less device memory but give transfers less compute to hide behind.
        prefetch: how many blocks ahead to start fetching (forward order, and reverse order in
            backward). Each costs one block of device memory; 0 disables overlap.
        compute_dtype: dtype of the device copies of floating-point parameters (e.g.
            ``torch.bfloat16``); masters and gradients in the store stay in their own dtype
            (fp32), gradients accumulate there. Opt-in and not bitwise equal to fp32 training.

    Returns:
        ``model``.

    Raises:
        RuntimeError: ``device`` is not available, or the model (or a part of it) is already
            offloaded.
        ValueError: bad ``blocks``, ``prefetch`` or ``compute_dtype``.
        StoreFullError / PermissionError: the store cannot hold the parameters.

    Example:
        >>> model = hr.offload(model, device="cuda", store="cpu", prefetch=1)   # doctest: +SKIP
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-4)                 # doctest: +SKIP
        >>> model(x.cuda()).sum().backward(); opt.step(); opt.zero_grad()        # doctest: +SKIP
    """
    dev = _check_device(device)
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    if compute_dtype is not None and (
        not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point
    ):
        raise ValueError(
            f"compute_dtype must be a floating-point torch.dtype (e.g. torch.bfloat16), got"
            f" {compute_dtype!r}"
        )
    for name, m in model.named_modules():
        if hasattr(m, _ATTR):
            where = "the model" if m is model else f"its submodule {name!r}"
            raise RuntimeError(
                f"{where} is already offloaded; call hr.unoffload() on it first"
            )
    for name, p in model.named_parameters():
        if binding(p) is not None:
            raise RuntimeError(
                f"parameter {name!r} already rests in a store (offloaded elsewhere or bound by"
                " another headroom feature); unoffload it first"
            )
    auto = blocks is None
    block_mods = find_blocks(model) if auto else check_blocks(model, list(blocks))
    if auto and block_mods:
        block_mods = _with_outside_blocks(model, block_mods)
    st = resolve_store(store, dev)
    if dev.type == "cpu" and not isinstance(st, DiskStore):
        warnings.warn(
            "hr.offload with device='cpu' and a host-memory store saves no memory (it keeps a"
            " master and a device copy in the same RAM); it is meant for testing the mechanics."
            " Use store=hr.DiskStore(path) to train beyond RAM on a CPU.",
            UserWarning,
            stacklevel=2,
        )
    state = _Offload(model, dev, st, prefetch, compute_dtype, auto)
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    state.blocks = [_Block(names[id(m)], m) for m in block_mods]

    # Which block owns each parameter (tied parameters used by several blocks go outside).
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    first_name: dict[int, str] = {}
    params: dict[int, nn.Parameter] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is None:
                continue
            pid = id(p)
            params[pid] = p
            owners.setdefault(pid, [])
            if (m, attr) not in [(o, a) for o, a in owners[pid]]:
                owners[pid].append((m, attr))
            first_name.setdefault(pid, f"{mname}.{attr}" if mname else attr)
    blocks_of_module: dict[int, list[_Block]] = {}
    for b in state.blocks:
        for m in b.module.modules():
            blocks_of_module.setdefault(id(m), []).append(b)
    replaced: dict[int, nn.Parameter] = {}
    unprocessed = set(params)
    for pid, p in params.items():
        p = replaced.pop(pid, p)
        if p.device.type == "meta":
            _materialize(owners[pid][0][0], first_name[pid], owners, params, unprocessed,
                         replaced)
            # NOTE: pop, not get: holding on would keep every initialized tensor in RAM.
            p = replaced.pop(pid)
        unprocessed.discard(pid)
        if not p.is_leaf:
            raise ValueError(f"parameter {first_name[pid]!r} is not a leaf tensor")
        # NOTE: a parameter belongs to a block only if every module registering it is inside
        # that block; tied parameters shared across blocks are kept outside, fetched once.
        homes = {id(b) for m, _ in owners[pid] for b in blocks_of_module.get(id(m), [None])}
        home = blocks_of_module.get(id(owners[pid][0][0]), [None])[0]
        target = home if home is not None and len(homes) == 1 else state.rest
        cdtype = compute_dtype if (compute_dtype is not None and p.is_floating_point()) \
            else p.dtype
        handle = st.put(first_name[pid], p.detach())
        dev_param = _DeviceCopy(torch.empty(p.shape, dtype=cdtype, device=dev),
                                requires_grad=p.requires_grad)
        resize_storage(dev_param, 0)
        host = st.host_tensor(handle)
        if host is not None:
            master = p
            with torch.no_grad():
                master.data = host
            if master.grad is not None:
                master.grad = None
        else:
            master = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                  requires_grad=p.requires_grad)
        b = bind(master, handle)
        slot = _Slot(first_name[pid], owners[pid], master, dev_param, b)
        slot.block = target
        slot.show(master)
        target.slots.append(slot)
        state.slots.append(slot)
        state.by_dev[id(dev_param)] = slot
        state.by_param[id(master)] = slot
        if p.is_floating_point() or p.is_complex():
            # NOTE: hooks need requires_grad at registration and survive toggling it, so a
            # parameter frozen now still routes its gradient if it is unfrozen later.
            for t, fn in ((dev_param, state.grad_hook),
                          (master, partial(state.bypass_hook, slot.name))):
                rg = t.requires_grad
                t.requires_grad_(True)
                state.handles.append(t.register_post_accumulate_grad_hook(fn))
                t.requires_grad_(rg)
    for mname, m in model.named_modules():
        for bname, buf in list(m._buffers.items()):
            if buf is not None:
                if buf.device != dev:
                    m._buffers[bname] = buf.to(dev)
                state.buffers.append(f"{mname}.{bname}" if mname else bname)

    # Found blocks whose parameters all went outside (e.g. a tied embedding) are dropped.
    state.blocks = [b for b in state.blocks if b.slots or not auto]

    # Hooks: root, blocks, state dict.
    h = state.handles
    h.append(model.register_forward_pre_hook(state.root_pre_forward, with_kwargs=True,
                                             prepend=True))
    h.append(model.register_forward_hook(state.root_post_forward, with_kwargs=True))
    for b in state.blocks:
        h.append(b.module.register_forward_pre_hook(partial(state.pre_forward, b),
                                                    with_kwargs=True, prepend=True))
        h.append(b.module.register_forward_hook(partial(state.post_forward, b),
                                                with_kwargs=True))
    seen_mods: set[int] = set()
    for s in state.slots:
        for m, _ in s.owners:
            if id(m) in seen_mods:
                continue
            seen_mods.add(id(m))
            h.append(m.register_state_dict_post_hook(partial(_Offload.state_dict_hook, state)))
            h.append(m.register_load_state_dict_pre_hook(
                partial(_Offload.load_state_dict_pre_hook, state)))
    if isinstance(st, DiskStore):
        _install_optimizer_guard()
    object.__setattr__(model, _ATTR, state)
    if not state.blocks:
        warnings.warn(
            "hr.offload found no repeated blocks in the model, so all parameters form one group"
            " that is resident for the whole step (no memory saved on the device); pass"
            " blocks=[...] with the submodules to fetch one at a time",
            UserWarning,
            stacklevel=2,
        )
    return model


_guard_handle = None


def _param_bytes(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def _with_outside_blocks(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Add, as blocks of their own, large modules outside the found blocks (an untied embedding
    or output head): at least half the largest block. Smaller ones stay with the parameters that
    are resident for the whole step. Returned in module order (the usual execution order)."""
    names = {id(m): n for n, m in model.named_modules()}
    block_names = [names[id(b)] for b in blocks]
    threshold = max(_param_bytes(b) for b in blocks) // 2

    def holds_block(name: str) -> bool:
        return name == "" or any(bn.startswith(name + ".") for bn in block_names)

    extra: list[nn.Module] = []
    ids = {id(b) for b in blocks}
    stack = [model]
    while stack:
        m = stack.pop()
        for child in m.children():
            if id(child) in ids:
                continue
            if holds_block(names.get(id(child), "")):
                stack.append(child)
            elif _param_bytes(child) >= threshold > 0:
                # NOTE: a large outside module with repeated structure of its own (the encoder
                # next to a decoder's layers) is split into its own blocks rather than fetched
                # whole.
                sub = find_blocks(child)
                extra.extend(_with_outside_blocks(child, sub) if sub else [child])
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted([*blocks, *extra], key=lambda m: order[id(m)])


def _materialize(module: nn.Module, name: str, owners, params, unprocessed: set[int],
                 replaced: dict[int, nn.Parameter]) -> None:
    """Deferred initialization of one module whose parameters are on the meta device.

    NOTE: done module by module, right before its parameters go to the store, so a model
    created on the meta device never exists whole in host memory.
    """
    reset = getattr(module, "reset_parameters", None)
    own = [(a, t) for a, t in module._parameters.items() if t is not None]
    if reset is None or any(id(t) not in unprocessed for _, t in own):
        raise ValueError(
            f"parameter {name!r} is on the meta device and its {type(module).__name__} cannot be"
            " initialized here (it has no reset_parameters(), or shares parameters with a module"
            " initialized earlier); materialize it first, e.g. model.to_empty(device='cpu')"
            " followed by your initialization"
        )
    for _attr, t in own:
        new = nn.Parameter(torch.empty_like(t, device="cpu"), requires_grad=t.requires_grad)
        for m, a in owners[id(t)]:
            m._parameters[a] = new
        replaced[id(t)] = new
    for attr, b in list(module._buffers.items()):
        if b is not None and b.device.type == "meta":
            module._buffers[attr] = torch.empty_like(b, device="cpu")
    with torch.no_grad():
        reset()


def _install_optimizer_guard() -> None:
    """Make ``torch.optim`` optimizers fail clearly on parameters that live on disk."""
    global _guard_handle
    if _guard_handle is not None:
        return

    def guard(opt, args, kwargs):
        if type(opt).__module__.startswith("headroom."):
            return  # headroom's own optimizers read parameters through their bindings
        for group in opt.param_groups:
            for p in group["params"]:
                if p.device.type == "meta" and binding(p) is not None:
                    raise RuntimeError(
                        f"{type(opt).__name__} cannot step parameters offloaded to a DiskStore:"
                        " their values are on disk, not in memory. Use"
                        f" hr.HostOptimizer(model.parameters(), torch.optim.{type(opt).__name__},"
                        " ...) which streams them through the store, or offload with"
                        " store='cpu'"
                    )

    _guard_handle = register_optimizer_step_pre_hook(guard)


def _state(model: nn.Module) -> _Offload:
    state = getattr(model, _ATTR, None)
    if state is None:
        raise RuntimeError("the model is not offloaded (call hr.offload(model, device=...) first)")
    return state


def unoffload(model: nn.Module) -> nn.Module:
    """Undo `offload`: parameters (and gradients) come back onto the device as plain tensors.

    Masters that lived on disk are replaced by new ``nn.Parameter`` objects (re-create the
    optimizer); with ``store="cpu"`` the same parameter objects are kept. The store's tensors
    are freed.

    Raises:
        RuntimeError: the model is not offloaded, or a backward pass is in progress.

    Example:
        >>> model = hr.unoffload(model)   # doctest: +SKIP
    """
    state = _state(model)
    if state._bwd:
        raise RuntimeError("cannot unoffload during a backward pass")
    state.mover.synchronize()
    for b in [*state.blocks, state.rest]:
        state.release(b)
    for h in state.handles:
        h.remove()
    st = state.store
    for s in state.slots:
        b = s.binding
        value = st.read(b.handle).result().to(state.device)
        grad = None
        if b.grad_handle is not None:
            if s.param.grad is not None:
                grad = st.read(b.grad_handle).result().to(state.device)
            st.free(b.grad_handle)
        st.free(b.handle)
        unbind(s.param)
        if s.param.device.type == "meta":
            p = nn.Parameter(value, requires_grad=s.param.requires_grad)
        else:
            p = s.param
            p.grad = None
            with torch.no_grad():
                p.data = value
        p.grad = grad
        s.show(p)
    object.__delattr__(model, _ATTR)
    return model


def describe(model: nn.Module) -> str:
    """A table of an offloaded model: its blocks, what stays resident and why, the budget.

    Raises:
        RuntimeError: the model is not offloaded.

    Example:
        >>> print(hr.describe(hr.offload(model, device="cuda")))   # doctest: +SKIP
    """
    s = _state(model)

    def mb(n: int) -> str:
        return f"{n / 2**20:.2f} MiB"

    lines = [
        f"headroom offload: device={s.device}, store={s.store!r}, prefetch={s.prefetch},"
        f" compute_dtype={s.compute_dtype}",
        f"blocks ({len(s.blocks)}, {'found automatically' if s.auto else 'given'}):"
        " fetched before their forward and backward, released right after",
    ]
    for b in s.blocks:
        lines.append(f"  {b.name:<40} {type(b.module).__name__:<24} {len(b.slots):>4} params"
                     f"  {mb(b.nbytes):>12}")
    rest = s.rest
    lines.append(
        f"outside blocks: {len(rest.slots)} params, {mb(rest.nbytes)} on the device from the"
        " start of forward to the end of backward (not inside any block, or shared by several)"
    )
    for sl in rest.slots:
        tied = [f"{type(m).__name__}.{a}" for m, a in sl.owners]
        extra = f" (tied: {', '.join(tied)})" if len(sl.owners) > 1 else ""
        lines.append(f"  {sl.name:<40} {tuple(sl.dev.shape)!s:<24} {mb(sl.nbytes):>12}{extra}")
    lines.append(f"buffers resident on the device: {len(s.buffers)}")
    largest = max((b.nbytes for b in s.blocks), default=0)
    lines.append(
        f"device parameter bytes at most: (prefetch+1) x largest block + outside ="
        f" {s.prefetch + 1} x {mb(largest)} + {mb(rest.nbytes)}"
        f" = {mb((s.prefetch + 1) * largest + rest.nbytes)}"
    )
    return "\n".join(lines)
