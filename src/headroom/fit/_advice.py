"""What would cut the peak most: figures from dry runs of the step with each technique, ending
`Estimate.report()` and the tracker's report. Nothing is a rule of thumb.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from headroom.activations import DEFAULT_MIN_BYTES as _ACTIVATION_MIN_BYTES
from headroom.fit._dryrun import block_names
from headroom.fit._estimate import Estimate, estimate
from headroom.memory import format_bytes


def advise(model: nn.Module, args: tuple, *, kwargs: dict[str, Any] | None = None,
           loss_fn: Any = None, optimizer: Any = None, optimizer_kwargs: dict | None = None,
           device: str, base: Estimate | None = None,
           measured: int | None = None, resting_activations: int = 0,
           autocast: torch.dtype | None = None) -> list[str]:
    """Lines of advice for one step of ``model`` on ``device``, largest saving first: each
    technique's saving from a dry run with it, its relative step time (`headroom.fit._time`)
    and whether results stay bitwise, equal to rounding, or change.

    ``resting_activations`` (activations the measured run kept in stores) and ``autocast``
    (the measured forward's region) report those techniques as on rather than offer them.
    """
    common = dict(loss_fn=loss_fn, device=device, example_kwargs=kwargs, autocast=autocast,
                  optimizer=optimizer, optimizer_kwargs=optimizer_kwargs)
    if base is None:
        base = estimate(model, args, **common)
    peak = base.peak
    if peak <= 0:
        return []
    from headroom.fit._lm import lm_patch_run

    blocks = block_names(model)
    timing = _timing(base)
    lm_patch = lm_patch_run(model, lambda prepare: estimate(model, args, prepare=prepare,
                                                            **common))[0]
    options: list[_Option] = []
    failed: list[str] = []
    for o in _options(model, args, kwargs, base, blocks, optimizer, optimizer_kwargs,
                      lm_patch=lm_patch, resting=bool(resting_activations), autocast=autocast):
        try:
            est = o.est if o.est is not None else estimate(model, args, **{**common, **o.what_if})
        except Exception as e:  # one technique the step cannot take is one line, not all
            first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            failed.append(f"  {o.label}: not estimated ({type(e).__name__}: {first}){o.hint}")
            continue
        o.saving = peak - est.peak
        o.time = None if o.untimed else timing(est, host_step=o.host_step)
        options.append(o)
    _merge_half(options)
    lines = ["what would cut the peak most (a dry run of the step with each technique;"
             " largest saving first):"]
    if measured is not None:
        lines.append(
            f"  a steady-state step (optimizer state created, {base.device}) is estimated at"
            f" {format_bytes(peak)}; this run measured {format_bytes(measured)}")
    if autocast is not None:
        name = _HALF_NAMES.get(autocast, autocast)
        lines.append(f"  autocast in {name} is on in this run: every dry run here runs in it")
    if resting_activations:
        lines.append(
            f"  activation offload is on in this run ({format_bytes(resting_activations)} of"
            " activations rested in stores at most): the figures here are for the step"
            " without it")
    logits = _largest_logits(model, args, kwargs, device)
    lines.append("  " + _largest_share(base, blocks, logits))
    ranked = sorted(options, key=lambda o: -o.saving)
    for n, o in enumerate((o for o in ranked if o.saving > 0), 1):
        lines.append(f"  {n}. {o.label}: saves about {format_bytes(o.saving)}"
                     f" ({100 * o.saving / peak:.0f}%); {o.cost()}")
    nothing = [o.label for o in ranked if o.saving <= 0]
    if nothing:
        lines.append("  saves nothing here: " + "; ".join(nothing))
    lines.extend(failed)
    line = _logits_line(logits, peak, patch=lm_patch is not None)
    if line:
        lines.append(line)
    if base.device == "cpu":
        lines.append("  (on cpu, only stores on disk free memory: host memory is the device's)")
    return lines


def _options(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None, base: Estimate,
             blocks: list[str], optimizer: Any, optimizer_kwargs: dict | None, *,
             lm_patch: Estimate | None, resting: bool, autocast: torch.dtype | None
             ) -> Iterator[_Option]:
    """The techniques to advise, in the order of their lines for equal savings."""
    from headroom.nn import convert

    if not resting:
        yield _Option(f"activation offload (hr.offload_activations, min_bytes"
                      f"={format_bytes(_ACTIVATION_MIN_BYTES)})", _BITWISE,
                      {"offload_activations": _ACTIVATION_MIN_BYTES})
    if blocks:
        yield _Option(f"checkpointing the {len(blocks)} blocks ({_names(blocks)})",
                      _BITWISE + " (the blocks' forward runs again in backward)",
                      {"checkpoint": blocks})
    yield _Option("hr.convert", _BITWISE, {"prepare": lambda m: convert(m, inplace=True)})
    if lm_patch is not None:
        yield _Option("hr.patch_causal_lm(model) (the model's loss from its hidden states,"
                      " without its logits)", "equal to rounding (the loss in fp32 slices)", {},
                      est=lm_patch)
    yield from _classic(model, args, kwargs, base, autocast=autocast)
    yield from _optimizers(model, optimizer, optimizer_kwargs, cpu=base.device == "cpu")


_BITWISE = "bitwise the same results"
_HALF_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_HALF_TIME = ("step time not modeled (half-precision matmuls are faster on GPUs with tensor"
              " cores, often slower on CPUs)")


@dataclass(eq=False)
class _Option:
    """A technique to advise: a dry run of the step with ``what_if`` (`hr.estimate`'s options),
    or ``est`` made already, then the peak it saves and its step time over the plain step's."""

    label: str
    exact: str
    what_if: dict[str, Any]
    untimed: str | None = None  # what to say in place of the time model's figure
    host_step: bool = False
    hint: str = ""  # after the line of a dry run that fails
    est: Estimate | None = None
    saving: int = 0
    time: float | None = None

    def cost(self) -> str:
        if self.time is None:
            return f"{self.untimed or 'step time not modeled'}; {self.exact}"
        change = self.time - 1
        if abs(change) < 0.005:
            when = "about the same step time"
        else:
            when = f"step time {'+' if change > 0 else '-'}{100 * abs(change):.0f}%"
        return f"{when} (time model); {self.exact}"


def _timing(base: Estimate) -> Callable[..., float | None]:
    """A dry run's step time relative to the plain step's, at the device's default speeds."""
    from headroom.fit._time import default_speeds, dry_run_time

    cpu = base.device == "cpu"

    def seconds(est: Estimate, *, host_step: bool) -> float:
        # on a CPU only a disk frees memory
        return dry_run_time(est, speeds, activations="disk" if cpu else "host", on_cpu=cpu,
                            host_step=host_step)

    try:
        speeds = default_speeds(base.device)
        plain = seconds(base, host_step=False)
    except Exception:  # no speeds, no times: the savings still stand
        plain = 0
    return lambda est, *, host_step: seconds(est, host_step=host_step) / plain if plain else None


def _classic(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None, base: Estimate, *,
             autocast: torch.dtype | None) -> Iterator[_Option]:
    """Mixed precision (bf16, fp16) unless on already, gradient accumulation over 2 and 4."""
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if torch.float32 in floats and autocast is None:
        dev = base.device.split(":")[0]
        for dtype, name, extra in (
                (torch.bfloat16, "bf16", ""),
                (torch.float16, "fp16", "; fp16 also needs torch.amp.GradScaler")):
            yield _Option(f"mixed precision: autocast in {name} (torch.autocast({dev!r},"
                          f" dtype={dtype}))", f"different numerics (matmuls in {name}){extra}",
                          {"autocast": dtype}, untimed=_HALF_TIME)
    from headroom.fit._estimate import _batch_size

    batch = _batch_size(args, kwargs)
    norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
               for m in model.modules())
    exact = ("different numerics (batch norm statistics over each micro-batch)" if norm else
             "equal to rounding (the gradients summed over micro-batches)")
    for k in (2, 4):
        if batch is not None and batch >= k:
            yield _Option(f"gradient accumulation over {k} micro-batches (batch {batch} ->"
                          f" {-(-batch // k)})", exact, {"micro_batches": k},
                          hint="; a loss_fn that reads tensors of the whole batch (labels"
                               " it closes over) cannot take a micro-batch: pass them to the"
                               " model as inputs")


def _optimizers(model: nn.Module, optimizer: Any, optimizer_kwargs: dict | None, *, cpu: bool
                ) -> Iterator[_Option]:
    """`hr.HostOptimizer`, with `hr.offload` unless on already, and a smaller optimizer."""
    opt_cls = _opt_cls(optimizer)  # None for an hr.HostOptimizer's options: in use already
    if opt_cls is None:
        return
    from headroom.optim import HostOptimizerOptions
    from headroom.residency import offload_states

    where = "disk" if cpu else "host"
    largest = max((p.numel() * p.element_size() for p in model.parameters()), default=0)
    host = {"optimizer": HostOptimizerOptions(
        opt_cls, dict(optimizer_kwargs or {}), "disk" if cpu else "cpu", False,
        max(4 << 10, min(16 << 20, largest // 8)), 32 << 20), "optimizer_kwargs": None}
    yield _Option(f"hr.HostOptimizer (state on {where})", _BITWISE + " (the same optimizer)", host,
                  host_step=not cpu)
    if not offload_states(model):
        yield _Option(f"hr.offload with hr.HostOptimizer ({where})", _BITWISE,
                      {**host, "offload": {"store": where, "prefetch": 1}}, host_step=not cpu)
    smaller = _smaller_optimizer(opt_cls)
    if smaller is not None:
        yield _Option(f"{smaller[0]} instead of {opt_cls.__name__}",
                      "different training (another optimizer: tune it again)",
                      {"optimizer": smaller[1], "optimizer_kwargs": smaller[2]})


def _merge_half(options: list[_Option]) -> None:
    """One line for autocast in bf16 and in fp16 when they save the same."""
    half = [o for o in options if o.label.startswith("mixed precision")]
    if len(half) != 2 or half[0].saving != half[1].saving:
        return
    bf16, fp16 = half
    dev = bf16.label.split("torch.autocast(")[1].split(",")[0]
    options.remove(fp16)
    bf16.label = (f"mixed precision: autocast in bf16 or fp16 (torch.autocast({dev},"
                  " dtype=torch.bfloat16 or torch.float16))")
    bf16.exact = fp16.exact.replace("matmuls in fp16", "matmuls in bf16 or fp16")


def _smaller_optimizer(opt_cls: type) -> tuple[str, Any, dict[str, Any]] | None:
    """``torch.optim.Adafactor`` (factored second moments) for Adam/AdamW, else ``None``."""
    if not issubclass(opt_cls, (torch.optim.Adam, torch.optim.AdamW)):
        return None

    class Adafactor(torch.optim.Adafactor):
        """Adafactor on ``meta``: the norms it reads (``.item()``) set only its step size."""

        def step(self, closure: Any = None) -> Any:
            with _ScalarsOfMeta():
                return super().step(closure)

    return "torch.optim.Adafactor", Adafactor, {}


class _ScalarsOfMeta(TorchFunctionMode):
    """``Tensor.item()`` of a ``meta`` tensor is 1.0."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.item and args[0].device.type == "meta":
            return 1.0
        return func(*args, **(kwargs or {}))


def _largest_share(base: Estimate, blocks: list[str],
                   logits: tuple[int, str, tuple[int, ...]] | None) -> str:
    """The category largest at the peak, in a sentence."""
    peak = base.peak
    cat, nbytes = max(base.peak_by_category.items(), key=lambda kv: kv[1])
    what = _CATEGORY_WORDS.get(cat, cat)
    text = (f"the largest part of the peak is {what}, {format_bytes(nbytes)} of"
            f" {format_bytes(peak)} ({100 * nbytes / peak:.0f}%)")
    if cat == "activations" and blocks and base.by_module:
        in_blocks = sum(v for k, v in base.by_module.items()
                        if any(k == b or k.startswith(b + ".") for b in blocks))
        text += (f"; the {len(blocks)} blocks ({_names(blocks)}) hold"
                 f" {format_bytes(in_blocks)} of them")
    if cat == "other":
        text += ": " + _other_parts(nbytes, logits)
    return text


_CATEGORY_WORDS = {
    "activations": "activations (saved for backward)",
    "optimizer_state": "optimizer state",
    "other": "other tensors",
}


# a head worth a line: at least this many classes, logits and gradient this share of the peak
_HEAD_MIN_CLASSES = 1024
_HEAD_MIN_SHARE = 0.2


def _other_parts(other: int, logits: tuple[int, str, tuple[int, ...]] | None) -> str:
    """What "other" holds: the logits of a wide head and their gradient, and single ops'."""
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
    """A line naming a wide ``nn.Linear``'s logits when they and their gradient are a large
    share of the peak, and what never holds them."""
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


def _largest_logits(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None,
                    device: str) -> tuple[int, str, tuple[int, ...]] | None:
    """``(bytes, name, shape)`` of the largest output of a wide ``nn.Linear``, or ``None``."""
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


def _names(names: list[str]) -> str:
    """``"layers.0 to layers.5"`` for numbered children in a row, else the first four names."""
    parents = {n.rpartition(".")[0] for n in names}
    last = [n.rpartition(".")[2] for n in names]
    if len(parents) == 1 and len(names) > 2 and all(x.isdigit() for x in last) and \
            [int(x) for x in last] == list(range(int(last[0]), int(last[0]) + len(names))):
        return f"{names[0]} to {names[-1]}"
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
