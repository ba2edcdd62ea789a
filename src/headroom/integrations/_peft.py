"""What PEFT's adapters need of an offloaded model: values kept, merges replayed, new runs.

Values: PEFT draws new adapters on the CPU, then moves them next to the base weight, ``meta``
for a `DiskStore`. So while such a model lives, registered parameters keep a second reference
to their storage until the next forward, and one found on ``meta`` when adopted takes those
values (`residency._events.lost_values`). Adapters kept on the device that PEFT moved go back
between steps.

Merges: a wrapper reporting ``merged_adapters`` merged placeholders over a base on disk; the
merge is replayed on the stored values before the next forward or at unwrapping (`sync_merges`).

`init_adapters`: adapters of a model wrapped on ``meta`` have no values; it draws them with
PEFT's own initializer on temporary host tensors and writes them to the store.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from headroom.residency import (
    Offload,
    Slot,
    events,
    holds,
    lost_adapters,
    offload_states,
    own_slots,
    rescan,
    still_unset,
    unset_tensor,
)
from headroom.transfer import StoreTensor

__all__ = ["init_adapters", "sync_merges"]

# ---------------------------------------------------------------------- values lost on the way
# module -> {attr: a second reference to the storage its parameter was registered with}
_ALIASES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _registered(module: nn.Module, name: str, param: nn.Parameter, keep: bool) -> None:
    if keep:  # see the module docstring
        _ALIASES.setdefault(module, {})[name] = param.detach()
    elif module in _ALIASES:
        # a quantized weight replacing one: the old values go (else a quantized load holds all)
        _ALIASES[module].pop(name, None)


def _lost_value(module: nn.Module, name: str) -> torch.Tensor | None:
    return _ALIASES.get(module, {}).get(name)


def _forget_values(state: Offload, module: nn.Module) -> None:
    """At the model's forward adoption is over: the second references go."""
    if module is state.model:
        _ALIASES.clear()


def _kept_back_on_device(state: Offload) -> None:
    for p in state.kept.values():
        if p.device != state.device and not p.is_meta:
            # moved next to the base weight by PEFT: back to the device, the same object
            with torch.no_grad():
                p.data = p.data.to(state.device)


# ---------------------------------------------------------------------- merges
# On a wrapper module: the adapters merged into the stored base (see `sync_merges`).
_APPLIED = "_headroom_merged"
# On the offload state: weak references to the wrappers (modules with a ``base_layer``) and the
# listing of the model's modules they were found in.
# NOTE: on the state, not in a map keyed by it: the wrappers lead back to the state (module ->
# guard role -> state), so a weak-keyed map would keep every offloaded model alive.
_WRAPPERS, _LISTED = "_headroom_wrappers", "_headroom_wrappers_of"


def _merged(layer: nn.Module) -> tuple:
    return tuple(getattr(layer, "merged_adapters", None) or ())


def _is_wrapper(m: nn.Module) -> bool:
    return isinstance(m._modules.get("base_layer"), nn.Module)


def _wrappers(state: Offload) -> list[weakref.ref]:
    d = state.__dict__
    if d.get(_LISTED) is not state.module_names:  # the model's modules were listed again
        d[_LISTED] = state.module_names
        d[_WRAPPERS] = [weakref.ref(m) for m in state.model.modules() if _is_wrapper(m)]
    return d[_WRAPPERS]


def _applied_now(layer: nn.Module | None) -> None:
    if layer is not None and _APPLIED not in layer.__dict__:
        layer.__dict__[_APPLIED] = _merged(layer)


def _track_all(state: Offload) -> None:
    for r in _wrappers(state):  # merged before hr.offload: into the values it stored
        _applied_now(r())


def _track(state: Offload, m: nn.Module) -> None:
    if _is_wrapper(m):
        _wrappers(state).append(weakref.ref(m))
        _applied_now(m)


def _sync_all(state: Offload) -> None:
    for r in _wrappers(state):
        m = r()
        if m is not None and m.__dict__.get(_APPLIED) != _merged(m) and holds(state, m):
            sync_merges(state, m)


def _unwrapped(state: Offload, old: nn.Module, keep: nn.Module, slots: list[Slot]) -> None:
    sync_merges(state, old, slots)


def _inside(slot: Slot, ids: set[int]) -> bool:
    return all(id(m) in ids for m, _ in slot.owners)


def sync_merges(state: Offload, layer: nn.Module, slots: list[Slot] | None = None) -> None:
    """Bring a wrapper's stored base in line with its ``merged_adapters``: its ``merge()`` /
    ``unmerge()`` ran on placeholders, so they run again on host copies and the base is stored."""
    cur = list(_merged(layer))
    done = list(layer.__dict__.get(_APPLIED, ()))
    if cur == done:
        return
    if slots is None:
        ids = {id(m) for m in layer.modules()}
        slots = [s for s in state.slots if _inside(s, ids)]
    layer.__dict__[_APPLIED] = tuple(cur)
    if all(state.store.host_tensor(s.binding.handle) is not None
           or isinstance(s.param, StoreTensor) for s in slots):
        # host masters, or StoreTensors (in-place ops write through): the merge was stored
        return
    merge, unmerge = getattr(layer, "merge", None), getattr(layer, "unmerge", None)
    if not callable(merge) or not callable(unmerge):
        raise RuntimeError(
            f"{type(layer).__name__} reports merged adapters {cur} but has no merge()/unmerge();"
            " its base rests on disk, where a merge of placeholders changes nothing. Unload"
            " without merging, or hr.unoffload(model) before merging"
        )
    state.init_pending()
    base = layer._modules.get("base_layer")
    base_ids = {id(m) for m in base.modules()} if base is not None else set()
    temps = {}
    for s in slots:
        temps[id(s)] = nn.Parameter(state.store.read(s.binding.handle).result(),
                                    requires_grad=s.param.requires_grad)
        s.show(temps[id(s)])
    try:
        _merge_on(layer, merge, unmerge, done, cur)
        state.res.mover.wait_reads()
        for s in slots:
            if _inside(s, base_ids):
                _store(state, s, temps[id(s)])
    except BaseException:
        layer.__dict__[_APPLIED] = tuple(done)
        raise
    finally:
        layer.merged_adapters[:] = cur
        for s in slots:
            s.show(s.param)


@torch.no_grad()
def _merge_on(layer: nn.Module, merge, unmerge, done: list[str], cur: list[str]) -> None:
    """Unmerge what the stored base holds, merge what the layer reports (on host copies)."""
    layer.merged_adapters[:] = done
    if done:
        unmerge()
    layer.merged_adapters[:] = []
    if cur:
        merge(adapter_names=cur)


@torch.no_grad()
def init_adapters(model: nn.Module) -> list[str]:
    """Initialize adapters that were created while the model was on ``meta``, as PEFT does.

    For "build on ``meta`` → ``peft.get_peft_model`` → `headroom.offload` →
    `headroom.load_weights` (the base)" in a new LoRA run. Each adapter without values is drawn
    by PEFT's initializer (``reset_lora_parameters`` with the config's ``init_lora_weights``:
    ``True``, ``"gaussian"``; ``False``: the layers' ``reset_parameters``) from torch's global
    generator, in the model's order, and stored. Adapters with values and the base stay.

    Args:
        model: the offloaded model, or a module containing it (the ``PeftModel``). Not during
            its forward or backward.

    Returns:
        The names of the parameters it initialized (empty when none lacked values).

    Raises:
        RuntimeError: the model is not offloaded, or is in a forward or backward; an adapter
            type or ``init_lora_weights`` it cannot initialize (DoRA, PiSSA, OLoRA, ...).

    Example:
        >>> with torch.device("meta"):                                     # doctest: +SKIP
        ...     model = peft.get_peft_model(AutoModelForCausalLM.from_config(cfg), lora)
        >>> hr.offload(model, device="cuda", store=hr.DiskStore("/scratch/w"))  # doctest: +SKIP
        >>> hr.load_weights(model, "path/to/base")                         # doctest: +SKIP
        >>> hr.init_adapters(model)                                        # doctest: +SKIP
    """
    states = [s for _, _, s in offload_states(model)]
    if not states:
        raise RuntimeError("hr.init_adapters: the model is not offloaded (PEFT initializes such"
                           " adapters itself); call hr.offload(model, ...) first")
    configs = _configs(model)
    done: list[str] = []
    for state in states:
        if state.busy:
            raise RuntimeError("hr.init_adapters during the model's forward or backward; call it"
                               " between steps")
        rescan(state)
        lost = lost_adapters(state, lost_ok=True)
        if not lost:
            continue
        # every initializer is found before any runs: a refusal leaves nothing half done
        todo = [(modules, _initializer(wrapper, adapter, modules, configs.get(adapter),
                                       f"{wname}." if wname else ""))
                for wname, wrapper in state.model.named_modules() if _is_wrapper(wrapper)
                for adapter, modules in _lost_of(state, wrapper, lost).items()]
        for modules, init in todo:
            done += _run(state, modules, init)
        state.pending_modules = {
            k: m for k, m in state.pending_modules.items()
            if any(not s.binding.has_value for _, s in own_slots(state, m))
            or any(b is not None and b.device.type == "meta" for b in m._buffers.values())}
    return done


def _configs(model: nn.Module) -> dict:
    """Adapter name -> its PEFT config (``peft_config`` of the PeftModel or the tuner model)."""
    for m in model.modules():
        cfg = getattr(m, "peft_config", None)
        if isinstance(cfg, dict):
            return cfg
    return {}


def _lost_of(state, wrapper: nn.Module, lost: set[int]) -> dict[str, list[nn.Module]]:
    """Adapter name -> ``wrapper``'s modules holding its parameters without values."""
    out: dict[str, list[nn.Module]] = {}
    for cname, child in wrapper._modules.items():
        if cname == "base_layer" or child is None:
            continue
        if isinstance(child, nn.ModuleDict):
            for name, sub in child.items():
                subs = [m for m in sub.modules() if id(m) in lost]
                if subs:
                    out.setdefault(name, []).extend(subs)
        elif id(child) in lost:
            for attr, s in own_slots(state, child):
                if not s.binding.has_value and child not in out.get(attr, []):
                    out.setdefault(attr, []).append(child)
    return out


def _initializer(wrapper: nn.Module, adapter: str, modules: list[nn.Module], config,
                 prefix: str) -> Callable[[], None]:
    how = getattr(config, "init_lora_weights", True) if config is not None else True
    reset = getattr(wrapper, "reset_lora_parameters", None)
    if not callable(reset) or getattr(config, "use_dora", False):
        what = "DoRA" if getattr(config, "use_dora", False) else type(wrapper).__name__
        raise RuntimeError(
            f"hr.init_adapters cannot initialize the {what} adapter {adapter!r} of {prefix!r}:"
            " it initializes LoRA adapters (lora_A/lora_B) only. Load saved adapters"
            " (peft.set_peft_model_state_dict or hr.load_weights(model, path)), or wrap after"
            " hr.offload and hr.load_weights so PEFT initializes them itself")
    if how is True or (isinstance(how, str) and how.lower() == "gaussian"):
        return lambda: reset(adapter, how)
    if how is False:  # PEFT leaves the layers as constructed
        return lambda: [m.reset_parameters() for m in modules]
    raise RuntimeError(
        f"hr.init_adapters cannot initialize adapter {adapter!r} of {prefix!r} with"
        f" init_lora_weights={how!r}: that initialization reads the base weights, which rest in"
        " the store. Wrap after hr.offload and hr.load_weights (store='cpu' for methods that"
        " change the base), or load saved adapters")


def _run(state, modules: list[nn.Module], init: Callable[[], None]) -> list[str]:
    """Run ``init`` on host tensors in place of ``modules``' parameters; store the unset ones."""
    own = [(m, a, s) for m in modules for a, s in own_slots(state, m)]
    temps = {id(s): nn.Parameter(unset_tensor(s.binding.handle.shape, s.binding.handle.dtype),
                                 requires_grad=s.param.requires_grad) for _, _, s in own}
    try:
        for m, a, s in own:
            m._parameters[a] = temps[id(s)]
        init()
    finally:
        for m, a, s in own:
            m._parameters[a] = s.param
    pending = [(m, a, s) for m, a, s in own if not s.binding.has_value]
    names = [f"{state.module_names.get(id(m), '')}{a}" for m, a, _ in pending]
    left = [n for n, (_, _, s) in zip(names, pending, strict=True) if still_unset(temps[id(s)])]
    if left:
        raise RuntimeError(
            f"hr.init_adapters: PEFT's initializer did not set {', '.join(left)}; nothing was"
            " written for them. Load saved adapters (peft.set_peft_model_state_dict)")
    for _, _, s in pending:
        _store(state, s, temps[id(s)])
    return names


def _store(state: Offload, s: Slot, value: torch.Tensor) -> None:
    h = s.binding.handle
    state.store.write(h, value.detach().to(h.dtype).contiguous()).result()
    s.binding.has_value = True


events.on_parameter_registered.append(_registered)
events.lost_values.append(_lost_value)
events.before_forward.append(_forget_values)
events.between_steps.append(_kept_back_on_device)
events.on_offload.append(_track_all)
events.on_module_added.append(_track)
events.on_module_replaced.append(_unwrapped)
events.between_steps.append(_sync_all)
