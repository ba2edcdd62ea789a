"""`plan`: the fastest combination of headroom's techniques whose estimated peak fits a budget.

The search runs a few dry runs (`headroom.memory.estimate`) for what changes the activations
(``hr.convert``, non-reentrant checkpointing of the first k of the model's blocks) and derives
the rest from their timelines: where parameters, gradients or optimizer state leave the device,
their bytes at every moment of the step are replaced by what stays (see `_Candidate.peak`).
Those replacements are upper bounds (the most a technique keeps in flight), so an applied plan
measures at most its estimate. Each candidate gets a step time from `headroom.planner._time`; the
fastest one that fits wins, ties going to the one with the lower peak.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headroom.memory import _dryrun
from headroom.memory._categories import CATEGORIES, format_bytes
from headroom.memory._estimate import Estimate, estimate
from headroom.planner._time import Speeds, count_flops, default_speeds

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(value: int | float | str) -> int:
    """``"8GiB"`` -> ``8589934592``; ``"1.5 GB"`` -> ``1500000000``; ints pass through."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"a byte budget must be positive, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read {value!r} as a number of bytes; write e.g. 8589934592, \"8GiB\","
            " \"512MiB\" or \"8GB\""
        )
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"a byte budget must be positive, got {value!r}")
    return n


class PlanError(ValueError):
    """No combination of techniques fits the budget; ``smallest`` is the lowest peak found."""

    def __init__(self, message: str, smallest: int) -> None:
        super().__init__(message)
        self.smallest = smallest


@dataclass(frozen=True)
class Choice:
    """One combination of techniques.

    Attributes:
        convert: swap layers for ``headroom.nn`` ones (`hr.convert`).
        checkpoint: qualified names of the blocks run under non-reentrant checkpointing.
        params: where parameters rest between uses: ``"device"``, ``"host"`` or ``"disk"``
            (`hr.offload` with ``prefetch=1``).
        optimizer_state: ``"device"`` (the optimizer itself), ``"host"`` or ``"disk"``
            (`hr.HostOptimizer`).
    """

    convert: bool = False
    checkpoint: tuple[str, ...] = ()
    params: str = "device"
    optimizer_state: str = "device"

    def describe(self) -> list[str]:
        out = []
        if self.convert:
            out.append("hr.convert (layers that save only what backward needs)")
        if self.checkpoint:
            out.append(f"checkpointing of {len(self.checkpoint)} block(s):"
                       f" {_names(self.checkpoint)}")
        if self.params != "device":
            out.append(f"parameter offload to {self.params} (hr.offload, prefetch=1)")
        if self.optimizer_state != "device":
            out.append(f"optimizer state and step on {self.optimizer_state} (hr.HostOptimizer)")
        return out or ["nothing: the plain step fits"]


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]} ... {names[-1]}"


@dataclass
class Plan:
    """What `plan` chose: the techniques, the estimated peak and step time, and `apply`.

    Attributes:
        choice: the techniques (a `Choice`).
        peak: estimated peak bytes on the device with them (an upper bound for offloaded
            parts).
        time_s: estimated seconds per step (see `headroom.planner._time`).
        plain_peak, plain_time_s: the same for the plain step.
        budget: the budget asked for.
        device: the device planned for.
        candidates: every combination considered: ``(choice, peak, time_s)``.
    """

    choice: Choice
    peak: int
    time_s: float
    plain_peak: int
    plain_time_s: float
    budget: int
    device: str
    optimizer: Any
    optimizer_kwargs: dict[str, Any]
    disk: str | None
    slice_bytes: int
    peak_by_category: dict[str, int] = field(default_factory=dict)
    candidates: list[tuple[Choice, int, float]] = field(default_factory=list, repr=False)

    def __str__(self) -> str:
        lines = [
            f"headroom plan for {self.device}: budget {format_bytes(self.budget)}, plain step"
            f" {format_bytes(self.plain_peak)} / {_seconds(self.plain_time_s)} (estimated)",
            f"chosen: estimated peak {format_bytes(self.peak)}, step {_seconds(self.time_s)}",
        ]
        lines += [f"  - {d}" for d in self.choice.describe()]
        if self.peak_by_category:
            lines.append("  at the estimated peak: " + ", ".join(
                f"{c} {format_bytes(v)}" for c, v in self.peak_by_category.items() if v))
        lines.append(f"({len(self.candidates)} combinations considered)")
        return "\n".join(lines)

    def code(self, model_name: str = "model") -> str:
        """Python that applies the plan by hand, the same as :meth:`apply`."""
        c, lines = self.choice, ["import torch", "import headroom as hr"]
        opt = _opt_name(self.optimizer)
        if c.convert:
            lines.append(f"{model_name} = hr.convert({model_name})")
        if c.checkpoint:
            lines.append("from functools import partial")
            lines.append("from torch.utils.checkpoint import checkpoint")
            lines.append(f"for name in {list(c.checkpoint)!r}:")
            lines.append(f"    block = {model_name}.get_submodule(name)")
            lines.append("    block.forward = partial(checkpoint, block.forward,"
                         " use_reentrant=False)")
        if c.params != "device":
            store = "\"cpu\"" if c.params == "host" else f"hr.DiskStore({self._disk('params')!r})"
            lines.append(f"hr.offload({model_name}, device={self.device!r}, store={store},"
                         " prefetch=1)")
        elif self.device != "cpu":
            lines.append(f"{model_name}.to({self.device!r})")
        kw = "".join(f", {k}={v!r}" for k, v in self._host_kwargs().items())
        if c.optimizer_state != "device":
            store = ("\"cpu\"" if c.optimizer_state == "host"
                     else f"hr.DiskStore({self._disk('optimizer')!r})")
            lines.append(f"opt = hr.HostOptimizer({model_name}.parameters(), {opt},"
                         f" state_store={store}, slice_bytes={self.slice_bytes}{kw})")
        else:
            kw = "".join(f", {k}={v!r}" for k, v in self.optimizer_kwargs.items())
            lines.append(f"opt = {opt}({model_name}.parameters(){kw})")
        return "\n".join(lines)

    def _host_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.optimizer_kwargs)
        if self.device == "cpu":
            # PyTorch's default CPU step is the single-tensor one: bitwise the plain run
            kwargs.setdefault("fused", False)
        return kwargs

    def _disk(self, sub: str) -> str:
        if self.disk is None:  # pragma: no cover - disk choices need disk=
            raise ValueError("this plan needs disk=")
        return str(Path(self.disk) / sub)

    def apply(self, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Apply the plan to ``model`` (the one planned for) and build its optimizer.

        Returns:
            ``(model, optimizer)``: the model to train (a new module tree sharing the
            parameters when ``hr.convert`` is chosen, else ``model`` itself, changed in place)
            and the optimizer over its parameters.

        Raises:
            ValueError: if ``model`` lacks a block the plan checkpoints (not the model planned);
                checked before anything changes.

        The steps run in order (``hr.convert``, checkpointing, ``hr.offload``, the optimizer);
        if one raises (a full disk, a device that is missing), the ones before it stay applied:
        rebuild the model rather than retry on it.
        """
        from headroom.nn import convert
        from headroom.optim import HostOptimizer
        from headroom.residency import offload
        from headroom.transfer import DiskStore

        c = self.choice
        for name in c.checkpoint:
            try:
                model.get_submodule(name)
            except AttributeError:
                raise ValueError(
                    f"the plan checkpoints block {name!r}, which this model does not have: apply"
                    " a plan to the model it was made for"
                ) from None
        if c.convert:
            model = convert(model)
        _dryrun.checkpoint_modules(model, c.checkpoint)
        if c.params != "device":
            store = "cpu" if c.params == "host" else DiskStore(self._disk("params"))
            offload(model, device=self.device, store=store, prefetch=1)
        elif self.device != "cpu":
            model.to(self.device)
        cls = _opt_class(self.optimizer)
        if c.optimizer_state != "device":
            store = "cpu" if c.optimizer_state == "host" else DiskStore(self._disk("optimizer"))
            opt = HostOptimizer(model.parameters(), cls, state_store=store,
                                slice_bytes=self.slice_bytes, **self._host_kwargs())
        else:
            opt = cls(model.parameters(), **self.optimizer_kwargs)
        return model, opt


def _seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.0f} us"


def _opt_class(optimizer: Any) -> type[torch.optim.Optimizer]:
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer)
    raise TypeError(
        f"hr.plan needs optimizer= as a torch.optim.Optimizer class (e.g. torch.optim.AdamW),"
        f" got {optimizer!r}"
    )


def _opt_name(optimizer: Any) -> str:
    cls = _opt_class(optimizer)
    mod = cls.__module__
    if mod.startswith("torch.optim"):
        return f"torch.optim.{cls.__name__}"
    return f"{mod}.{cls.__name__}"


@dataclass
class _Run:
    """One dry run (a convert/checkpoint setting) and its per-sample category bytes."""

    est: Estimate
    samples: list[list[int]]
    in_step: list[bool]  # whether each sample is inside optimizer.step()


def plan(
    model: nn.Module,
    example_args: tuple | Any = (),
    *,
    budget: int | str,
    device: str | torch.device,
    optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    disk: str | os.PathLike | None = None,
    exact: bool = True,
    example_kwargs: dict[str, Any] | None = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    speeds: Speeds | None = None,
    slice_bytes: int | None = None,
) -> Plan:
    """Choose what to turn on so that one training step fits ``budget`` bytes on ``device``.

    Considers `hr.convert`, non-reentrant checkpointing of the first k of the model's blocks
    (k in quarters of the blocks), parameter offload (`hr.offload`, ``prefetch=1``) to host
    memory or ``disk``, and the optimizer's state and step on the host or on ``disk``
    (`hr.HostOptimizer`). Every combination gets an estimated peak (dry runs, see
    `hr.estimate`) and step time; the fastest one within the budget is returned. All of these
    techniques are exact: training with the plan gives bitwise the parameters of the plain
    step on the same device.

    Args:
        model: the model (parameters anywhere, ``meta`` included); not changed.
        example_args: one step's inputs (shapes and dtypes matter, values do not).
        budget: bytes the step may use on ``device``: an int or a string such as ``"8GiB"``.
            For CUDA-like devices the budget is compared with the caching allocator model's
            reserved bytes.
        device: the device to plan for.
        optimizer: the ``torch.optim.Optimizer`` class to train with.
        loss_fn: as for `hr.estimate`.
        disk: a folder for stores on disk; without it only host memory is used.
        exact: only exact techniques. ``False`` would also allow lower precision, which this
            version does not search yet (it plans as if ``True``).
        example_kwargs, optimizer_kwargs: as for `hr.estimate`.
        speeds: the time model's speeds (default: `headroom.planner._time.default_speeds`).
        slice_bytes: the host optimizer's slice size for state on disk; default: small enough
            that the slices in flight are a small part of the state.

    Returns:
        A `Plan`; ``print(plan)`` shows it, ``plan.apply(model)`` returns ``(model, optimizer)``.

    Raises:
        PlanError: (a ``ValueError``) no combination fits; the message gives the smallest peak
            found and what dominates it.
        ValueError: a budget that is not a byte count.

    ``model`` is never changed: every dry run uses a copy on ``meta``, so an error from one
    (a forward that needs values, a failing ``loss_fn``) leaves it as it was.

    Example:
        >>> plan = hr.plan(model, (x,), budget="8GiB", device="cuda",
        ...                optimizer=torch.optim.AdamW, disk="/scratch/run")
        >>> print(plan)
        >>> model, opt = plan.apply(model)
    """
    budget_b = parse_bytes(budget)
    opt_cls = _opt_class(optimizer)
    opt_kw = dict(optimizer_kwargs or {})
    kind = torch.device(device).type
    speeds = speeds or default_speeds(kind)
    on_cpu = kind == "cpu"

    from headroom.residency._blocks import find_blocks

    names = {id(m): n for n, m in model.named_modules()}
    blocks = [names[id(b)] for b in find_blocks(model) if id(b) in names]
    n = len(blocks)
    ks = sorted({0, *(math.ceil(n * q / 4) for q in (1, 2, 3, 4))}) if n else [0]

    def run(convert: bool, k: int) -> _Run:
        prepare = None
        if convert:
            from headroom.nn import convert as _convert

            def prepare(m: nn.Module) -> nn.Module:
                return _convert(m, inplace=True)
        est = estimate(model, example_args, loss_fn=loss_fn, optimizer=opt_cls,
                       device=device, example_kwargs=example_kwargs,
                       optimizer_kwargs=opt_kw, checkpoint=blocks[:k], prepare=prepare)
        samples = [[s.by_category[c] for c in CATEGORIES] for s in est.timeline]
        phases = [s.phase == "optimizer" for s in est.timeline]
        return _Run(est, samples, phases)

    plain = run(False, 0)
    flops = _flops(model, example_args, example_kwargs, loss_fn, device)
    runs = {(False, 0): plain}
    converted = run(True, 0)
    conv_options = [False] + ([True] if converted.est.peak < plain.est.peak else [])
    if True in conv_options:
        runs[(True, 0)] = converted
    for conv in conv_options:
        for k in ks:
            if (conv, k) not in runs:
                runs[(conv, k)] = run(conv, k)

    sizes = _sizes(model, device, opt_cls, opt_kw)
    if slice_bytes is None:
        slice_bytes = max(4 << 10, min(16 << 20, sizes.largest_param // 8))
    places = ["device"] + ([] if on_cpu else ["host"]) + (["disk"] if disk is not None else [])
    candidates: list[tuple[Choice, int, float, dict[str, int]]] = []
    for (conv, k), r in runs.items():
        for params, state in itertools.product(places, places):
            if params != "device" and state == "device":
                continue  # offloaded parameters are stepped through their store
            choice = Choice(conv, tuple(blocks[:k]), params, state)
            peak, at_peak = _peak(r, choice, sizes, slice_bytes)
            t = _time(choice, flops, k, n, sizes, speeds, on_cpu)
            candidates.append((choice, peak, t, at_peak))
    plain_time = _time(Choice(), flops, 0, n, sizes, speeds, on_cpu)
    fitting = [c for c in candidates if c[1] <= budget_b]
    if not fitting:
        best = min(candidates, key=lambda c: c[1])
        dominant = max(best[3].items(), key=lambda kv: kv[1])
        hint = "" if disk is not None else " Pass disk= (--disk) to allow stores on disk."
        raise PlanError(
            f"no combination of headroom's techniques fits {format_bytes(budget_b)} on"
            f" {device}: the smallest estimated peak is {format_bytes(best[1])} (with"
            f" {'; '.join(best[0].describe())}), of which {dominant[0]} take"
            f" {format_bytes(dominant[1])}.{hint} Use a smaller batch or sequence, or a larger"
            " budget.",
            best[1],
        )
    choice, peak, t, at_peak = min(fitting, key=lambda c: (round(c[2], 9), c[1]))
    return Plan(choice, peak, t, plain.est.peak_reserved, plain_time, budget_b,
                plain.est.device, opt_cls, opt_kw, None if disk is None else str(disk),
                slice_bytes, at_peak, [(c[0], c[1], c[2]) for c in candidates])


@dataclass(frozen=True)
class _Sizes:
    params: int
    largest_param: int
    state_keys: int
    largest_block: int
    offload_budget: int


def _sizes(model: nn.Module, device, opt_cls, opt_kw) -> _Sizes:
    from headroom.residency._plan import layout

    params = {id(p): p for p in model.parameters()}
    nbytes = [p.numel() * p.element_size() for p in params.values()]
    lay = layout(model, device=torch.device(device), blocks=None, prefetch=1, compute_dtype=None)
    probe = nn.Parameter(torch.zeros(2, 3))
    probe.grad = torch.zeros(2, 3)
    try:
        o = opt_cls([probe], **{k: v for k, v in opt_kw.items() if k != "fused"})
        o.step()
        keys = sum(1 for v in o.state[probe].values()
                   if isinstance(v, torch.Tensor) and v.shape == probe.shape)
    except Exception:
        keys = 2
    return _Sizes(sum(nbytes), max(nbytes, default=0), keys, lay.plan.largest_block_bytes,
                  lay.plan.device_budget)


def _peak(r: _Run, c: Choice, s: _Sizes, slice_bytes: int) -> tuple[int, dict[str, int]]:
    """The candidate's peak: the dry run's timeline with offloaded categories replaced by what
    stays on the device (an upper bound for each)."""
    p_, g_, o_, x_ = (CATEGORIES.index(c)
                      for c in ("parameters", "gradients", "optimizer_state", "other"))
    best, at = -1, [0] * len(CATEGORIES)
    for sample, in_step in zip(r.samples, r.in_step, strict=True):
        row = list(sample)
        if c.params != "device":
            # at most prefetch+1 blocks and the outside group; one block's gradients in flight
            row[p_] = min(row[p_], s.offload_budget)
            row[g_] = min(row[g_], s.largest_block)
            row[x_] += s.largest_block  # a block being read from or written to its store
        if c.optimizer_state != "device":
            if c.optimizer_state == "disk" or not _same_memory(r.est.device):
                # none outside the step; inside it, the slices in flight: the one updated, the
                # next one being read and the last one being written, of each state entry
                row[o_] = min(row[o_], 3 * slice_bytes * s.state_keys) if in_step else 0
            if not _same_memory(r.est.device):
                # gradients leave the device as they are accumulated
                row[g_] = min(row[g_], 2 * s.largest_param)
        total = sum(row)
        if total > best:
            best, at = total, row
    scale = 1.0
    if r.est.allocator and r.est.peak:
        scale = r.est.peak_reserved / r.est.peak  # allocator rounding and caching
    return int(best * scale), dict(zip(CATEGORIES, at, strict=True))


def _same_memory(device: str) -> bool:
    return device == "cpu"


def _time(c: Choice, flops: int, k: int, n: int, s: _Sizes, sp: Speeds, on_cpu: bool) -> float:
    t = flops / sp.flops
    if k and n:
        t += (flops / 3) * (k / n) / sp.flops  # forward of the checkpointed blocks, again
    if c.params != "device":
        bw = sp.disk if c.params == "disk" else sp.host
        t += 3 * s.params / bw  # read in forward and backward, gradients written back
    state = s.params * s.state_keys
    if c.optimizer_state == "disk":
        t += 2 * state / sp.disk  # state read and written once
    if c.optimizer_state != "device":
        t += (state + 2 * s.params) / sp.host_step
        if not on_cpu and c.params == "device":
            t += 2 * s.params / sp.host  # gradients to the host, parameters back
    return t


def _flops(model, example_args, example_kwargs, loss_fn, device) -> int:
    meta = _dryrun.meta_copy(model)
    args = _dryrun.to_meta(example_args if isinstance(example_args, tuple) else (example_args,))
    kwargs = _dryrun.to_meta(dict(example_kwargs or {}))
    fn = loss_fn or _dryrun.default_loss

    def step() -> None:
        fn(meta(*args, **kwargs)).backward()

    with _dryrun.AttentionAsOnDevice(torch.device(device).type):
        return count_flops(step)
