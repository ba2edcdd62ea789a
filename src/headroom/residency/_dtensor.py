"""Sharded models (FSDP2's ``fully_shard``): each rank's local shards in a headroom store.

FSDP2 keeps the sharding and every collective. `offload_sharded` moves the padded local shard of
each parameter of the chosen units (any subset, unlike ``CPUOffloadPolicy``) into a host-memory
store and puts it on FSDP2's own host path (``offload_to_cpu``): FSDP2 copies it to the device
before the unit's all-gather and the gradient shard back to the host, where the optimizer steps.
`check_not_sharding` and `check_sharded` refuse the wrong orders (``fully_shard`` after
`hr.offload`; DTensors FSDP2 does not manage). See docs/data_parallel.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn as nn

from headroom.residency._sharded_disk import DiskShards, placeholder, release
from headroom.store import Handle, Store, is_accelerator
from headroom.transfer import bind, unbind

__all__ = [
    "ShardedOffload",
    "check_not_sharding",
    "check_sharded",
    "fsdp_modules",
    "is_dtensor",
    "offload_sharded",
    "sharded_state_of",
    "unoffload_sharded",
]

_ATTR = "_headroom_sharded_offload"

ORDER = (
    "the supported order is: fully_shard each block, then the root (fully_shard(model)), then"
    " hr.offload(model, device=..., store='cpu' or hr.DiskStore(path)), then the optimizer"
    " (hr.HostOptimizer(model.parameters(), torch.optim.AdamW, ...) or torch.optim)"
)


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def _fsdp_module_class() -> type | None:
    if "torch.distributed.fsdp" not in sys.modules:  # nothing can be sharded yet
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def fsdp_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module of ``model`` that ``fully_shard`` was applied to."""
    cls = _fsdp_module_class()
    if cls is None:
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, cls)]


def check_sharded(model: nn.Module, what: str) -> bool:
    """Whether ``model`` is sharded by FSDP2; raises for DTensor parameters FSDP2 does not own
    (``what``: the entry point asking, for the message)."""
    if fsdp_modules(model):
        return True
    for name, p in model.named_parameters():
        if is_dtensor(p):
            raise RuntimeError(
                f"{what}: parameter {name!r} is a DTensor that FSDP2 (fully_shard) does not"
                " manage (tensor parallel or distribute_tensor); headroom stores only plain"
                " tensors and FSDP2's local shards. Apply headroom before distributing the"
                f" parameters, or shard with fully_shard: {ORDER}"
            )
    return False


# ------------------------------------------------------------------ fully_shard after hr.offload
_FSDP_CODES: tuple | None = None


def _being_sharded(module: nn.Module, recurse: bool) -> bool:
    """Whether ``fully_shard`` is listing ``module``'s parameters: it registered itself in the
    module first, or (applied above) lists it with ``recurse=False``, when the stack is walked
    (never for a training loop's listing, which recurses)."""
    from torch.distributed._composable.contract import REGISTRY_KEY

    if "fully_shard" in (module.__dict__.get(REGISTRY_KEY) or ()):
        return True
    return not recurse and _called_from_fully_shard()


def _called_from_fully_shard(depth: int = 64) -> bool:
    global _FSDP_CODES
    if "torch.distributed.fsdp._fully_shard._fsdp_init" not in sys.modules:
        return False
    if _FSDP_CODES is None:
        from torch.distributed.fsdp._fully_shard import _fsdp_init

        _FSDP_CODES = (_fsdp_init._get_managed_states.__code__,
                       _fsdp_init._get_managed_modules.__code__)
    f = sys._getframe(2)
    while f is not None and depth > 0:
        if f.f_code in _FSDP_CODES:
            return True
        f = f.f_back
        depth -= 1
    return False


def check_not_sharding(module: nn.Module, *, listing: bool, recurse: bool = True,
                       whole: bool = False) -> None:
    """Raise if ``fully_shard`` is being applied to (or has wrapped) an offloaded module: at
    its parameter listing (``listing``, ``recurse``), or its call (``whole``, for the root:
    a sharded submodule inside a block is seen before the next forward)."""
    cls = _fsdp_module_class()
    if cls is None:
        return
    if (isinstance(module, cls) or (listing and _being_sharded(module, recurse))
            or (whole and _any_sharded(module, cls))):
        raise RuntimeError(
            f"fully_shard cannot wrap a model offloaded with hr.offload (here"
            f" {type(module).__name__}): FSDP2 would shard the stored masters while the"
            " modules compute with headroom's device copies, so training would be silently"
            f" wrong. Call hr.unoffload(model), then shard; {ORDER}"
        )


def _any_sharded(module: nn.Module, cls: type) -> bool:
    # NOTE: fully_shard gives each module it wraps a subclass of FSDPModule: with none in the
    # process nothing is sharded, and the walk at each forward is skipped
    return bool(cls.__subclasses__()) and any(isinstance(m, cls) for m in module.modules())


# ------------------------------------------------------------------ hr.offload of a sharded model
@dataclass
class ShardedOffload:
    """What `offload_sharded` did to a model: the store, the units and their handles."""

    device: torch.device
    store: Store
    units: list[str]
    handles: dict[str, Handle] = field(default_factory=dict)
    params: dict[str, object] = field(default_factory=dict)  # name -> FSDPParam
    disk: DiskShards | None = None  # a DiskStore: the shards read for each all-gather
    guarded: list[nn.Module] = field(default_factory=list)  # modules whose _apply is checked

    @property
    def stored_bytes(self) -> int:
        """Bytes of local shards resting in the store (padding included in host memory)."""
        return sum(h.nbytes for h in self.handles.values())

    @property
    def resident_bytes(self) -> int:
        """Host bytes of local shards held now (all of them in host memory; on a DiskStore,
        only those read for an all-gather in flight)."""
        return self.disk.resident_bytes if self.disk is not None else self.stored_bytes


def sharded_state_of(model: nn.Module) -> ShardedOffload | None:
    """The `ShardedOffload` of a sharded model `offload_sharded` was applied to, else None."""
    return model.__dict__.get(_ATTR)


def _fsdp_params(module: nn.Module) -> list:
    group = module._get_fsdp_state()._fsdp_param_group
    return list(group.fsdp_params) if group is not None else []


def offload_sharded(model: nn.Module, *, device: torch.device, store: str | Store,
                    blocks: Iterable[nn.Module] | None,
                    compute_dtype: torch.dtype | None, prefetch: int = 1) -> nn.Module:
    """`hr.offload` of a model whose blocks and root were ``fully_shard``ed (a `DiskStore`:
    `headroom.residency._sharded_disk`); each refusal says its cause and fix."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    from headroom.store import resolve_store

    if sharded_state_of(model) is not None:
        raise RuntimeError("the model is already offloaded; call hr.unoffload() on it first")
    if compute_dtype is not None:
        raise ValueError(
            "compute_dtype is not used with a fully_shard'ed model: give fully_shard a"
            " MixedPrecisionPolicy(param_dtype=...) instead (FSDP2 casts before its all-gather)"
        )
    units = fsdp_modules(model)
    names = {id(m): n for n, m in units}
    if blocks is not None:
        chosen = list(blocks)
        for m in chosen:
            if id(m) not in names:
                raise ValueError(
                    f"blocks= of a sharded model are its fully_shard'ed modules; a"
                    f" {type(m).__name__} is not one of them"
                )
        units = [(names[id(m)], m) for m in chosen]
    st = resolve_store(store, device)
    state = ShardedOffload(device, st, [n or "(root)" for n, _ in units])
    pending = []
    for uname, m in units:
        fstate = m._get_fsdp_state()
        mesh_dev = fstate._device
        if torch.device(mesh_dev).type != device.type or (
                device.index is not None and torch.device(mesh_dev) != device):
            raise RuntimeError(
                f"hr.offload(device={device}) but {uname or 'the root'} was fully_shard'ed on"
                f" {mesh_dev}; pass the device of the FSDP2 mesh"
            )
        group = fstate._fsdp_param_group
        if group is not None and group._training_state != TrainingState.IDLE:
            raise RuntimeError("hr.offload cannot run inside a forward or backward")
        for fp in _fsdp_params(m):
            if fp.sharded_state != ShardedState.SHARDED:
                raise RuntimeError(
                    f"{uname or 'the root'} is unsharded (after a forward with"
                    " reshard_after_forward=False?); call model.reshard() first"
                )
            if fp._sharded_param_data.is_meta:
                raise NotImplementedError(
                    "hr.offload of a fully_shard'ed model built on meta: materialize it first"
                    " (model.to_empty(device=...) and initialize, or load a checkpoint with"
                    " torch.distributed.checkpoint)"
                )
            info = fp._module_info
            prefix = f"{uname}." if uname else ""
            pending.append((f"{prefix}{_local_name(m, info.module, info.param_name)}", fp, group))
    # a store without host memory: the shards read for each all-gather (`DiskShards`)
    disk = None if st.holds_host_memory else DiskShards(st, device, prefetch=prefetch)
    try:
        for key, fp, group in pending:
            state.handles[key] = (st.put(key, fp._sharded_param_data.detach()) if disk is None
                                  else disk.put(key, fp, group))
    except BaseException:
        for h in state.handles.values():
            st.free(h)
        raise
    # from here nothing reads the store: interrupted half-way, what moved goes back and the
    # store is freed, as FSDP2 alone had it
    state.disk = disk
    model.__dict__[_ATTR] = state
    originals = {key: fp._sharded_param_data for key, fp, _ in pending}
    pin = is_accelerator(device) and disk is None
    try:
        for key, fp, _ in pending:
            h = state.handles[key]
            flat = st.host_tensor(h) if disk is None else placeholder(fp)
            _rest_in(fp, flat, pin=pin)
            state.params[key] = fp
            if disk is not None:
                release(flat)
                bind(fp.sharded_param, h, store=st)
                disk.rest(disk.shards[key])
        if disk is not None:
            disk.wrap_all()
            disk.hook(model)
        _guard_moves(model, state)
    except BaseException:
        if disk is not None:
            disk.unwrap()
        for m in state.guarded:
            m.__dict__.pop("_apply", None)
        for key, fp in state.params.items():
            unbind(fp.sharded_param)
            _set_shard(fp, originals[key].to(device), device, host=False)
        model.__dict__.pop(_ATTR, None)
        for h in state.handles.values():
            st.free(h)
        raise
    return model


def _local_name(unit: nn.Module, module: nn.Module, attr: str) -> str:
    for n, m in unit.named_modules():
        if m is module:
            return f"{n}.{attr}" if n else attr
    return attr  # pragma: no cover - FSDP2 registers parameters of the unit's modules


def _rest_in(fp, flat: torch.Tensor, *, pin: bool) -> None:
    _set_shard(fp, flat, "cpu", host=True, pin=pin)


def _set_shard(fp, flat: torch.Tensor, grad_device, *, host: bool, pin: bool = False) -> None:
    """Make ``flat`` (1-D, padded) the FSDPParam's local shard: in host memory on FSDP2's host
    path (``host``), or on the mesh's device off it."""
    old = fp.sharded_param
    shard_dim = fp.fsdp_placement.dim
    length = old._local_tensor.size(shard_dim) if old._local_tensor.numel() > 0 else 0
    local = flat.view(fp.padded_sharded_param_size).narrow(shard_dim, 0, length)
    grad = old.grad
    # NOTE: a new DTensor on the host (its device is its local tensor's): FSDP2 copies it to
    # the mesh's device before the all-gather. Built before the FSDPParam is changed, so a
    # failure leaves it as it was.
    new = nn.Parameter(fp.to_sharded_dtensor(local), requires_grad=old.requires_grad)
    if grad is not None:
        new.grad = fp.to_sharded_dtensor(grad._local_tensor.to(grad_device))
    # the parameter object stays (an optimizer built before holds it): its contents swapped
    _swap(old, new)
    fp._sharded_param_data = flat
    fp.offload_to_cpu = host
    # NOTE: only if page-locked: FSDP2 re-pins (copies) a shard that is not, at its lazy init,
    # which would part the parameter from the store
    fp.pin_memory = host and pin and flat.is_pinned()
    fp.sharded_param = old
    fp._setattr_on_modules(old)


def refuse_conversion(fn, dtypes, device: torch.device, what: str, dtype_fix: str, *,
                      moves_ok: Callable[[torch.device], bool], probe=None) -> None:
    """Raise if ``fn`` (a ``Module._apply``'s) converts an empty tensor of one of ``dtypes`` on
    ``probe`` (default: the offload's ``device``) to another dtype, or moves it where
    ``moves_ok`` refuses. ``what``: the module's part of the message; ``dtype_fix``: how to
    compute in another dtype (``{}``: that dtype)."""
    for dtype in sorted(dtypes, key=str):
        out = fn(torch.empty(0, dtype=dtype, device=probe or device))
        if not isinstance(out, torch.Tensor):
            continue
        if out.dtype != dtype:
            raise RuntimeError(
                f"{what} offloaded with hr.offload, whose stored parameters stay {dtype};"
                f" converting them to {out.dtype} is not done behind the store's back."
                f" {dtype_fix.format(out.dtype)}, or hr.unoffload(model), convert, and offload"
                " again")
        if not moves_ok(out.device):
            raise RuntimeError(
                f"{what} offloaded with hr.offload(device={str(device)!r}); moving it to"
                f" {out.device} is not done behind the store's back. Call hr.unoffload(model)"
                " first, then move it")


def _swap(old: torch.Tensor, new: torch.Tensor) -> None:
    """``torch.utils.swap_tensors``, with the cause and the fix when it cannot swap."""
    try:
        torch.utils.swap_tensors(old, new)
    except RuntimeError as e:
        raise RuntimeError(
            f"hr.offload keeps each FSDP2 parameter object (an optimizer may hold it) and"
            f" swaps in its new contents, which torch refused for one of shape"
            f" {tuple(old.shape)} ({e}): something holds a reference to it, e.g. a"
            " torch.compile'd graph or a weakref. Offload before compiling or referencing the"
            " parameters; nothing was offloaded") from e


def _guard_moves(model: nn.Module, state: ShardedOffload) -> None:
    """``Module._apply`` of any module over an offloaded shard goes through `_guarded_apply`."""
    ids = {id(fp.sharded_param) for fp in state.params.values()}
    for m in model.modules():
        if any(id(p) in ids for p in m.parameters()):
            m.__dict__["_apply"] = partial(_guarded_apply, model, m)
            state.guarded.append(m)


def _guarded_apply(model: nn.Module, module: nn.Module, fn, recurse: bool = True):
    """``module._apply(fn)`` over offloaded shards: a dtype conversion or a move off the mesh's
    device is refused before anything changes; a move to it leaves them and applies to the
    rest."""
    state = sharded_state_of(model)
    base = type(module)._apply
    if state is None:  # unoffloaded since
        return base(module, fn, recurse)
    refuse_conversion(fn, {fp.sharded_param.dtype for fp in state.params.values()},
                      state.device, f"{type(module).__name__} holds shards",
                      "Give fully_shard a MixedPrecisionPolicy(param_dtype=...)",
                      moves_ok=lambda d: d.type in ("cpu", state.device.type), probe="cpu")
    keep = {id(t) for fp in state.params.values()
            for t in (fp.sharded_param, fp.sharded_param.grad) if t is not None}
    # NOTE: Module._apply swaps a DTensor parameter even when fn returns it unchanged, which
    # would drop what the shard carries (its binding, gradient hooks): kept ones are not
    swap = torch.utils.swap_tensors

    def swap_unless_kept(t1, t2):
        if id(t1) in keep:
            return None
        return swap(t1, t2)

    torch.utils.swap_tensors = swap_unless_kept
    try:
        return base(module, lambda t: t if id(t) in keep else fn(t), recurse)
    finally:
        torch.utils.swap_tensors = swap


def unoffload_sharded(model: nn.Module) -> nn.Module:
    """Undo `offload_sharded`: local shards back on the mesh's device, the store freed."""
    state = model.__dict__.pop(_ATTR)
    for m in state.guarded:
        m.__dict__.pop("_apply", None)
    disk = state.disk
    if disk is not None:
        disk.unwrap()
        disk.drop_all()
    for key, fp in state.params.items():
        if disk is not None:
            flat = disk.take_back(disk.shards[key]).to(state.device)
        else:
            flat = fp._sharded_param_data.to(state.device).clone()
            state.store.free(state.handles[key])
        _set_shard(fp, flat, state.device, host=False)
    return model
