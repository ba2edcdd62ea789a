"""Parameters and buffers of an offloaded model created on ``meta``: values on demand.

Each such parameter gets room in the store and is *pending* until a load writes it; whatever is
still pending when a value is first needed (the first forward, ``state_dict()``, `hr.save`) is
initialized as the model initializes itself, module by module in registration order (its
``reset_parameters()``, or a Hugging Face model's ``_init_weights``): a model loaded from a
checkpoint is never initialized at random first. Buffers on ``meta`` (a rotary embedding's
``inv_freq``) are filled the same way, on the compute device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:  # pragma: no cover
    from headroom.residency._schedule import Offload

__all__ = ["init_pending", "initializer", "prune_pending"]


def initializer(root: nn.Module, module: nn.Module) -> Callable[[], None] | None:
    """How the model itself initializes ``module``'s own parameters and buffers, if it can."""
    hf_init = getattr(root, "_init_weights", None)
    if callable(hf_init) and hasattr(root, "config"):
        return lambda: hf_init(module)
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset
    return None


@torch.no_grad()
def init_pending(state: Offload, *, lost_ok: bool = False) -> None:
    """Give every pending parameter and buffer of ``state``'s model its initial value; raises
    naming those with no way to be initialized."""
    if not state.pending_modules:
        return
    order = {id(m): i for i, m in enumerate(state.model.modules())}
    lost = _lost_adapters(state, lost_ok)
    missing: list[str] = []
    for module in sorted(state.pending_modules.values(), key=lambda m: order.get(id(m), -1)):
        if id(module) in lost:
            continue
        slots = [(a, s) for a, s in _own_slots(state, module) if not s.binding.has_value]
        buffers = [(n, b) for n, b in module._buffers.items()
                   if b is not None and b.device.type == "meta"]
        if not slots and not buffers:
            continue
        init = initializer(state.model, module)
        if init is None:
            prefix = state.module_names.get(id(module), "")
            missing += [f"{prefix}{a}" for a, _ in slots] + [f"{prefix}{n}" for n, _ in buffers]
            continue
        _run_init(state, module, init, slots, buffers)
    prune_pending(state)
    if missing:
        raise RuntimeError(
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} were created on the"
            " meta device and have no values: their modules have no reset_parameters() and the"
            " model no _init_weights(). Load them with hr.load_weights(model, path) (or"
            " load_state_dict), or build those modules on the CPU"
        )


def prune_pending(state: Offload) -> None:
    """Forget the modules with nothing pending any more (the dict holds them strongly)."""
    state.pending_modules = {k: m for k, m in state.pending_modules.items()
                             if any(not s.binding.has_value for _, s in _own_slots(state, m))
                             or any(b is not None and b.device.type == "meta"
                                    for b in m._buffers.values())}


def _lost_adapters(state: Offload, lost_ok: bool) -> set[int]:
    """Refuse adapters created on ``meta`` (PEFT wrapped a model built on meta): their initial
    values are lost, and the model's initialization is not theirs (a LoRA ``B`` starts at
    zero). ``lost_ok``: return their modules, left pending."""
    wrappers = [f"{n}." for n, m in state.model.named_modules()
                if isinstance(m._modules.get("base_layer"), nn.Module)]
    if not wrappers:
        return set()
    lost = []
    modules = set()
    for module in state.pending_modules.values():
        name = state.module_names.get(id(module), "")
        if any(name.startswith(w) and not name.startswith(f"{w}base_layer.") for w in wrappers):
            new = [f"{name}{a}" for a, s in _own_slots(state, module) if not s.binding.has_value]
            if new:
                lost += new
                modules.add(id(module))
    if lost and not lost_ok:
        raise RuntimeError(
            f"adapter parameters {lost[:4]}{' ...' if len(lost) > 4 else ''} ({len(lost)} in"
            " all) were created on the meta device (the model was wrapped while on meta), so"
            " their initial values are lost. For new adapters, call hr.init_adapters(model)"
            " (PEFT's own initialization), or wrap after hr.offload: hr.offload(model, ...),"
            " hr.load_weights(model, base), then peft.get_peft_model(model, config); to"
            " continue from saved adapters, load them"
            " first (peft.set_peft_model_state_dict or hr.load_weights(model, path))"
        )
    return modules


def _own_slots(state: Offload, module: nn.Module):
    for attr, t in module._parameters.items():
        slot = state.by_param.get(id(t)) or state.by_dev.get(id(t))
        if slot is not None:
            yield attr, slot


def _run_init(state: Offload, module: nn.Module, init: Callable[[], None], slots, buffers) -> None:
    """Run ``init`` on host tensors in place of ``module``'s parameters (a pending one's in the
    store's memory where it has some), store the pending ones, keep the filled buffers."""
    own = list(_own_slots(state, module))
    pending = {id(s) for _, s in slots}
    temps = {}
    in_place = {}  # pending values initialized in the store's own host memory: attr -> it
    for attr, s in own:
        h = s.binding.handle
        host = state.store.host_tensor(h) if id(s) in pending else None
        if host is not None:  # filled in the store (nothing reads it before has_value)
            t = _unset_into(host)
            in_place[attr] = host
        else:
            t = _unset(h.shape, h.dtype)
        temps[attr] = nn.Parameter(t, requires_grad=s.param.requires_grad)
    for name, b in buffers:
        module._buffers[name] = _unset(b.shape, b.dtype)
    try:
        for attr, t in temps.items():
            module._parameters[attr] = t
        init()
    finally:
        for attr, s in own:
            module._parameters[attr] = s.param
    # an initializer that does not know this module leaves the NaNs: refused, not stored
    left = [a for a, _ in slots if _still_unset(temps[a])]
    left += [n for n, _ in buffers if _still_unset(module._buffers[n])]
    if left:
        for name, b in buffers:
            module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="meta")
        prefix = state.module_names.get(id(module), "")
        raise RuntimeError(
            f"{', '.join(prefix + n for n in left)} were created on the meta device and"
            f" {type(module).__name__}'s initialization did not set them; load them with"
            " hr.load_weights(model, path) (or load_state_dict), or build that module on the CPU"
        )
    for attr, s in slots:
        h = s.binding.handle
        t = temps[attr].detach()
        # An initializer may rebind .data (e.g. to a tensor made in fp32): then written in.
        if attr not in in_place or t.data_ptr() != in_place[attr].data_ptr():
            state.store.write(h, t.to(h.dtype).contiguous()).result()
        s.binding.has_value = True
    for name, _ in buffers:
        module._buffers[name] = module._buffers[name].to(state.device)


def _unset(shape, dtype: torch.dtype) -> torch.Tensor:
    return _unset_into(torch.empty(shape, dtype=dtype))


def _unset_into(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan") if t.is_floating_point() or t.is_complex() else 0)


def _still_unset(t: torch.Tensor) -> bool:
    if not (t.is_floating_point() or t.is_complex()):
        return False
    t = t.detach()
    # a NaN makes the sum NaN (one read, no mask); a NaN sum without one (inf - inf) is rechecked
    return bool(torch.isnan(t.sum())) and bool(torch.isnan(t).any())
