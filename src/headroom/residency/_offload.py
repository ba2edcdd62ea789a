"""Parameter offload's public entry points: `offload`, `unoffload`, `describe`, `prefetch`."""

from __future__ import annotations

import gc
import sys
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import replace
from functools import partial

import torch
import torch.nn as nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from headroom import _providers
from headroom.residency import _adopt, _dtensor, _guard, _outside
from headroom.residency._autograd import mark, unmark
from headroom.residency._group import DeviceCopy, Group, Slot
from headroom.residency._outside import keep_on_device
from headroom.residency._packed import (
    Packed,
    as_stored,
    check_packable,
    is_packed,
    packable,
    part_key,
    read_parts,
    rest_master,
)
from headroom.residency._plan import Layout, OffloadPlan, adapter_modules, check_options, layout
from headroom.residency._schedule import _LIVE, Offload, Phase, _GroupRole, in_backward
from headroom.store import MetaStore, Store, claimed_keys, resolve_store, trim_heap
from headroom.transfer import (
    HandleSource,
    StoreTensor,
    bind,
    binding,
    check_device,
    resize_storage,
    stored_view,
    unbind,
    weak_post_accumulate_grad_hook,
)

__all__ = ["describe", "keep_on_device", "offload", "prefetch", "unoffload"]

_ATTR = _guard._OFFLOAD


def _replica_wrapper(m: nn.Module) -> str | None:
    """The name of the data-parallel wrapper ``m`` is, or ``None``."""
    if getattr(type(m), "_headroom_data_parallel", False):
        return "hr.data_parallel"
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(m, DistributedDataParallel):
        return "DistributedDataParallel"
    if isinstance(m, DataParallel):
        return "torch.nn.DataParallel"
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    if fsdp is not None and isinstance(m, fsdp.FullyShardedDataParallel):
        return "FullyShardedDataParallel (FSDP1)"
    return None


def _check_not_replicated(model: nn.Module) -> None:
    """Refuse a model a data-parallel wrapper already holds (or holds a part of)."""
    for name, m in model.named_modules():
        kind = _replica_wrapper(m)
        if kind is None:
            continue
        where = "the model" if m is model else f"its submodule {name!r}"
        if kind == "hr.data_parallel":
            raise RuntimeError(
                f"hr.offload got {where}, which hr.data_parallel already wraps: offload first,"
                " then wrap (hr.offload(model, ...); model = hr.data_parallel(model))")
        fix = ("use FSDP2 instead (fully_shard each block and the root, then hr.offload:"
               " docs/data_parallel.md)" if "FSDP1" in kind else
               "unwrap it (model = wrapped.module), hr.offload(model, ...), then"
               " model = hr.data_parallel(model). With accelerate: call both before"
               " accelerator.prepare, and pass prepare the optimizer and data loaders only")
        raise RuntimeError(
            f"hr.offload got {where}, wrapped by {kind} (e.g. by accelerate's prepare): the"
            " wrapper hooked the parameters before headroom moved them, so no offloaded"
            f" gradient would reach it and the replicas would silently diverge. {fix}")


# ---------------------------------------------------------------------------------- public API
def offload(
    model: nn.Module,
    *,
    device: str | torch.device,
    store: str | Store = "cpu",
    blocks: Iterable[nn.Module] | None = None,
    prefetch: int = 1,
    compute_dtype: torch.dtype | None = None,
    grad_accumulation: str = "store",
    adapters: str = "device",
) -> nn.Module:
    """Keep ``model``'s parameters and gradients in a store; stream each block to ``device``.

    Changes the model in place and returns it. ``model.parameters()`` then yields the
    *masters*: with ``store="cpu"`` host tensors whose ``.grad`` backward fills, which any
    ``torch.optim`` optimizer steps on the host (as in ZeRO-offload); with a `DiskStore`
    `headroom.transfer.StoreTensor` objects whose ops (and their ``.grad``'s) run on the values
    on disk, stepped by ``hr.HostOptimizer``. Inputs must be on ``device``; buffers move there.

    A model whose blocks and root were ``fully_shard``ed (FSDP2) keeps each rank's local shards
    in the store instead (``blocks``: ``fully_shard``ed modules); see docs/data_parallel.md.

    Dropped, the model, its store and the store's threads, files and lock go at the next garbage
    collection. Pickled or ``copy.deepcopy``-ed, it gives a plain model with the current values.

    Args:
        model: the model; quantized parameters (bitsandbytes', torchao's) rest in the store
            packed and do not train. Parameters on the ``meta`` device get their values from
            ``hr.load_weights`` or, if still unfilled when first needed, from their module's
            own initialization, one module at a time (the model never exists whole).
        device: where computation runs (``"cuda"``, any ``torch.accelerator``, or ``"cpu"``).
        store: ``"cpu"`` (host memory; pinned from a pool with a byte budget when ``device``
            is an accelerator) or a store such as ``hr.DiskStore(path)`` for models bigger than
            host memory (slower: disk bandwidth bounds each step).
        blocks: the submodules fetched and released together; by default the largest group of
            similar siblings (a transformer's layers), plus any module outside them holding at
            least half a block of parameters (an untied embedding or head). The rest, and
            parameters shared by several blocks, form one group resident from forward to the end
            of backward. Smaller blocks use less device memory but hide transfers less.
        prefetch: how many blocks ahead to start fetching (forward order, and reverse order in
            backward). Each costs one block of device memory; 0 disables overlap.
        compute_dtype: dtype of the device copies of floating-point parameters (e.g.
            ``torch.bfloat16``); masters and gradients in the store keep their own dtype. Not
            bitwise equal to fp32 training.
        grad_accumulation: where the gradients of several backward passes before a step are
            summed. ``"store"``: in the store (on disk: read, added, written back).
            ``"device"``: a gradient read through the store (on a `DiskStore`, or the fp32
            gradients `hr.HostOptimizer` keeps for bf16/fp16 parameters) is summed on
            ``device`` in the stored dtype (bitwise the same sum) and handed to the store once,
            when read (the step, ``param.grad``, ``clip_grad_norm_``, `hr.data_parallel`'s
            all-reduce) or as the last backward of ``HostOptimizer.final_backward`` completes
            it. Costs one gradient per parameter on ``device`` until the step; saves the store
            traffic of every backward but one.
        adapters: where the parameters of PEFT's tuner layers (LoRA's ``lora_A``/``lora_B``;
            beside a ``base_layer``) live, wrapped before ``hr.offload`` or after.
            ``"device"``: ordinary parameters on ``device`` (hundreds of tiny tensors a store
            would cost work each per step). ``"store"``: offloaded with their blocks. Adapters
            created on ``meta`` rest in the store either way until loaded or initialized
            (`hr.init_adapters`).

    Returns:
        ``model``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        RuntimeError: ``device`` is not available, or the model (or a part of it) is already
            offloaded; DTensor parameters that FSDP2 does not manage.
        NotImplementedError: ``grad_accumulation="device"`` for a ``fully_shard``ed model.
        ValueError: bad ``blocks``, ``prefetch``, ``compute_dtype`` or
            ``grad_accumulation``; a quantized parameter that cannot rest packed.
        StoreFullError / PermissionError: the store cannot hold the parameters.

    Example:
        >>> model = hr.offload(model, device="cuda", store="cpu", prefetch=1)   # doctest: +SKIP
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-4)                 # doctest: +SKIP
        >>> model(x.cuda()).sum().backward(); opt.step(); opt.zero_grad()        # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"hr.offload takes a torch.nn.Module, got {type(model).__name__}")
    _providers.load_integrations()  # what the libraries around the model need (subscribed)
    _check_not_replicated(model)
    dev = check_device(device)
    check_options(prefetch, compute_dtype)
    if grad_accumulation not in ("store", "device"):
        raise ValueError(
            f"grad_accumulation must be 'store' or 'device', got {grad_accumulation!r}")
    if adapters not in ("store", "device"):
        raise ValueError(f"adapters must be 'device' or 'store', got {adapters!r}")
    if _dtensor.check_sharded(model, "hr.offload"):
        if grad_accumulation != "store":
            raise NotImplementedError(
                "grad_accumulation='device' is not supported for a fully_shard()ed model: FSDP2"
                " reduce-scatters every backward's gradients into the shards: leave the"
                " default. To sum micro-batches on the device, call"
                " model.set_requires_gradient_sync(False) for all but the last backward")
        _dtensor.offload_sharded(model, device=dev, store=store, blocks=blocks,
                                 compute_dtype=compute_dtype, prefetch=prefetch)
        _need(_dtensor.sharded_state_of(model))  # torch.optim refused on shards on disk
        return model
    return _offload(model, dev, store, blocks, prefetch, compute_dtype, grad_accumulation,
                    adapters)


def offload_dry_run(model: nn.Module, store: MetaStore, *, blocks: Iterable[nn.Module] | None,
                    prefetch: int, compute_dtype: torch.dtype | None, grad_accumulation: str,
                    adapters: str, kept: Iterable[str] | None) -> Offload:
    """`offload` of a dry run's ``meta`` copy of a model (`headroom.fit`) onto ``meta``;
    ``kept``: the names of the parameters kept on the device, or ``None``: as ``adapters``."""
    with warnings.catch_warnings():  # what it says of the model, the estimate says too
        warnings.simplefilter("ignore")
        _offload(model, torch.device("meta"), store, blocks, prefetch, compute_dtype,
                 grad_accumulation, adapters, kept=_kept_ids(model, kept, adapters))
    return model.__dict__[_ATTR]


def _kept_ids(module: nn.Module, kept: Iterable[str] | None, adapters: str) -> str | set[int]:
    """What `layout` keeps on the device in a dry run's copy: named here, as `layout` takes a
    ``meta`` adapter for one without values (resting in the store)."""
    if kept is not None:
        named = dict(module.named_parameters(remove_duplicate=False))
        return {id(named[n]) for n in kept if n in named}
    if adapters != "device":
        return "store"
    mods = adapter_modules(module)
    owned: dict[int, list[nn.Module]] = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                owned.setdefault(id(p), []).append(m)
    return {pid for pid, ms in owned.items() if all(id(m) in mods for m in ms)}


def _offload(model: nn.Module, dev: torch.device, store: str | Store | MetaStore,
             blocks: Iterable[nn.Module] | None, prefetch: int,
             compute_dtype: torch.dtype | None, grad_accumulation: str, adapters: str, *,
             kept: str | set[int] | None = None) -> nn.Module:
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
    lay = layout(model, device=dev, blocks=blocks, prefetch=prefetch,
                 compute_dtype=compute_dtype, adapters=adapters if kept is None else kept)
    st = store if isinstance(store, MetaStore) else resolve_store(store, dev)
    if dev.type == "cpu" and st.holds_host_memory:
        warnings.warn(
            "hr.offload with device='cpu' and a host-memory store saves no memory (it keeps a"
            " master and a device copy in the same RAM); it is meant for testing the mechanics."
            " Use store=hr.DiskStore(path) to train beyond RAM on a CPU.",
            UserWarning,
            stacklevel=3,
        )
    state = Offload(model, dev, st, prefetch, compute_dtype, grad_accumulation)
    state.adapters = adapters
    state.plan = replace(lay.plan, store=repr(st))
    state.blocks = [Group(g.name, m) for g, m in zip(lay.plan.blocks, lay.block_modules,
                                                     strict=True)]
    first_name = lay.names
    claimed = claimed_keys(st)
    if any(first_name[pid] in claimed for pid in lay.params):
        gc.collect()  # an unreachable model in a reference cycle holds its keys until then
    for pid, p in lay.params.items():  # validate before changing anything
        name = first_name[pid]
        if is_packed(p):
            check_packable(st, claimed, p, name, lay.owners[pid])
            continue
        if name in st:
            if name in claimed:
                raise RuntimeError(
                    f"{name!r} in {st!r} is in use by another offloaded model or classifier"
                    " head; give each model its own store (or DiskStore directory)"
                )
            _check_stored(st.get(name), p, name)
    # a model dropped without hr.unoffload leaves its keys (the finalizer holds the sets)
    weakref.finalize(state, claimed.difference_update, state.claims)
    placed: list[tuple[Slot, nn.Parameter, bool]] = []
    _need(state)
    try:
        _place(state, st, dev, compute_dtype, lay, claimed, placed)
    except BaseException:
        _rollback(state, st, claimed, placed)
        raise
    for pid, p in (lay.kept or {}).items():
        keep_on_device(state, p, lay.owners[pid])
    for mname, m in model.named_modules():
        for bname, buf in list(m._buffers.items()):
            if buf is not None:
                if buf.device.type == "meta":
                    state.pending_modules[id(m)] = m  # filled like the parameters
                elif buf.device != dev:
                    m._buffers[bname] = buf.to(dev)
                state.buffers.append(f"{mname}.{bname}" if mname else bname)

    # NOTE: the hooks swap parameters: not traced by torch.compile, each a graph break, so each
    # block's forward is a graph whose backward runs between headroom's hooks as in eager mode
    # (disabled here: where they are defined would import torch._dynamo with residency)
    eager = torch.compiler.disable
    h = state.handles
    h.append(model.register_forward_pre_hook(eager(state.root_pre_forward), with_kwargs=True,
                                             prepend=True))
    h.append(model.register_forward_hook(eager(state.root_post_forward), with_kwargs=True))
    h.append(model.register_state_dict_pre_hook(
        lambda *a, **k: state.init_pending(lost_ok=True)))
    for b in state.blocks:
        h.append(b.module.register_forward_pre_hook(eager(partial(state.pre_forward, b)),
                                                    with_kwargs=True, prepend=True))
        h.append(b.module.register_forward_hook(eager(partial(state.post_forward, b)),
                                                with_kwargs=True))
    for m in {id(m): m for s in [*state.slots, *state.packed] for m, _ in s.owners}.values():
        _adopt.hook_state_dict(state, m)
    if dev.type == "cpu":
        trim_heap()  # the device copies were allocated once above, and freed
    object.__setattr__(model, _ATTR, state)
    # last: a failed offload leaves the classes alone
    _guard.install(model, state)
    for b in state.blocks:
        _guard.install(b.module, _GroupRole(state, b))
    _adopt.install(state)  # parameters added later (adapters) are offloaded too
    if not state.blocks:
        warnings.warn(
            "hr.offload found no repeated blocks in the model, so all parameters form one group"
            " that is resident for the whole step (no memory saved on the device); pass"
            " blocks=[...] with the submodules to fetch one at a time",
            UserWarning,
            stacklevel=3,
        )
    return model


# id -> a parameter object hr.offload replaced (weakly): an optimizer built before holds it
_REPLACED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _place(state: Offload, st: Store, dev: torch.device, compute_dtype, lay: Layout,
           claimed: set[str], placed: list) -> None:
    """Move every parameter's master into the store and give it a device copy and hooks."""
    owners, params, first_name = lay.owners, lay.params, lay.names
    packed = {pid for pid, p in params.items() if is_packed(p)}
    # the masters new to the store: one slab when it is page-locked host memory
    st.reserve([p.numel() * p.element_size() for pid, p in params.items()
                if first_name[pid] not in st and pid not in packed])
    for pid, p in params.items():
        name = first_name[pid]
        g = lay.group_of[pid]
        target = state.blocks[g] if g >= 0 else state.rest
        if pid in packed:
            _place_packed(state, st, dev, p, name, owners[pid], target, claimed, placed)
            continue
        # one already in the store (a DiskStore reopened) is resumed when the model has no
        # values for it (meta), else overwritten; one new on meta gets its values later (_meta)
        resume = name in st and p.device.type == "meta"
        pending = p.device.type == "meta" and not resume and not isinstance(st, MetaStore)
        if not p.is_leaf:
            raise ValueError(f"parameter {name!r} is not a leaf tensor")
        cdtype = compute_dtype if (compute_dtype is not None and p.is_floating_point()) \
            else p.dtype
        created = name not in st
        if resume:
            handle = st.get(name)
        elif pending:
            handle = st.alloc(name, tuple(p.shape), p.dtype, zero=False)
        elif name in st:
            handle = st.get(name)
            st.write(handle, p.detach().to("cpu").contiguous()).result()
        else:
            handle = st.put(name, p.detach())
        dev_param = DeviceCopy(torch.empty(p.shape, dtype=cdtype, device=dev),
                                requires_grad=p.requires_grad)
        resize_storage(dev_param, 0)
        host = st.host_tensor(handle)
        if host is not None and p.device.type == "meta":
            master = nn.Parameter(host, requires_grad=p.requires_grad)
        elif host is not None:
            master = p
            with torch.no_grad():
                master.data = host
            master.grad = None
        else:  # on disk: a tensor whose ops run on the stored values
            master = nn.Parameter(
                stored_view(HandleSource(st, handle, prepare=state.init_pending),
                            tuple(p.shape), dtype=p.dtype),
                requires_grad=p.requires_grad)
        mark(master)  # torch.autograd.grad(loss, params) reaches the device copy
        b = bind(master, handle)
        b.has_value = not pending
        if pending:
            for m, _ in owners[pid]:
                state.pending_modules[id(m)] = m
        slot = Slot(first_name[pid], owners[pid], master, dev_param, b)
        b.grad_sync = partial(state.sync_grad_of, slot)
        b.grad_flush = partial(state.flush_grads, slot)
        b.grad_adopt = partial(state.adopt_grad, slot)
        slot.group = target
        slot.show(master)
        placed.append((slot, params[pid], created))
        if master is not params[pid]:
            _REPLACED[id(params[pid])] = params[pid]
            _need(params[pid])
        if isinstance(master, StoreTensor):
            _need(master)
        claimed.add(name)
        state.claims.add(name)
        target.slots.append(slot)
        state.slots.append(slot)
        state.by_dev[id(dev_param)] = slot
        state.by_param[id(master)] = slot
        if p.is_floating_point() or p.is_complex():
            # registered with requires_grad on (they survive toggling it: one frozen now still
            # routes its gradient once unfrozen); they hold the state weakly
            for t, fn, args in ((dev_param, state.grad_hook, ()),
                                (master, state.bypass_hook, (slot.name,))):
                rg = t.requires_grad
                t.requires_grad_(True)
                state.handles.append(weak_post_accumulate_grad_hook(t, fn, *args))
                t.requires_grad_(rg)


def _place_packed(state: Offload, st: Store, dev: torch.device, p: torch.Tensor, name: str,
                  owners: list, target: Group, claimed: set[str], placed: list) -> None:
    """Put a quantized parameter's parts in the store (see [Note: packed parameters])."""
    packing, parts = packable(p, name, owners)
    handles = {}
    created = []
    entry = [None, p, created]
    placed.append(entry)
    for k, t in parts.items():
        key = part_key(name, k)
        if key in st:
            handles[k] = st.get(key)
            if t.device.type != "meta":
                st.write(handles[k], as_stored(t)).result()
        else:
            handles[k] = st.put(key, as_stored(t))
            created.append(key)
        claimed.add(key)
    q = Packed(name, owners, packing, handles, rest_master(packing, st, handles), dev)
    entry[0] = q
    q.group = target
    q.show(q.param)
    target.packed.append(q)
    state.packed.append(q)
    state.by_packed[id(q.param)] = q
    state.by_packed[id(q.dev)] = q


def _rollback(state: Offload, st: Store, claimed: set[str], placed: list) -> None:
    """Undo a failed `offload`: parameters back in their modules, store entries freed."""
    _LIVE.discard(state)
    _adopt.release_hooks()
    _end_need(state)
    for h in state.handles:
        h.remove()
    _unplace(state, st, claimed, placed)


def _unplace(state: Offload, st: Store, claimed: set[str], placed: list) -> None:
    """Undo the placement of ``placed`` alone (parameters back, store entries freed)."""
    for slot, original, created in reversed(placed):
        if slot is None or isinstance(slot, Packed):  # `_place_packed`'s
            if slot is not None:
                slot.unbind_owners()
                slot.show(original)
                for h in slot.handles.values():
                    claimed.discard(h.key)
            for key in created:
                if key in st:
                    st.free(st.get(key))
                claimed.discard(key)
            continue
        _REPLACED.pop(id(original), None)  # back in its module
        _end_need(original)
        _end_need(slot.param)
        host = st.host_tensor(slot.binding.handle)
        if original is slot.param and host is not None:
            with torch.no_grad():
                original.data = host.clone()  # its buffer goes back to the store's pool
        slot.show(original)
        unbind(slot.param)
        unmark(slot.param)
        if created:
            st.free(slot.binding.handle)
        claimed.discard(slot.binding.handle.key)
        state.claims.discard(slot.binding.handle.key)
    _adopt.forget(state, [slot for slot, _, _ in placed if slot is not None])


_adopt._placement = (_place, _unplace)  # parameters added later are placed alike


def _check_stored(handle, p: torch.Tensor, name: str) -> None:
    if handle.shape != tuple(p.shape) or handle.dtype != p.dtype:
        raise ValueError(
            f"the store already holds {name!r} as {handle.dtype} {handle.shape}, but the model's"
            f" parameter is {p.dtype} {tuple(p.shape)}; use an empty directory for a different"
            " model, or build the model with the stored shapes and dtypes"
        )


# [Note: the optimizer hooks live while something needs them]
# torch's global optimizer step hooks see every optimizer of the process: installed with the
# first thing they guard (a live offload state, plain or sharded; a parameter `offload`
# replaced; a master on disk), removed with the last. _NEEDS: id -> its finalizer.
_NEEDS: dict[int, weakref.finalize] = {}
_HOOKS: list = []  # the two handles while installed
_RUNNING: list = []  # one entry per hook body running (list append/pop: atomic, lock-free)
_VERDICT = "_headroom_guarded"  # on an optimizer: (its param lists, _EPOCH, holds guarded?)
_EPOCH = [0]  # bumped whenever what is guarded changes: every verdict is recomputed


def _need(obj) -> None:
    """Keep the optimizer hooks installed while ``obj`` lives (or until `_end_need`)."""
    _EPOCH[0] += 1
    if id(obj) not in _NEEDS:
        _NEEDS[id(obj)] = weakref.finalize(obj, _forget, id(obj))
    if not _HOOKS:
        _HOOKS.extend((register_optimizer_step_pre_hook(partial(_on_step, False)),
                       register_optimizer_step_post_hook(partial(_on_step, True))))


def _end_need(obj) -> None:
    f = _NEEDS.get(id(obj))
    if f is not None and (f.peek() or (None,))[0] is obj:
        f()


def _forget(key: int) -> None:
    # NOTE: runs in finalizers, on any thread: no locks, no joins. While a hook body runs
    # (torch iterates the hook dicts) the handles stay; the next need's end removes them.
    _EPOCH[0] += 1
    _NEEDS.pop(key, None)
    if not _NEEDS and not _RUNNING:
        while _HOOKS:
            _HOOKS.pop().remove()


def _guarded(opt) -> bool:
    """Whether ``opt`` holds a parameter the hooks guard; cached per optimizer until its
    groups or what is guarded change (an unrelated optimizer's step costs O(groups))."""
    lists = [g["params"] for g in opt.param_groups]
    seen = getattr(opt, _VERDICT, None)
    if seen is not None and seen[1] == _EPOCH[0] and len(seen[0]) == len(lists) and all(
            a is b and n == len(b) for (a, n), b in zip(seen[0], lists, strict=True)):
        return seen[2]
    hit = any(_REPLACED.get(id(p)) is p or type(p) is DeviceCopy or binding(p) is not None
              for ps in lists for p in ps)
    # NOTE: on the optimizer: a module-level map would hold a dropped model longer
    setattr(opt, _VERDICT, ([(ps, len(ps)) for ps in lists], _EPOCH[0], hit))
    return hit


def _on_step(after: bool, opt, args, kwargs) -> None:
    """Before any optimizer step: release device copies the step would make stale, and make
    ``torch.optim`` optimizers fail clearly on parameters that live on disk; after it, fetch."""
    if getattr(opt, "_headroom_private", False) or not _NEEDS:
        return  # a slice of a HostOptimizer's step (once per slice: kept cheap)
    _RUNNING.append(None)
    try:
        if not _guarded(opt):
            return
        # only models with a parameter in this optimizer (another's step changes none)
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        for state in [st for st in list(_LIVE) if any(id(s.param) in ids for s in st.slots)]:
            (state.after_optimizer_step if after else state.before_optimizer_step)()
        if not after:
            _refuse(opt)
    finally:
        _RUNNING.pop()


def _refuse(opt) -> None:
    own = type(opt).__module__.startswith("headroom.")
    for group in opt.param_groups:
        for p in group["params"]:
            if _REPLACED.get(id(p)) is p:
                raise RuntimeError(
                    f"{type(opt).__name__} was built before hr.offload, which replaced a"
                    f" parameter of shape {tuple(p.shape)}: this optimizer would step a tensor"
                    " the model no longer uses. Nothing was stepped; build the optimizer after"
                    " hr.offload, from model.parameters()")
            if type(p) is DeviceCopy:
                raise RuntimeError(
                    f"{type(opt).__name__} was given the device copies of offloaded"
                    " parameters (listed during the model's forward or backward), which"
                    " training never updates. Build the optimizer from model.parameters()"
                    " outside forward and backward")
            if not own and binding(p) is not None and (
                    isinstance(p, StoreTensor) or _dtensor.is_dtensor(p)):
                raise RuntimeError(
                    f"{type(opt).__name__} cannot step parameters offloaded to a DiskStore:"
                    " their values are on disk. Use hr.HostOptimizer(model.parameters(),"
                    f" torch.optim.{type(opt).__name__}, ...), or offload with store='cpu'")


def prefetch(blocks: nn.Module | Iterable[nn.Module]) -> None:
    """Announce the blocks the next forward will use, so they move to the device now.

    For an order forward does not tell: a multi-task model with offloaded heads
    (``hr.offload(model.heads, ..., prefetch=0)``) uses one head per batch, and the loader knows
    the next task; announced before this step's forward, it is fetched while the step runs.
    Each call replaces the model's previous announcement.

    An announced block stays on the device until a forward uses it, and across an optimizer
    step unless one of its parameters has a gradient (released before, fetched again after).
    A failed forward or backward, ``load_state_dict``, ``hr.load``, ``hr.load_weights`` and
    `unoffload` drop announcements. Each costs one block of device memory.

    Args:
        blocks: one block of an offloaded model (e.g. ``model.heads[t]``) or several; an empty
            list is not accepted (announce other blocks to replace an announcement).

    Raises:
        ValueError: a module that is not a block of an offloaded model.
        RuntimeError: called during that model's forward or backward.

    Example:
        >>> hr.offload(model.heads, device="cuda", store="cpu", prefetch=0)  # doctest: +SKIP
        >>> for (x, task), nxt in zip(batches, next_tasks):                 # doctest: +SKIP
        ...     hr.prefetch(model.heads[nxt])       # arrives while this step runs
        ...     loss_fn(model(x, task)).backward(); opt.step(); opt.zero_grad()
    """
    mods = [blocks] if isinstance(blocks, nn.Module) else list(blocks)
    if not mods:
        raise ValueError("hr.prefetch needs at least one block (e.g. model.heads[task])")
    per_state: dict[int, tuple[Offload, list[Group]]] = {}
    for m in mods:
        role = m.__dict__.get(_guard._ROLE) if isinstance(m, nn.Module) else None
        if not isinstance(role, _GroupRole):
            what = "an offloaded model's root" if isinstance(role, Offload) else (
                f"a {type(m).__name__} that is not a block of an offloaded model")
            raise ValueError(
                f"hr.prefetch takes blocks of a model offloaded with hr.offload (such as"
                f" model.heads[task] after hr.offload(model.heads, ...)), got {what}; see"
                " hr.describe(model) for its blocks"
            )
        per_state.setdefault(id(role.state), (role.state, []))[1].append(role.block)
    for state, groups in per_state.values():
        state.announce(groups)


def offload_states(model: nn.Module) -> list[tuple[str, nn.Module, Offload]]:
    """``(name, module, state)`` of each module within ``model`` that `offload` was applied
    to, in module order (``model`` itself: ``""``)."""
    return [(n, m, m.__dict__[_ATTR]) for n, m in model.named_modules() if _ATTR in m.__dict__]


def state_of(model: nn.Module) -> Offload:
    """The live offload state of an offloaded model, for tests and debugging (not a stable API:
    `describe` gives the plan, `headroom.track_memory` the bytes); raises if not offloaded."""
    state = getattr(model, _ATTR, None)
    if state is None:
        raise RuntimeError("the model is not offloaded (call hr.offload(model, device=...) first)")
    return state


def unoffload(model: nn.Module) -> nn.Module:
    """Undo `offload`: parameters (and gradients) come back onto the device as plain tensors.

    Masters that lived on disk become new ``nn.Parameter`` objects (re-create the optimizer);
    with ``store="cpu"`` the objects are kept. The store's tensors are freed.

    Raises:
        RuntimeError: the model is not offloaded, or a backward pass is in progress.

    Example:
        >>> model = hr.unoffload(model)   # doctest: +SKIP
    """
    if (sharded := _dtensor.sharded_state_of(model)) is not None:
        _dtensor.unoffload_sharded(model)
        _end_need(sharded)
        return model
    state = state_of(model)
    if Phase.BACKWARD in state.phase and in_backward():
        raise RuntimeError("cannot unoffload during a backward pass")
    state._settle()
    state.drop_announced()
    state.init_pending()
    state.sync_grads()
    _adopt.release_all(state)
    state.res.mover.close()  # copies landed, staging memory back to the system
    for h in state.handles:
        h.remove()
    st = state.store
    _guard.remove(model)
    for b in state.blocks:
        _guard.remove(b.module)
    _LIVE.discard(state)
    _adopt.release_hooks()
    _end_need(state)
    for s in [*state.slots, *state.packed]:
        for m, _ in s.owners:
            _outside.remove(m)
    for q in state.packed:
        value = q.packing.rebuild({k: v.to(state.device) for k, v in read_parts(q, st).items()})
        _adopt.free_packed(q, st)
        q.show(value)
    for s in state.slots:
        b = s.binding
        value = st.read(b.handle).result().to(state.device)
        grad = None
        if b.grad_handle is not None and s.param.grad is not None:
            grad = st.read(b.grad_handle).result().to(state.device)
        _adopt.free_slot(state, s)
        unmark(s.param)
        _end_need(s.param)  # a master on disk: replaced below, no longer bound
        if isinstance(s.param, StoreTensor):
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


def describe(model: nn.Module) -> OffloadPlan:
    """The plan an offloaded model runs with: blocks, what stays resident and why, the budget.

    ``print()`` it for a table; its fields are data (``plan.blocks``, ``plan.device_budget``).
    `headroom.residency.plan_offload` gives the same for a model not offloaded.

    Raises:
        RuntimeError: the model is not offloaded.

    Example:
        >>> print(hr.describe(hr.offload(model, device="cuda")))   # doctest: +SKIP
    """
    return _adopt.current_plan(state_of(model))
