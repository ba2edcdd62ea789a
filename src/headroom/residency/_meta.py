"""Parameters and buffers of an offloaded model that were created on ``meta``: values on demand.

A model built on the ``meta`` device has shapes but no values. `hr.offload` gives each such
parameter room in the store and marks it *pending*; the values come either from
`headroom.load_weights` / ``load_state_dict`` / `headroom.load` (which write them and clear the
mark), or, for whatever is still pending when a value is first needed (the first forward,
``state_dict()``, `headroom.save`, `headroom.unoffload`), from the model's own initialization,
module by module in registration order: the module's ``reset_parameters()``, or a Hugging Face
model's ``_init_weights(module)``. So a model built on ``meta`` and loaded from a checkpoint is
never initialized at random first, and one that is not loaded is initialized as the model
initializes itself: for modules whose constructor calls ``reset_parameters()`` the values a CPU
build gets (when nothing else drew random numbers in between); a Hugging Face model built on the
CPU draws twice (each layer's constructor, then ``_init_weights``), so its values differ from
the meta-built one's, from the same distributions.

Buffers created on ``meta`` (e.g. a rotary embedding's ``inv_freq``) are filled the same way, on
the compute device.
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
    """Give every pending parameter and buffer of ``state``'s model its initial value.

    Raises:
        RuntimeError: some have no way to be initialized (their module has no
            ``reset_parameters()`` and the model no ``_init_weights``); names them and the fix.
    """
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
    """Forget the modules with nothing pending any more (loaded, or taken out of the model):
    the list holds them strongly."""
    state.pending_modules = {k: m for k, m in state.pending_modules.items()
                             if any(not s.binding.has_value for _, s in _own_slots(state, m))
                             or any(b is not None and b.device.type == "meta"
                                    for b in m._buffers.values())}


def _lost_adapters(state: Offload, lost_ok: bool) -> set[int]:
    """Adapters created on ``meta`` (PEFT wrapped a model built on meta: it initialized them on
    the CPU, then moved them to the base weight's device) have lost their initial values, and
    the model's own initialization is not theirs (a LoRA ``B`` starts at zero). Refuse rather
    than initialize them some other way; ``lost_ok``: return their modules, left pending."""
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
    """Run ``init`` on host tensors in place of ``module``'s own parameters (a pending one's in
    the store's own memory where the store has it, else a temporary); store the pending ones;
    keep the buffers it filled, on the compute device."""
    own = list(_own_slots(state, module))
    pending = {id(s) for _, s in slots}
    temps = {}
    in_place = {}  # pending values initialized in the store's own host memory: attr -> it
    for attr, s in own:
        h = s.binding.handle
        host = state.store.host_tensor(h) if id(s) in pending else None
        if host is not None:
            # No temporary and no copy into the store: the store's memory is the tensor the
            # initializer fills (nothing reads it before has_value is set).
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
    # An initializer that does not know this module (a Hugging Face _init_weights for a
    # custom layer) leaves the NaNs in place: report it rather than store garbage.
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
    # A NaN anywhere makes the sum NaN: one read, no mask. A NaN sum without one (inf - inf)
    # falls back to the element-wise check.
    return bool(torch.isnan(t.sum())) and bool(torch.isnan(t).any())
