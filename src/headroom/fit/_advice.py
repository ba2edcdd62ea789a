"""What would cut the peak most: figures from dry runs of the step with each technique.

Used at the end of `Estimate.report()` and of the tracker's report (and so of ``headroom
profile``). Every figure is an estimate of the step with one technique turned on, against the
same step without it; nothing is a rule of thumb.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from headroom.activations import DEFAULT_MIN_BYTES as _ACTIVATION_MIN_BYTES
from headroom.fit._estimate import Estimate, estimate
from headroom.memory import format_bytes


def advise(model: nn.Module, args: tuple, *, kwargs: dict[str, Any] | None = None,
           loss_fn: Any = None, optimizer: Any = None, optimizer_kwargs: dict | None = None,
           device: str, base: Estimate | None = None,
           measured: int | None = None, resting_activations: int = 0) -> list[str]:
    """Lines of advice for one step of ``model`` on ``device``, largest saving first.

    ``resting_activations``: bytes of activations the measured run kept in stores at most
    (activation offload was on there); the figures are then for the step without it, and
    activation offload is reported as on rather than offered.
    """
    common = dict(loss_fn=loss_fn, device=device, example_kwargs=kwargs)
    if base is None:
        base = estimate(model, args, optimizer=optimizer, optimizer_kwargs=optimizer_kwargs,
                        **common)
    peak = base.peak
    if peak <= 0:
        return []
    blocks = _block_names(model)
    savings: list[tuple[int, str]] = []

    def saving(label: str, **what_if: Any) -> None:
        what_if.setdefault("optimizer", optimizer)
        what_if.setdefault("optimizer_kwargs", optimizer_kwargs)
        est = estimate(model, args, **common, **what_if)
        savings.append((peak - est.peak, label))

    if not resting_activations:
        saving(f"activation offload (hr.offload_activations, min_bytes"
               f"={format_bytes(_ACTIVATION_MIN_BYTES)})",
               offload_activations=_ACTIVATION_MIN_BYTES)
    if blocks:
        saving(f"checkpointing the {len(blocks)} blocks ({_pattern(blocks)})", checkpoint=blocks)

    from headroom.nn import convert

    saving("hr.convert", prepare=lambda m: convert(m, inplace=True))
    lm_patch = _lm_patch_saving(model, args, common, optimizer, optimizer_kwargs, peak)
    if lm_patch is not None:
        savings.append(lm_patch)
    cpu = base.device == "cpu"
    opt_cls = _opt_cls(optimizer)  # None for an hr.HostOptimizer's options: in use already
    from headroom.residency import offload_states

    offloaded = bool(offload_states(model))
    if opt_cls is not None:
        from headroom.optim import HostOptimizerOptions

        where = "disk" if cpu else "host"
        kw = dict(optimizer_kwargs or {})
        largest = max((p.numel() * p.element_size() for p in model.parameters()), default=0)
        host = HostOptimizerOptions(opt_cls, kw, "disk" if cpu else "cpu", False,
                                    max(4 << 10, min(16 << 20, largest // 8)), 32 << 20)
        saving(f"hr.HostOptimizer (state on {where})", optimizer=host, optimizer_kwargs=None)
        if not offloaded:
            saving(f"hr.offload with hr.HostOptimizer ({where})", optimizer=host,
                   optimizer_kwargs=None, offload={"store": where, "prefetch": 1})
    cats = base.peak_by_category
    lines = ["what would cut the peak most (dry runs of the step with each technique):"]
    if measured is not None:
        lines.append(
            f"  a steady-state step (optimizer state created, {base.device}) is estimated at"
            f" {format_bytes(peak)}; this run measured {format_bytes(measured)}")
    if resting_activations:
        lines.append(
            f"  activation offload is on in this run ({format_bytes(resting_activations)} of"
            " activations rested in stores at most): the figures here are for the step"
            " without it")
    logits = _largest_logits(model, args, kwargs, device)
    top = max(cats.items(), key=lambda kv: kv[1])
    share = f"{top[0]} are {100 * top[1] / peak:.0f}% of the peak"
    if top[0] == "activations" and blocks and base.by_module:
        in_blocks = sum(v for k, v in base.by_module.items()
                        if any(k == b or k.startswith(b + ".") for b in blocks))
        share += f", {100 * in_blocks / peak:.0f}% in {_pattern(blocks)}"
    share += f" ({format_bytes(top[1])} of {format_bytes(peak)})"
    if top[0] == "other":
        share += ": " + _other_parts(top[1], logits)
    lines.append(f"  {share}")
    for amount, label in sorted(savings, key=lambda s: -s[0]):
        if amount > 0:
            lines.append(f"  {label}: saves about {format_bytes(amount)}"
                         f" ({100 * amount / peak:.0f}%)")
        else:
            lines.append(f"  {label}: saves nothing here")
    line = _logits_line(logits, peak, patch=lm_patch is not None)
    if line:
        lines.append(line)
    if cpu:
        lines.append("  (on cpu, only stores on disk free memory: host memory is the device's)")
    return lines


# A classifier head is worth a line when its output has at least this many classes and it and
# its gradient are at least this share of the peak.
_HEAD_MIN_CLASSES = 1024
_HEAD_MIN_SHARE = 0.2


def _other_parts(other: int, logits: tuple[int, str, tuple[int, ...]] | None) -> str:
    """What "other" holds: the logits and their gradient when a wide head made them, the rest
    inputs, outputs and temporaries of single ops (a softmax's result, a cast)."""
    rest = "inputs, outputs and temporaries of single ops (a softmax's result, a cast)"
    if logits is None:
        return rest
    nbytes, name, _ = logits
    both = min(other, 2 * nbytes)
    if other - both < other // 20:
        return f"the logits of {name} and their gradient"
    return (f"the logits of {name} and their gradient, about {format_bytes(both)}; the rest"
            f" ({format_bytes(other - both)}) {rest}")


def _logits_line(logits: tuple[int, str, tuple[int, ...]] | None, peak: int, *,
                 patch: bool = False) -> str | None:
    """A line naming the largest output of a wide ``nn.Linear`` (a language model's logits, a
    classifier over many classes) when it and its gradient are a large share of the peak:
    `hr.patch_causal_lm` (when its line is above) or `hr.linear_cross_entropy` never
    materializes them."""
    if logits is None:
        return None
    nbytes, name, shape = logits
    if 2 * nbytes < _HEAD_MIN_SHARE * peak:
        return None
    dims = " x ".join(str(d) for d in shape)
    head = (f"  the logits of {name} ({dims}, {format_bytes(nbytes)}) and their gradient are"
            f" about {min(100, 200 * nbytes // peak)}% of the peak")
    if patch:
        return (f"{head}: hr.patch_causal_lm(model) (above) computes the model's loss without"
                " ever holding them")
    return (f"{head}, and no technique above removes them: hr.linear_cross_entropy(hidden,"
            f" {name}.weight, labels) computes the same loss without ever holding them")


def _lm_patch_saving(model: nn.Module, args: tuple, common: dict[str, Any], optimizer: Any,
                     optimizer_kwargs: dict | None, peak: int) -> tuple[int, str] | None:
    """The saving of `hr.patch_causal_lm` (a dry run with it) for a causal LM whose step
    computes its loss from labels; ``None`` where the patch does not apply."""
    from headroom.fit._lm import lm_patch_refusal, lm_patching

    if lm_patch_refusal(model) is not None:
        return None
    patched: list[bool] = []
    try:
        est = estimate(model, args, optimizer=optimizer, optimizer_kwargs=optimizer_kwargs,
                       prepare=lm_patching(patched), **common)
    except Exception:  # the step reads the logits (a loss_fn of its own): not for it
        return None
    if not any(patched):
        return None
    return (peak - est.peak,
            "hr.patch_causal_lm(model) (the model's loss from its hidden states, without its"
            " logits)")


def _largest_logits(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None,
                    device: str) -> tuple[int, str, tuple[int, ...]] | None:
    """Bytes, module name and shape of the largest output of an ``nn.Linear`` with at least
    `_HEAD_MIN_CLASSES` outputs in a forward on ``meta``, or ``None``."""
    from headroom.fit._dryrun import AttentionAsOnDevice, RealTensorsAsMeta, meta_copy, to_meta

    meta = meta_copy(model)
    names = {id(m): n for n, m in meta.named_modules()}
    seen: list[tuple[int, str, tuple[int, ...]]] = []

    def hook(mod: nn.Module, _inp: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and mod.out_features >= _HEAD_MIN_CLASSES:
            seen.append((out.numel() * out.element_size(), names.get(id(mod), "?"),
                         tuple(out.shape)))

    handles = [m.register_forward_hook(hook) for m in meta.modules() if isinstance(m, nn.Linear)]
    try:
        args, kwargs = to_meta((args, dict(kwargs or {})))
        with torch.no_grad(), AttentionAsOnDevice(torch.device(device).type), \
                RealTensorsAsMeta():
            meta(*args, **kwargs)
    except Exception:  # advice never breaks a report
        return None
    finally:
        for h in handles:
            h.remove()
    return max(seen) if seen else None


def _opt_cls(optimizer: Any) -> type[torch.optim.Optimizer] | None:
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer)
    return None


def _block_names(model: nn.Module) -> list[str]:
    from headroom.residency import find_blocks

    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(b)] for b in find_blocks(model) if id(b) in names]


def _pattern(names: list[str]) -> str:
    """``["layers.0", "layers.1"]`` -> ``"layers.*"``."""
    parents = {n.rpartition(".")[0] for n in names}
    if len(parents) == 1:
        parent = parents.pop()
        return f"{parent}.*" if parent else f"{names[0]} to {names[-1]}"
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
