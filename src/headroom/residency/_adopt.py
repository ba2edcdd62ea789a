"""Parameters that join an offloaded model after `hr.offload` (adapters such as LoRA's).

torch's process-wide module and parameter registration hooks (installed while an offloaded model
lives) place a parameter attached to the model in the store at once, in the group of the block
holding it, before any optimizer can list it. Parameters dropped from the model leave the store,
their values going back into the parameter objects. One found on ``meta`` takes the values a
`_events.lost_values` subscriber kept for it; one on ``meta`` from the start stays pending
(`headroom.residency._meta`). `sync_masters` writes a host master rebound behind the store's
back (``p.data = new``, as PEFT's ``safe_merge`` does) into the store.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.nn.parameter import is_lazy

from headroom.residency import _events, _outside
from headroom.residency._group import Group, Slot
from headroom.residency._outside import keep_on_device
from headroom.residency._packed import Packed, check_packable, is_packed, read_parts
from headroom.residency._plan import Layout, adapter_modules, layout
from headroom.store import HostStore, Store, claimed_keys
from headroom.transfer import HeldSource, StoreTensor, binding, unbind

if TYPE_CHECKING:  # pragma: no cover
    from headroom.residency._schedule import Offload

__all__ = [
    "current_plan", "forget", "free_packed", "free_slot", "holds", "hook_state_dict", "install",
    "release_all", "release_hooks", "rescan", "retire", "sync_masters",
]

_HANDLES: list = []  # the registration hooks' handles, while a model is offloaded
_LIVE: weakref.WeakSet = weakref.WeakSet()  # live offload states (for the step hooks too)
# `_offload._place` and `_unplace`, set by `_offload` (above this module) on import
_placement: tuple[Callable, Callable] | None = None


# NOTE: `_Members` rests on the state: a weak-keyed map would keep every state alive (its
# groups lead back to it)
_MEMBERS = "_adopt_members"


class _Members:
    """Which modules belong to an offloaded model, their names and the group holding them."""

    def __init__(self, state: Offload) -> None:
        # modules with the state-dict hooks of hr.offload
        self.hooked = {id(m) for s in state.slots for m, _ in s.owners}
        self.dirty = False
        self.plan_stale = False  # parameters joined or left since the plan was made
        # slot id -> its master's host tensor in the store, and that tensor's address
        self.hosts: dict[int, tuple[torch.Tensor | None, int]] = {}
        self.refresh(state)

    def refresh(self, state: Offload) -> None:
        names = {}
        self.refs: dict[int, weakref.ref] = {}
        for n, m in state.model.named_modules(remove_duplicate=False):
            names.setdefault(id(m), f"{n}." if n else "")
            self.refs[id(m)] = weakref.ref(m)
        state.module_names = names
        self.home: dict[int, Group] = {id(m): b for b in state.blocks for m in b.module.modules()}
        # modules holding adapters, which stay on the device (hr.offload(adapters="device"))
        self.adapter_mods = adapter_modules(state.model) if state.adapters == "device" \
            else set()

    def has(self, m: nn.Module) -> bool:
        r = self.refs.get(id(m))
        return r is not None and r() is m


def install(state: Offload) -> None:
    """Watch ``state``'s model for parameters added after `hr.offload` (called by it)."""
    setattr(state, _MEMBERS, _Members(state))
    _copyable(state, [*state.slots, *state.packed])
    _events.emit(_events.on_offload, state)
    if not _HANDLES:
        from torch.nn.modules.module import (
            register_module_module_registration_hook,
            register_module_parameter_registration_hook,
        )

        _HANDLES.append(register_module_module_registration_hook(_on_module))
        _HANDLES.append(register_module_parameter_registration_hook(_on_param))
    weakref.finalize(state, release_hooks)


def release_hooks() -> None:
    """Remove the registration hooks when no offloaded model is left."""
    if any(_members(s) is not None for s in list(_LIVE)):
        return
    while _HANDLES:
        _HANDLES.pop().remove()


def _live() -> list[tuple[Offload, _Members]]:
    return [(s, info) for s in list(_LIVE) if (info := _members(s)) is not None]


def _members(state: Offload) -> _Members | None:
    return getattr(state, _MEMBERS, None)


def holds(state: Offload, module: nn.Module) -> bool:
    """Whether ``module`` belongs to ``state``'s model (as of the last rescan or adoption)."""
    info = _members(state)
    return info is not None and info.has(module)


def _owner(module: nn.Module) -> tuple[Offload, _Members] | None:
    for state, info in _live():
        if info.has(module):
            return state, info
    return None


def _on_param(module: nn.Module, name: str, param: nn.Parameter):
    live = _live()
    if not live or param is None or is_lazy(param):
        return None  # a lazy module's parameter has neither values nor a shape yet
    # values a later move to meta would destroy (placeholders of a store off host memory)
    keep = param.device.type != "meta" and binding(param) is None and not is_packed(param) \
        and any(not s.store.holds_host_memory for s, _ in live)
    _events.emit(_events.on_parameter_registered, module, name, param, keep)
    found = _owner(module)
    if found is None:
        return None
    state, info = found
    info.dirty = True  # what this parameter replaces may have left the model (see rescan)
    if state.busy or binding(param) is not None or id(param) in state.by_packed \
            or state.kept.get(id(param)) is param:
        return None
    old = module._parameters.get(name)  # still registered: torch calls the hook first
    if old is not None and old is not param:  # replaced in place: the old one leaves
        slot = state.by_param.get(id(old)) or state.by_dev.get(id(old)) \
            or state.by_packed.get(id(old))
        if slot is not None and [(id(m), a) for m, a in slot.owners] == [(id(module), name)]:
            retire(state, [slot])
    prefix = state.module_names.get(id(module), "")
    item = (module, name, param, prefix + name)
    if id(module) in info.adapter_mods:
        kept = _keep(state, [item], assign=False)
        if kept:
            return kept[0]
    placed = _adopt(state, info, [item], info.home.get(id(module)))
    return placed[0].param if placed else None


def _on_module(parent: nn.Module, name: str, sub: nn.Module | None):
    if sub is None:
        return None
    found = _owner(parent)
    if found is None:
        return None
    state, info = found
    info.dirty = True
    if state.busy:
        return None
    old = parent._modules.get(name)
    if old is not None and old is not sub:
        _drop(state, info, old, keep=sub)
    prefix = f"{state.module_names.get(id(parent), '')}{name}."
    adapters = set()
    if state.adapters == "device":
        inside = id(parent) in info.adapter_mods or (
            isinstance(parent._modules.get("base_layer"), nn.Module) and name != "base_layer")
        adapters = {id(m) for m in sub.modules()} if inside else adapter_modules(sub)
        info.adapter_mods |= adapters
    items = []
    for mname, m in sub.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is None or id(p) in state.by_param or id(p) in state.by_dev \
                    or id(p) in state.by_packed or state.kept.get(id(p)) is p:
                continue
            full = f"{prefix}{mname}.{attr}" if mname else f"{prefix}{attr}"
            items.append((m, attr, p, full))
    if adapters:
        kept = {id(p) for p in _keep(state, [it for it in items if id(it[0]) in adapters])}
        items = [it for it in items if id(it[0]._parameters[it[1]]) not in kept]
    if items:
        _adopt(state, info, items, info.home.get(id(parent)))
    home = info.home.get(id(parent))
    for mname, m in sub.named_modules(remove_duplicate=False):
        info.refs[id(m)] = weakref.ref(m)
        state.module_names[id(m)] = f"{prefix}{mname}." if mname else prefix
        if home is not None:
            info.home[id(m)] = home
        _events.emit(_events.on_module_added, state, m)
    return None


def _keep(state: Offload, items: list, *, assign: bool = True) -> list[nn.Parameter]:
    """Keep adapters new to the model on the device (``adapters="device"``), those with values
    (or remembered ones); returns them, registered in place of those given if ``assign``."""
    out = []
    for m, attr, p, _full in items:
        value = p
        if p.is_meta:
            alias = _events.lost_value(m, attr)
            if alias is None or alias.shape != p.shape or alias.device.type == "meta":
                continue  # no values: rests in the store, pending (hr.init_adapters, a load)
            value = nn.Parameter(alias.to(state.device, p.dtype), requires_grad=p.requires_grad)
        out.append(keep_on_device(state, value, [(m, attr)]))
        if assign and value is not p:
            m._parameters[attr] = value
    info = _members(state)
    if out and info is not None:
        info.plan_stale = True
    return out


def _adopt(state: Offload, info: _Members, items: list, home: Group | None) -> list[Slot]:
    """Place parameters new to the model in its store, in ``home``'s group (None: outside)."""
    assert _placement is not None  # install() is called by hr.offload only
    _place, _unplace = _placement
    params: dict[int, nn.Parameter] = {}  # registered parameter's id -> what is placed
    names: dict[int, str] = {}
    owners: dict[int, list] = {}
    for m, attr, p, full in items:
        if binding(p) is not None:
            raise RuntimeError(
                f"parameter {full!r} added to an offloaded model already rests in a store of"
                " another offloaded model; give each model its own parameters"
            )
        owners.setdefault(id(p), []).append((m, attr))
        if id(p) in params:
            continue
        names[id(p)] = full
        value = p
        if p.device.type == "meta":
            alias = _events.lost_value(m, attr)
            if alias is not None and alias.shape == p.shape and alias.device.type == "cpu":
                value = nn.Parameter(alias.to(p.dtype), requires_grad=p.requires_grad)
        params[id(p)] = value
    if not params:
        return []
    if state.busy:
        raise RuntimeError("parameters cannot join an offloaded model during its forward or"
                           " backward")
    state.drop_announced()
    gi = state.blocks.index(home) if home is not None else -1
    st = state.store
    claimed = claimed_keys(st)
    for pid, p in params.items():
        if is_packed(p):  # its parts' keys (name#part), checked as at hr.offload
            check_packable(st, claimed, p, names[pid], owners[pid])
        elif names[pid] in st:
            raise RuntimeError(
                f"cannot offload the new parameter {names[pid]!r}: {st!r} already holds a tensor"
                " of that name; give the new module another name"
            )
    lay = Layout(None, [b.module for b in state.blocks], params, names, owners,
                 {pid: gi for pid in params})
    placed: list = []
    try:
        _place(state, st, state.device, state.compute_dtype, lay, claimed, placed)
    except BaseException:
        _unplace(state, st, claimed, placed)  # the parameters already there stay offloaded
        raise
    _copyable(state, [slot for slot, _, _ in placed])
    info.plan_stale = True
    _hook_new(state, info, [m for m, *_ in items])
    return [slot for slot, _, _ in placed]


def _hook_new(state: Offload, info: _Members, modules: list[nn.Module]) -> None:
    for m in modules:
        if id(m) not in info.hooked:
            info.hooked.add(id(m))
            hook_state_dict(state, m)


def hook_state_dict(state: Offload, m: nn.Module) -> None:
    """Route ``m``'s parameter reads and state dict through ``state``."""
    _outside.install(state, m)
    cls = type(state)  # Offload
    state.handles.append(m.register_state_dict_post_hook(partial(cls.state_dict_hook, state)))
    state.handles.append(m.register_load_state_dict_pre_hook(
        partial(cls.load_state_dict_pre_hook, state)))


# ---------------------------------------------------------------------- dropped parameters
def _inside(slot: Slot, ids: set[int]) -> bool:
    return all(id(m) in ids for m, _ in slot.owners)


def _drop(state: Offload, info: _Members, old: nn.Module, *, keep: nn.Module) -> None:
    """``old`` leaves the model; ``keep`` (perhaps a module inside it) takes its place."""
    old_ids = {id(m) for m in old.modules()}
    keep_ids = {id(m) for m in keep.modules()}
    gone_packed = [q for q in state.packed if _inside(q, old_ids) and not _inside(q, keep_ids)]
    if gone_packed:
        retire(state, gone_packed)
    inside = [s for s in state.slots if _inside(s, old_ids)]
    if not inside:
        return
    sync_masters(state, inside)
    if id(keep) in old_ids:
        _events.emit(_events.on_module_replaced, state, old, keep, inside)
    gone = [s for s in inside if not _inside(s, keep_ids)]
    if gone:
        retire(state, gone)


def release_all(state: Offload) -> None:
    state.drop_announced()
    for g in [*state.blocks, state.rest]:
        state.res.release(g)


def retire(state: Offload, gone: list[Slot | Packed]) -> None:
    """Parameters that left the model leave the store: values back in the objects (host
    tensors; a quantized one's host copies of its parts, [Note: packed parameters]),
    gradients dropped."""
    st = state.store
    release_all(state)
    if any(isinstance(s, Slot) for s in gone):
        state.sync_grads()
    for s in gone:
        if isinstance(s, Packed):
            s.keep_values(read_parts(s, st))
            free_packed(s, st)
            continue
        b = s.binding
        value = st.read(b.handle).result().clone() if b.has_value else None
        free_slot(state, s)
        p = s.param
        p.grad = None
        if value is not None:
            if isinstance(p, StoreTensor):  # it keeps the values it had, not the store's key
                p._source = HeldSource(value, f"{b.handle.key!r}, taken out of {st!r}")
            if p.device.type == "meta" or isinstance(p, StoreTensor):  # no memory of its own
                p = nn.Parameter(value, requires_grad=p.requires_grad)
                s.show(p)
            else:
                p.data = value
    forget(state, gone)
    info = _members(state)
    if info is not None:
        info.plan_stale = True
        for s in gone:
            info.hosts.pop(id(s), None)


def free_slot(state: Offload, s: Slot) -> None:
    """Free a slot's store entries and claims, and unbind its master."""
    st, b = state.store, s.binding
    if b.grad_handle is not None:
        st.free(b.grad_handle)
    st.free(b.handle)
    claimed_keys(st).discard(b.handle.key)  # [Note: one writer per key]
    state.claims.discard(b.handle.key)
    unbind(s.param)


def free_packed(q: Packed, st: Store) -> None:
    """Free a quantized parameter's parts in the store; its 8-bit layer forgets them."""
    q.unbind_owners()
    for h in q.handles.values():
        st.free(h)
        claimed_keys(st).discard(h.key)


def forget(state: Offload, gone: list) -> None:
    """Take slots and packed parameters out of ``state``'s lists and maps."""
    ids = {id(s) for s in gone}
    for s in gone:
        for d in (state.by_param, state.by_dev, state.by_packed):
            d.pop(id(s.param), None)
            d.pop(id(s.dev), None)
    for holder in [state, *state.blocks, state.rest]:
        holder.slots = [s for s in holder.slots if id(s) not in ids]
        holder.packed = [q for q in holder.packed if id(q) not in ids]


# ---------------------------------------------------------------------- between steps
def _rebound(s: Slot, hosts: dict, st: HostStore) -> bool:
    known = hosts.get(id(s))
    if known is None:
        h = st.host_tensor(s.binding.handle)
        known = hosts[id(s)] = (h, h.data_ptr() if h is not None else 0)
    host, ptr = known
    p = s.param
    return host is not None and p.data_ptr() != ptr and p.device.type == "cpu"


def sync_masters(state: Offload, slots: list[Slot] | None = None) -> None:
    """Masters in host memory whose ``.data`` was rebound since: their value into the store."""
    st = state.store
    if not isinstance(st, HostStore):
        return  # masters elsewhere are placeholders: nothing to rebind
    info = _members(state)
    hosts = info.hosts if info is not None else {}
    with torch._C.DisableTorchFunctionSubclass():  # masters' reads as plain tensors'
        rebound = [s for s in (state.slots if slots is None else slots)
                   if _rebound(s, hosts, st)]
    for s in rebound:
        host, p = hosts[id(s)][0], s.param
        if p.shape != host.shape or p.dtype != host.dtype:
            continue  # reported where it is fetched (see _group._check_master)
        state.res.mover.wait_reads()
        with torch.no_grad():
            host.copy_(p.detach())
            p.data = host
        s.binding.has_value = True  # a whole value written (counted in value_edits)


def rescan(state: Offload) -> None:
    """Between steps: adopt what the registration hooks missed (added during a forward, or
    past them), drop what left the model, sync rebound masters."""
    info = _members(state)
    if info is None:
        return
    sync_masters(state)
    _events.emit(_events.between_steps, state)
    if not info.dirty:
        return
    info.dirty = False
    info.refresh(state)
    present: dict[int, list] = {}
    for mname, m in state.model.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        for attr, p in m._parameters.items():
            if p is not None:
                present.setdefault(id(p), []).append((m, attr, p, prefix + attr))
    gone = [s for s in [*state.slots, *state.packed]
            if id(s.param) not in present and id(s.dev) not in present]
    if gone:
        retire(state, gone)
    state.kept = {i: p for i, p in state.kept.items() if i in present}
    for pid, regs in present.items():
        if pid in state.kept:
            continue
        slot = state.by_param.get(pid) or state.by_dev.get(pid) or state.by_packed.get(pid)
        if slot is None and all(id(m) in info.adapter_mods for m, *_ in regs) \
                and _keep(state, regs):
            continue  # an adapter with values, kept on the device
        homes = {id(info.home.get(id(m))) for m, *_ in regs}  # (None: outside blocks)
        home = info.home.get(id(regs[0][0])) if len(homes) == 1 else None
        if slot is None:
            _adopt(state, info, regs, home)
        elif {(id(m), a) for m, a in slot.owners} != {(id(m), a) for m, a, *_ in regs}:
            _rehome(state, info, slot, [(m, a) for m, a, *_ in regs], home)


def _rehome(state: Offload, info: _Members, slot: Slot | Packed, owners: list,
            home: Group | None) -> None:
    """A stored parameter registered elsewhere now (tied after hr.offload): shown there, in
    the group holding all its owners (else outside blocks)."""
    target = home if home is not None else state.rest
    if slot.group is not target:
        for g in (slot.group, target):
            state.res.release(g)
        coll = "packed" if isinstance(slot, Packed) else "slots"
        getattr(slot.group, coll).remove(slot)
        getattr(target, coll).append(slot)
        slot.group = target
        info.plan_stale = True
    slot.owners = owners
    slot.show(slot.param)
    _hook_new(state, info, [m for m, _ in owners])


# ---------------------------------------------------------------------- copies
def _copy(state_ref: weakref.ref, s: Slot | Packed, memo: dict) -> torch.Tensor:
    """``copy.deepcopy`` of a master resting on disk: a host parameter with its value (a
    quantized one: the same class over host copies of its parts)."""
    state = state_ref()
    packed = isinstance(s, Packed)
    if state is None or s not in (state.packed if packed else state.slots):
        raise RuntimeError(f"copy of {s.name!r}: its model is no longer offloaded")
    if packed:
        out = s.packing.rebuild(read_parts(s, state.store))
    else:
        if not s.binding.has_value:
            state.init_pending()
        state.sync_grads()
        value = state.store.read(s.binding.handle).result()
        out = nn.Parameter(value, requires_grad=s.param.requires_grad)
    memo[id(s.param)] = out
    return out


def _copyable(state: Offload, slots: list) -> None:
    # NOTE: a deep copy of a master on disk (a ``meta`` placeholder; PEFT's modules_to_save)
    # reads the store through this instance attribute, which copy.deepcopy looks up first
    ref = weakref.ref(state)
    for s in slots:
        if s.param.device.type == "meta":
            s.param.__deepcopy__ = partial(_copy, ref, s)


def current_plan(state: Offload):
    """The plan of `hr.describe`, brought up to date when parameters joined or left."""
    info = _members(state)
    if info is not None and info.plan_stale:
        info.plan_stale = False
        o = state.plan.options
        lay = layout(state.model, device=o.device, blocks=[b.module for b in state.blocks],
                     prefetch=o.prefetch, compute_dtype=o.compute_dtype,
                     adapters=set(state.kept))
        state.plan = replace(lay.plan, options=o, store=state.plan.store)
    return state.plan
