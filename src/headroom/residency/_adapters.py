"""`init_adapters`: fresh adapters for a model that was wrapped while on ``meta``.

PEFT wraps a model built on ``meta`` with adapters that have no values (it draws them on the
CPU, then moves them to the base weight's device, ``meta``). Loading the base checkpoint with
`headroom.load_weights` fills the base; the adapters stay without values, and the first forward
refuses them (see `headroom.residency._meta`) rather than initialize them some other way. To
start a new run from such a model, `init_adapters` draws them with PEFT's own initializer, the
one ``get_peft_model`` would have run: LoRA's ``reset_lora_parameters`` with the adapter's
``init_lora_weights`` (``lora_A`` Kaiming-uniform or Gaussian, ``lora_B`` zero), on temporary
host tensors in place of the adapter's parameters, and writes the values into the store.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from headroom.residency._adopt import rescan
from headroom.residency._meta import _lost_adapters, _own_slots, _still_unset, _unset

__all__ = ["init_adapters"]


@torch.no_grad()
def init_adapters(model: nn.Module) -> list[str]:
    """Initialize adapters that were created while the model was on ``meta``, as PEFT does.

    For the flow "build on ``meta`` → ``peft.get_peft_model`` → `headroom.offload` →
    `headroom.load_weights` (the base checkpoint)" when no saved adapters exist yet (a new LoRA
    run). Each adapter without values is drawn by PEFT's own initializer for the layer
    (``reset_lora_parameters`` with the adapter config's ``init_lora_weights``: Kaiming-uniform
    ``lora_A`` and zero ``lora_B`` by default; ``"gaussian"``; ``False``: the layers' own
    ``reset_parameters``), from torch's global random generator, layer by layer in the model's
    order, and written into the store. Adapters that have values (loaded, or created after
    `headroom.offload`) and the base are left as they are.

    Args:
        model: the offloaded model, or a module containing it (the ``PeftModel``). Not during
            its forward or backward.

    Returns:
        The names of the parameters it initialized (empty when none lacked values).

    Raises:
        RuntimeError: the model is not offloaded, or is in a forward or backward; an adapter
            type or ``init_lora_weights`` (PiSSA, OLoRA, DoRA's magnitude, ... which read the
            base weights) it cannot initialize (named, with the alternatives).

    Example:
        >>> with torch.device("meta"):                                     # doctest: +SKIP
        ...     model = peft.get_peft_model(AutoModelForCausalLM.from_config(cfg), lora)
        >>> hr.offload(model, device="cuda", store=hr.DiskStore("/scratch/w"))  # doctest: +SKIP
        >>> hr.load_weights(model, "path/to/base")                         # doctest: +SKIP
        >>> hr.init_adapters(model)                                        # doctest: +SKIP
    """
    from headroom.residency._offload import _ATTR

    states = list({id(s): s for m in model.modules()
                   if (s := getattr(m, _ATTR, None)) is not None}.values())
    if not states:
        raise RuntimeError(
            "hr.init_adapters: the model is not offloaded; PEFT initializes the adapters of a"
            " model that is not (call hr.offload(model, ...) first)")
    configs = _configs(model)
    done: list[str] = []
    for state in states:
        if state.busy:
            raise RuntimeError("hr.init_adapters during the model's forward or backward; call it"
                               " between steps")
        rescan(state)
        lost = _lost_adapters(state, lost_ok=True)
        if not lost:
            continue
        # every initializer is found before any runs: a refusal leaves nothing half done
        todo = [(modules, _initializer(wrapper, adapter, modules, configs.get(adapter),
                                       f"{wname}." if wname else ""))
                for wname, wrapper in state.model.named_modules()
                if isinstance(wrapper._modules.get("base_layer"), nn.Module)
                for adapter, modules in _lost_of(state, wrapper, lost).items()]
        for modules, init in todo:
            done += _run(state, modules, init)
        state.pending_modules = {
            k: m for k, m in state.pending_modules.items()
            if any(not s.binding.has_value for _, s in _own_slots(state, m))
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
    """Adapter name -> the modules holding its parameters that have no values, in ``wrapper``
    (its ``ModuleDict`` entries such as ``lora_A[name]``; ``ParameterDict`` s keyed by name)."""
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
            for attr, s in _own_slots(state, child):
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
    """Run ``init`` on temporary host tensors in place of ``modules``' parameters; store those
    that had no values."""
    own = [(m, a, s) for m in modules for a, s in _own_slots(state, m)]
    temps = {id(s): nn.Parameter(_unset(s.binding.handle.shape, s.binding.handle.dtype),
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
    left = [n for n, (_, _, s) in zip(names, pending, strict=True) if _still_unset(temps[id(s)])]
    if left:
        raise RuntimeError(
            f"hr.init_adapters: PEFT's initializer did not set {', '.join(left)}; nothing was"
            " written for them. Load saved adapters (peft.set_peft_model_state_dict)")
    for _, _, s in pending:
        h = s.binding.handle
        state.store.write(h, temps[id(s)].detach().to(h.dtype).contiguous()).result()
        s.binding.has_value = True
    return names
