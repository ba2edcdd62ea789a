"""`plan`: the fastest combination of headroom's techniques whose estimated peak fits a budget.

Combinations are tried fastest first (time and a lower bound of the peak from a dry run of what
changes the ops); the first whose dry run of the whole plan fits wins, so the plan's peak is
what `hr.estimate` gives for the applied plan.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headroom.fit import _dryrun
from headroom.fit._dryrun import block_names
from headroom.fit._estimate import Estimate, estimate, parse_device
from headroom.fit._lm import lm_patch_run, lm_patching
from headroom.fit._time import Speeds, activation_ways, default_speeds, dry_run_time, step_time
from headroom.memory import CATEGORIES, format_bytes

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(value: int | float | str) -> int:
    """``"8GiB"`` -> ``8589934592``; ``"1.5 GB"`` -> ``1500000000``; ints pass through."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"a byte budget must be a finite number of bytes, got {value};"
                             " pass e.g. budget=\"8GiB\"")
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"cannot read {value!r} as a number of bytes; write e.g. 8589934592, \"8GiB\","
                " \"512MiB\" or \"8GB\""
            )
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"a byte budget must be positive, got {value!r}")
    return int(n)


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
        params: where parameters rest: ``"device"``, ``"host"`` or ``"disk"`` (`hr.offload`).
        optimizer_state: ``"device"`` (the optimizer itself), ``"host"`` or ``"disk"``
            (`hr.HostOptimizer`).
        activations: where tensors saved for backward rest: ``"device"``, ``"host"`` or
            ``"disk"`` (`hr.offload_activations` around every forward, ``prefetch=0``).
        activation_min_bytes: the ``min_bytes`` of activation offload.
        lm_loss: a causal LM's loss without its logits (`hr.patch_causal_lm`; never with
            ``convert``, which converts the output layer the patch needs plain).
    """

    convert: bool = False
    checkpoint: tuple[str, ...] = ()
    params: str = "device"
    optimizer_state: str = "device"
    activations: str = "device"
    activation_min_bytes: int = 1 << 20
    lm_loss: bool = False

    def describe(self, *, sharded: bool = False) -> list[str]:
        out = []
        if self.lm_loss:
            out.append("the LM loss without logits (hr.patch_causal_lm: the model's loss from"
                       " its hidden states in fp32 slices, equal to its own to rounding)")
        if self.convert:
            out.append("hr.convert (layers that save only what backward needs)")
        if self.checkpoint:
            out.append(f"checkpointing of {len(self.checkpoint)} block(s):"
                       f" {_names(self.checkpoint)}")
        if self.activations != "device":
            out.append(f"activation offload to {self.activations} (hr.offload_activations,"
                       f" min_bytes={format_bytes(self.activation_min_bytes)})")
        if self.params != "device" and sharded:
            out.append("each rank's shards in host memory (hr.offload of the sharded model)")
        elif self.params != "device":
            out.append(f"parameter offload to {self.params} (hr.offload, prefetch=1)")
        if self.optimizer_state != "device":
            out.append(f"optimizer state and step on {self.optimizer_state} (hr.HostOptimizer)")
        return out or [_NOTHING]


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]} ... {names[-1]}"


@dataclass
class Plan:
    """What `plan` chose: the techniques, the estimated peak and step time, and `apply`.

    Attributes:
        choice: the techniques (a `Choice`).
        peak: estimated peak bytes on the device: the dry run of the whole plan (on CUDA-like
            devices the allocator model's reserved bytes), plus ``margin``.
        margin: on ``cpu`` with parameters on disk, the largest gradient (a disk write keeps
            it until it lands; the dry run takes writes as done when issued); else 0.
        time_s: estimated seconds per step (see `headroom.fit._time`).
        plain_peak, plain_time_s: the same for the plain step.
        budget: the budget asked for.
        device: the device planned for.
        speeds: the speeds the times were estimated with.
        candidates: every combination considered: ``(choice, peak, time_s)``; ``peak`` of the
            whole dry run, else a lower bound or ``None``; ``time_s`` a lower bound where not
            refined (see `plan`).
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
    speeds: Speeds | None = field(default=None, repr=False)
    margin: int = 0
    faster_over_budget: tuple[Choice, int, float] | None = field(default=None, repr=False)
    world_size: int | None = None
    blocks: tuple[str, ...] = ()
    fp32_masters: bool = False
    frozen: bool = False  # frozen parameters (a quantized base): the optimizer gets the rest

    def __str__(self) -> str:
        # on CUDA-like devices the budget is compared with reserved bytes, not allocated ones
        kind = " reserved" if not self.device.startswith("cpu") else ""
        ranks = ("" if self.world_size is None else
                 f" (each of {self.world_size} ranks, FSDP2 fully_shard of each block and the"
                 " root)")
        lines = [
            f"headroom plan for {self.device}{ranks}: budget {format_bytes(self.budget)},"
            f" plain step {format_bytes(self.plain_peak)}{kind} / {_seconds(self.plain_time_s)}"
            " (estimated)",
            f"chosen: estimated peak {format_bytes(self.peak)}{kind}, step"
            f" {_seconds(self.time_s)}"
            + (f" (with {format_bytes(self.margin)} for a gradient being written to disk)"
               if self.margin else ""),
        ]
        sharded = self.world_size is not None
        lines += [f"  - {d}" for d in self.choice.describe(sharded=sharded)]
        if self.fp32_masters:
            lines.append("  - fp32 masters, gradients and state for the bf16/fp16 parameters"
                         " (more precise than the plain step, not bitwise it;"
                         " fp32_masters=False forbids)")
        if self.peak_by_category:
            lines.append("  at the estimated peak: " + ", ".join(
                f"{c} {format_bytes(v)}" for c, v in self.peak_by_category.items() if v))
        if self.faster_over_budget is not None:
            choice, peak, time_s = self.faster_over_budget
            lines.append(f"the fastest plan over the budget: estimated peak"
                         f" {format_bytes(peak)}{kind}, step {_seconds(time_s)}")
            lines += [f"  - {d}" for d in choice.describe(sharded=sharded)
                      if d != _NOTHING] or ["  - nothing: the plain step"]
        lines.append(f"({len(self.candidates)} combinations considered"
                     + (f"; speeds: {self.speeds.describe()}" if self.speeds else "") + ")")
        return "\n".join(lines)

    def code(self, model_name: str = "model") -> str:
        """Python that applies the plan by hand, the same as :meth:`apply`."""
        lines = ["import torch", "import headroom as hr"]
        for step in self._steps(model_name):
            lines += step.code(model_name)
        return "\n".join(lines)

    def _steps(self, m: str) -> list[_Step]:
        """The steps of `apply`, and of `code` with the model named ``m``."""
        from headroom.fit._apply import offload_activations_in_forward
        from headroom.heads import patch_causal_lm
        from headroom.nn import convert
        from headroom.optim import HostOptimizer
        from headroom.residency import offload

        c, model = self.choice, _Arg(m, lambda env: env["model"])
        steps = []
        if c.convert:
            steps.append(_Step(_fn("hr.convert", convert), (model,), out="model"))
        if c.lm_loss:
            steps.append(_Step(_fn("hr.patch_causal_lm", patch_causal_lm), (model,)))
        if c.checkpoint:
            steps.append(_Step(
                _fn("checkpoint_modules", _dryrun.checkpoint_modules),
                (model, _lit(list(c.checkpoint))),
                notes=("from headroom.fit import checkpoint_modules",
                       "# non-reentrant checkpointing (no key/value cache in training)")))
        if self.world_size is not None:
            # FSDP2 first, then headroom's store for each rank's shards
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = {"mesh": _Arg("mesh", lambda env: env["mesh"])}
            block = _Arg(f"{m}.get_submodule(name)",
                         lambda env: env["model"].get_submodule(env["name"]))
            steps += [
                _Step(_fn("init_device_mesh", init_device_mesh),
                      (_lit(torch.device(self.device).type), _lit((self.world_size,))),
                      out="mesh", notes=(
                          "from torch.distributed.device_mesh import init_device_mesh",
                          "from torch.distributed.fsdp import fully_shard")),
                _Step(_fn("fully_shard", fully_shard), (block,), mesh, each=self.blocks),
                _Step(_fn("fully_shard", fully_shard), (model,), mesh)]
            if c.params != "device":
                steps.append(_Step(_fn("hr.offload", offload), (model,), {
                    "device": _Arg("mesh.device_type", lambda env: env["mesh"].device_type),
                    "store": self._store("host", "params")}))
        elif c.params != "device":
            steps.append(_Step(_fn("hr.offload", offload), (model,), {
                "device": _lit(self.device), "store": self._store(c.params, "params"),
                "prefetch": _lit(1)}))
        elif self.device != "cpu":
            steps.append(_Step(_Arg(f"{m}.to", lambda env: env["model"].to),
                               (_lit(self.device),)))
        if c.activations != "device":
            steps.append(_Step(
                _fn("offload_activations_in_forward", offload_activations_in_forward), (model,),
                {"store": self._store(c.activations, "activations"),
                 "min_bytes": _lit(c.activation_min_bytes), "prefetch": _lit(0)},
                notes=("from headroom.fit import offload_activations_in_forward",
                       "# every forward (and the backward of what it saved) under"
                       " hr.offload_activations")))
        # a frozen quantized weight is no tensor an optimizer takes
        params = _Arg(f"[p for p in {m}.parameters() if p.requires_grad]" if self.frozen
                      else f"{m}.parameters()",
                      lambda env: [p for p in env["model"].parameters() if p.requires_grad])
        opt = _fn(_opt_name(self.optimizer), _opt_class(self.optimizer))
        if c.optimizer_state != "device":
            return [*steps, _Step(
                _fn("hr.HostOptimizer", HostOptimizer), (params, opt),
                {"state_store": self._store(c.optimizer_state, "optimizer"),
                 "slice_bytes": _lit(self.slice_bytes), "overlap": _lit(False)},
                extra={k: _lit(v) for k, v in _host_kwargs(
                    _opt_class(self.optimizer), self.optimizer_kwargs, self.device).items()},
                out="opt")]
        return [*steps, _Step(opt, (params,), out="opt",
                              extra={k: _lit(v) for k, v in self.optimizer_kwargs.items()})]

    def _check_job(self) -> None:
        import torch.distributed as dist

        have = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
        if have != self.world_size:
            raise RuntimeError(
                f"this plan shards the model over {self.world_size} ranks (FSDP2), but"
                + (" torch.distributed is not initialized" if have is None else
                   f" this job has {have}")
                + ": apply it on every rank of a job of that size (torchrun"
                f" --nproc-per-node={self.world_size}), after"
                " torch.distributed.init_process_group()")

    def _store(self, where: str, sub: str) -> _Arg:
        if where == "host":
            return _Arg('"cpu"', lambda env: "cpu")
        if self.disk is None:  # pragma: no cover - disk choices need disk=
            raise ValueError("this plan needs disk=")
        from headroom.store import DiskStore

        path = str(Path(self.disk) / sub)
        return _Arg(f"hr.DiskStore({path!r})", lambda env: DiskStore(path))

    def apply(self, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Apply the plan to ``model`` (the one planned for) and build its optimizer.

        Returns:
            ``(model, optimizer)``: the model to train (with ``hr.convert``, a new module tree
            sharing the parameters; else ``model``, changed in place) and the optimizer over
            its trainable parameters.

        Raises:
            ValueError: ``model`` lacks a block the plan checkpoints (not the model planned).
            RuntimeError: a plan made with ``world_size=N`` applied outside a job of ``N``
                ranks. Both are checked before anything changes.

        The steps run in order (``hr.convert``, `hr.patch_causal_lm`, checkpointing,
        ``hr.offload``, activation offload, the optimizer); if one raises (a full disk), the
        ones before it stay applied: rebuild the model rather than retry on it.
        """
        if self.world_size is not None:
            self._check_job()
        for name in self.choice.checkpoint:
            try:
                model.get_submodule(name)
            except AttributeError:
                raise ValueError(
                    f"the plan checkpoints block {name!r}, which this model does not have: apply"
                    " a plan to the model it was made for"
                ) from None
        env = {"model": model}
        for step in self._steps("model"):
            step.run(env)
        return env["model"], env["opt"]


@dataclass(frozen=True)
class _Arg:
    """A value in a plan's steps: its Python text, and how `Plan.apply` gets it from what the
    steps before bound (``model``, ``mesh``, ``name`` of a loop)."""

    text: str
    get: Callable[[dict[str, Any]], Any]


def _lit(value: Any) -> _Arg:
    return _Arg(repr(value), lambda env: value)


def _fn(text: str, fn: Callable) -> _Arg:
    return _Arg(text, lambda env: fn)


@dataclass(frozen=True)
class _Step:
    """``out = fn(*args, **kwargs, **extra)`` after ``notes`` (the code's imports and comments),
    once for each ``name`` in ``each`` when given."""

    fn: _Arg
    args: tuple[_Arg, ...] = ()
    kwargs: dict[str, _Arg] = field(default_factory=dict)
    extra: dict[str, _Arg] = field(default_factory=dict)  # the optimizer's own
    out: str | None = None
    notes: tuple[str, ...] = ()
    each: tuple[str, ...] | None = None

    def code(self, m: str) -> list[str]:
        call = ", ".join([a.text for a in self.args] + [
            f"{k}={v.text}" for kw in (self.kwargs, self.extra) for k, v in kw.items()])
        line = f"{self.fn.text}({call})"
        if self.out is not None:
            line = f"{m if self.out == 'model' else self.out} = {line}"
        if self.each is None:
            return [*self.notes, line]
        return [*self.notes, f"for name in {list(self.each)!r}:", f"    {line}"]

    def run(self, env: dict[str, Any]) -> None:
        for name in (None,) if self.each is None else self.each:
            env["name"] = name
            out = self.fn.get(env)(*[a.get(env) for a in self.args],
                                   **{k: v.get(env) for k, v in self.kwargs.items()},
                                   **{k: v.get(env) for k, v in self.extra.items()})
        if self.out is not None:
            env[self.out] = out


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
        # NOTE: the plan builds its optimizer over the parameters it applies to; an instance's
        # hyperparameters (lr, per-group settings) would silently be left behind.
        name = _opt_name(type(optimizer))
        raise TypeError(
            f"hr.plan needs optimizer= as a class with its keyword arguments in"
            f" optimizer_kwargs (optimizer={name}, optimizer_kwargs={{'lr': ...}}), got an"
            f" instance of {type(optimizer).__name__}, whose hyperparameters would be lost")
    raise TypeError(
        f"hr.plan needs optimizer= as a torch.optim.Optimizer class (e.g. torch.optim.AdamW),"
        f" got {optimizer!r}"
    )


def _host_kwargs(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any],
                 device: str | torch.device) -> dict[str, Any]:
    """``kwargs`` for `HostOptimizer` to step as ``cls(params, **kwargs)`` does on a CPU
    ``device`` (``fused=False`` where it would pick the fused kernel)."""
    kwargs = dict(kwargs)
    if torch.device(device).type != "cpu" or "fused" in kwargs or "foreach" in kwargs:
        return kwargs
    try:
        accepts = "fused" in inspect.signature(cls).parameters
    except (TypeError, ValueError):  # no signature to read: pass the user's arguments as given
        accepts = False
    if accepts:
        # NOTE: only classes whose constructor takes ``fused``: ``RMSprop(fused=False)`` raises.
        kwargs["fused"] = False
    return kwargs


def _opt_name(optimizer: Any) -> str:
    cls = _opt_class(optimizer)
    mod = "torch.optim" if cls.__module__.startswith("torch.optim") else cls.__module__
    return f"{mod}.{cls.__name__}"


@dataclass
class _Candidate:
    choice: Choice
    time_s: float  # a lower bound until refined
    lower: int | None = None  # a lower bound of its peak (see _lower), once refined
    peak: int | None = None  # the dry run of the whole plan (and margin), once run
    at_peak: dict[str, int] = field(default_factory=dict)
    margin: int = 0


# whole dry runs looking for the smallest peak when nothing fits
_MAX_WHOLE_RUNS = 4


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
    world_size: int | None = None,
    mesh: Any = None,
    fp32_masters: bool | None = None,
    lm_loss: bool | None = None,
) -> Plan:
    """Choose what to turn on so that one training step fits ``budget`` bytes on ``device``.

    Considers `hr.convert`, checkpointing of the first k blocks, and moving activations
    (`hr.offload_activations`), parameters (`hr.offload`) or the optimizer's state and step
    (`hr.HostOptimizer`) to host memory or ``disk`` (on ``cpu``: only ``disk``), and a causal
    LM's loss without its logits (`hr.patch_causal_lm`); returns the fastest combination whose
    dry run (see `hr.estimate`) fits. Training with it is bitwise the plain step on the same
    device, but for fp32 masters of bf16/fp16 parameters (``fp32_masters``) and the LM loss,
    equal to rounding (``lm_loss``).

    Args:
        model: the model (parameters anywhere, ``meta`` included); not changed.
        example_args: one step's inputs, as for `hr.estimate` (shapes and dtypes matter, and
            the values of integer and boolean ones: ids, attention masks, labels).
        budget: bytes the step may use on ``device``: an int or a string such as ``"8GiB"``;
            on CUDA-like devices compared with the allocator model's reserved bytes.
        device: the device to plan for.
        optimizer: the ``torch.optim.Optimizer`` class `Plan.apply` builds (its arguments in
            ``optimizer_kwargs``), or `hr.HostOptimizer` over it; on ``cpu`` with the kernel the
            plain call picks, so that training is bitwise.
        loss_fn: as for `hr.estimate`.
        disk: a folder for stores on disk; without it only host memory is used.
        exact: only exact techniques (``False`` is not searched yet: it plans as ``True``).
        example_kwargs, optimizer_kwargs: as for `hr.estimate`.
        speeds: the time model's speeds (default: `headroom.fit._time.default_speeds`:
            measured once on ``cpu``, declared for accelerators).
        slice_bytes: the host optimizer's slice size for state on disk (default: 1/8 of the
            largest parameter moved, from 4 KiB to 16 MiB).
        world_size, mesh: plan one rank of FSDP2, as for `hr.estimate`: ``budget`` is each
            rank's; shards and their optimizer state may rest in host memory (not on disk).
            `Plan.apply` ``fully_shard``s each block and the root. Collectives are not timed.
        fp32_masters: for trainable bf16/fp16 parameters: ``True`` only plans training them
            from fp32 masters (`hr.HostOptimizer`), ``False`` only plans bitwise the plain step
            (the optimizer on the device), ``None`` (default) either.
        lm_loss: for a causal LM whose loss comes from ``labels`` (``loss_fn``, if any,
            reading ``output.loss``): ``True`` keeps only plans with `hr.patch_causal_lm`,
            ``False`` only plans without, ``None`` (default) with it only where no plan without
            it fits. Not considered for ``world_size``.

    Returns:
        A `Plan`; ``print(plan)`` shows it, ``plan.apply(model)`` returns ``(model, optimizer)``.

    Raises:
        PlanError: (a ``ValueError``) no combination fits; the message gives the smallest peak
            found and what dominates it.
        ValueError: a budget that is not a positive, finite byte count; a ``device`` that is
            not a torch device; ``lm_loss=True`` for a step the patch does not apply to.
        TypeError: ``model`` is not an ``nn.Module``.

    Every dry run uses a ``meta`` copy, so an error in one leaves ``model`` as it was.

    Example:
        >>> plan = hr.plan(model, (x,), budget="8GiB", device="cuda",
        ...                optimizer=torch.optim.AdamW, disk="/scratch/run")
        >>> print(plan)
        >>> model, opt = plan.apply(model)
    """
    budget_b = parse_bytes(budget)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    parse_device(device)
    from headroom.fit._sharded import check_world

    world = check_world(world_size, mesh)
    if fp32_masters is not None and not isinstance(fp32_masters, bool):
        raise TypeError(f"fp32_masters must be True, False or None, got {fp32_masters!r}")
    if lm_loss is not None and not isinstance(lm_loss, bool):
        raise TypeError(f"lm_loss must be True, False or None, got {lm_loss!r}")
    search = Search(model, example_args, device=device, optimizer=optimizer, loss_fn=loss_fn,
                    disk=disk, example_kwargs=example_kwargs, optimizer_kwargs=optimizer_kwargs,
                    speeds=speeds, slice_bytes=slice_bytes, world_size=world,
                    fp32_masters=fp32_masters, lm_loss=lm_loss)
    candidates = search.candidates
    if not candidates:
        # only fp32_masters=True can leave none: shards on a CPU mesh have no host optimizer
        raise PlanError(
            f"no plan on {device} trains the model's bf16/fp16 parameters from fp32 masters:"
            " one rank's shards on a CPU device can only be stepped by the optimizer itself."
            " Pass fp32_masters=None (or False), or convert the model to float32.", 0)
    # NOTE: with lm_loss=None the LM-loss patch (the model's loss to rounding, not bitwise) is
    # used only where no plan without it fits: exact by default wherever that fits
    bitwise = [c for c in candidates if not c.choice.lm_loss]
    chosen = None
    for pool in [bitwise, candidates] if lm_loss is None and bitwise else [candidates]:
        chosen = _fastest_fitting(search, pool, budget_b)
        if chosen is not None:
            break
    if chosen is None:
        # every candidate was refined: branch and bound on the lower bounds for the smallest peak
        best = None
        for j, c in enumerate(sorted(candidates, key=lambda c: c.lower)):
            if (best is not None and c.lower >= best.peak) or j >= _MAX_WHOLE_RUNS:
                break
            search.whole(c)
            if best is None or c.peak < best.peak:
                best = c
        dominant = max(best.at_peak.items(), key=lambda kv: kv[1])
        hint = "" if disk is not None else " Pass disk= (--disk) to allow stores on disk."
        if search.fp32_masters is False:
            hint += (" fp32_masters=False keeps the optimizer, and so the parameters, on the"
                     " device; fp32_masters=None allows hr.HostOptimizer (fp32 masters).")
        if lm_loss is False:
            hint += (" lm_loss=False keeps the model's logits; lm_loss=None allows"
                     " hr.patch_causal_lm (the loss without them).")
        used = best.choice.describe()
        raise PlanError(
            f"no combination of headroom's techniques fits {format_bytes(budget_b)} on"
            f" {device}: the smallest estimated peak is {format_bytes(best.peak)} (with"
            f" {'the plain step' if used == [_NOTHING] else '; '.join(used)}), of which"
            f" {dominant[0]} take {format_bytes(dominant[1])}.{hint} Use a smaller batch or"
            " sequence, or a larger budget.",
            best.peak,
        )
    result = search.plan_of(chosen, budget_b)
    # the fastest plan over the budget, a user may prefer it; a whole run only makes a time
    # larger, so a few tries suffice
    faster = sorted((c for c in candidates if c is not chosen and c.time_s < chosen.time_s),
                    key=lambda c: c.time_s)
    for alt in faster[:_MAX_ALTERNATIVE_RUNS]:
        search.whole(alt)
        if alt.peak > budget_b and alt.time_s < chosen.time_s:
            result.faster_over_budget = (alt.choice, alt.peak, alt.time_s)
            break
    return result


_MAX_ALTERNATIVE_RUNS = 3


def _fastest_fitting(search: Search, candidates: list[_Candidate], budget: int
                     ) -> _Candidate | None:
    """The fastest of ``candidates`` whose whole dry run fits ``budget``, or ``None``.

    Best first on time: refining and running whole only make a time larger, so the first that
    comes up whole and fitting is the fastest that fits.
    """
    heap = [(c.time_s, i, c) for i, c in enumerate(candidates)]
    heapq.heapify(heap)
    while heap:
        _, i, c = heapq.heappop(heap)
        if c.lower is None:
            search.refine(c)
        elif c.peak is None and c.lower <= budget:
            search.whole(c)  # its time too, from the whole plan's ops and transfers
        elif c.peak is not None and c.peak <= budget:
            return c
        else:
            continue
        heapq.heappush(heap, (c.time_s, i, c))
    return None
_NOTHING = "nothing: the plain step fits"


class Search:
    """The combinations `plan` considers, and their dry runs (each made once, shared).

    `refine` gives a candidate its own run's time and a lower bound of its peak, `whole` the
    dry run of the whole plan.
    """

    def __init__(self, model: nn.Module, example_args: tuple | Any, *,
                 device: str | torch.device, optimizer: Any, loss_fn: Any = None,
                 disk: Any = None, example_kwargs: dict[str, Any] | None = None,
                 optimizer_kwargs: dict[str, Any] | None = None, speeds: Speeds | None = None,
                 slice_bytes: int | None = None, world_size: int | None = None,
                 fp32_masters: bool | None = None, lm_loss: bool | None = None) -> None:
        self.model = model
        self.args = example_args
        self.opt_cls = _opt_class(optimizer)
        self.opt_kw = dict(optimizer_kwargs or {})
        self.disk = disk
        kind = torch.device(device).type
        self.on_cpu = kind == "cpu"
        self.speeds = speeds or default_speeds(kind, disk)
        self.blocks = block_names(model)
        n = len(self.blocks)
        ks = sorted({0, *(math.ceil(n * q / 4) for q in (1, 2, 3, 4))}) if n else [0]
        self.world = world_size
        self.common = dict(loss_fn=loss_fn, device=device, example_kwargs=example_kwargs,
                           world_size=world_size)
        self.plain = self._estimate(Choice())
        self.min_bytes = _activation_min_bytes(self.plain)
        places = ["device"] + ([] if self.on_cpu else ["host"]) + (
            ["disk"] if disk is not None else [])
        # bf16/fp16 parameters get fp32 masters from hr.HostOptimizer and from nothing else
        self.low_precision = _low_precision(model)
        self.fp32_masters = fp32_masters if self.low_precision else None
        state_places = places
        if self.fp32_masters and self.on_cpu:
            # the host optimizer in the device's own memory: masters, not savings
            state_places = ["device", "host", *places[1:]]
        self.sizes = _sizes(model, self.opt_cls, self.opt_kw, world_size or 1)
        self.slice_bytes = slice_bytes or max(4 << 10, min(16 << 20,
                                                           self.sizes.largest_param // 8))
        self.runs: dict[Choice, Estimate] = {self._ops(Choice()): self.plain}
        conv_options = [False] + ([True] if self.run(Choice(convert=True)).peak
                                  < self.plain.peak else [])
        lm_options = self._lm_options(lm_loss)
        self.candidates: list[_Candidate] = []
        for conv, k, act, lm in itertools.product(conv_options, ks, places, lm_options):
            if conv and lm:
                continue  # hr.convert converts the output layer, which the patch needs plain
            for params, state in itertools.product(places, state_places):
                if params != "device" and state == "device":
                    continue  # offloaded parameters are stepped through their store
                if self.fp32_masters is not None and self.fp32_masters == (state == "device"):
                    continue  # masters asked for and not given, or refused and given
                if world_size is not None and (params != state or params == "disk"):
                    continue  # shards: on the device, or with their state in host memory
                choice = Choice(conv, tuple(self.blocks[:k]), params, state, act,
                                self.min_bytes, lm)
                # checkpointing only adds recomputation and activation offload only
                # transfers: the time on top of the run without them is a lower bound
                base = self.run(Choice(convert=conv, lm_loss=lm))
                self.candidates.append(_Candidate(choice, self._time(base, choice)))

    def _ops(self, ch: Choice) -> Choice:
        """``ch`` as far as it changes the ops (host and disk move the same bytes)."""
        return replace(ch, params="device", optimizer_state="device",
                       activations="device" if ch.activations == "device" else "host",
                       activation_min_bytes=self.min_bytes)

    def run(self, ch: Choice, lm_prepare: Callable[[nn.Module], None] | None = None
            ) -> Estimate:
        """The dry run of `_ops` of ``ch``, made once."""
        key = self._ops(ch)
        if key not in self.runs:
            self.runs[key] = self._estimate(key, lm_prepare)
        return self.runs[key]

    def _estimate(self, ch: Choice, lm_prepare: Callable[[nn.Module], None] | None = None
                  ) -> Estimate:
        """The dry run of the whole plan ``ch``, as `Plan.apply` sets it up."""
        optimizer, kwargs = self.opt_cls, self.opt_kw
        if ch.optimizer_state != "device":
            from headroom.optim import HostOptimizerOptions

            optimizer = HostOptimizerOptions(
                self.opt_cls, _host_kwargs(self.opt_cls, self.opt_kw, self.common["device"]),
                "cpu" if ch.optimizer_state == "host" else "disk", False, self.slice_bytes,
                32 << 20)
            kwargs = {}
        offload = None if ch.params == "device" else {"store": "cpu"} if self.world else {
            "store": "cpu" if ch.params == "host" else "disk", "prefetch": 1}
        return estimate(
            self.model, self.args, optimizer=optimizer, optimizer_kwargs=kwargs,
            checkpoint=ch.checkpoint, prepare=_prepare_fn(ch.convert, ch.lm_loss, lm_prepare),
            offload_activations=None if ch.activations == "device" else
            {"min_bytes": ch.activation_min_bytes, "prefetch": 0}, offload=offload,
            **self.common)

    def _lm_options(self, wanted: bool | None) -> list[bool]:
        """With the LM-loss patch when asked or when it cuts the plain peak; without it when
        asked or where it does not apply."""
        if wanted is False or self.world is not None:
            return [False]
        est, why = lm_patch_run(self.model,
                                lambda prepare: self.run(Choice(lm_loss=True), prepare))
        if wanted:
            if why is not None:
                raise ValueError("lm_loss=True, but hr.patch_causal_lm does not apply to this"
                                 f" step: {why}")
            return [True]
        return [False] + ([True] if why is None and est.peak < self.plain.peak else [])

    def _time(self, r: Estimate, c: Choice) -> float:
        """Seconds per step of ``c`` over ``r``'s ops, transfers counted from the sizes."""
        s, on_cpu = self.sizes, self.on_cpu
        moved = {"disk_read": 0, "disk_write": 0, "link": 0}
        if c.params != "device":
            way = "disk_read" if c.params == "disk" else "link"
            moved[way] += 2 * s.params  # fetched for forward and again for backward
            moved["disk_write" if c.params == "disk" else "link"] += s.trainable  # gradients out
        state = s.trainable * s.state_keys
        if c.optimizer_state == "disk":
            moved["disk_read"] += state
            moved["disk_write"] += state
            if c.params == "disk":  # the sliced step reads masters and gradients, writes masters
                moved["disk_read"] += 2 * s.trainable
                moved["disk_write"] += s.trainable
        if c.optimizer_state != "device" and not on_cpu and c.params == "device":
            moved["link"] += 2 * s.trainable  # gradients to the host, parameters back
        for way in activation_ways(c.activations, on_cpu):
            moved[way] += r.activation_bytes_moved
        if on_cpu:
            moved.pop("link")
        return step_time(r.ops, self.speeds, host_step=_host_step(c, on_cpu), moved=moved)

    def refine(self, c: _Candidate) -> None:
        r = self.run(c.choice)
        c.time_s = self._time(r, c.choice)
        c.lower = _lower(r, c.choice)

    def whole(self, c: _Candidate) -> int:
        """The peak of the dry run of the whole plan, as `Plan.apply` sets it up."""
        if c.peak is None:
            est = self._estimate(c.choice)
            c.margin = self.sizes.largest_param if (
                self.on_cpu and c.choice.params == "disk") else 0
            c.peak = est.peak_reserved + c.margin
            c.at_peak = dict(est.peak_by_category)
            c.time_s = dry_run_time(est, self.speeds, activations=c.choice.activations,
                                    on_cpu=self.on_cpu, host_step=_host_step(c.choice, self.on_cpu))
        return c.peak

    def plan_of(self, c: _Candidate, budget: int) -> Plan:
        plain_time = self._time(self.plain, Choice(activation_min_bytes=self.min_bytes))
        return Plan(c.choice, c.peak, c.time_s, self.plain.peak_reserved, plain_time, budget,
                    self.plain.device, self.opt_cls, self.opt_kw,
                    None if self.disk is None else str(self.disk), self.slice_bytes,
                    c.at_peak, [(x.choice, x.peak if x.peak is not None else x.lower, x.time_s)
                                for x in self.candidates], self.speeds, c.margin,
                    world_size=self.world, blocks=tuple(self.blocks),
                    fp32_masters=self.low_precision and c.choice.optimizer_state != "device",
                    frozen=not all(p.requires_grad for p in self.model.parameters()))


def _low_precision(model: nn.Module) -> bool:
    """Whether a trainable parameter is bf16/fp16 (`hr.HostOptimizer` gives it fp32 masters)."""
    return any(p.requires_grad and p.is_floating_point()
               and p.dtype not in (torch.float32, torch.float64) for p in model.parameters())


def _prepare_fn(conv: bool, lm: bool, lm_prepare: Callable[[nn.Module], None] | None = None):
    """`Plan.apply`'s ``hr.convert`` then `hr.patch_causal_lm`, for a dry run's copy."""
    if not conv and not lm:
        return None
    from headroom.nn import convert as _convert

    patch = (lm_prepare or lm_patching()) if lm else None

    def prepare(m: nn.Module) -> nn.Module:
        if conv:
            m = _convert(m, inplace=True)
        if patch is not None:
            patch(m)
        return m

    return prepare


def _activation_min_bytes(plain: Estimate) -> int:
    """1 MiB (the default), or 1/256 of the activations (at least 4 KiB) when smaller, so that
    a small model's saved tensors are not all below it."""
    acts = plain.max_by_category.get("activations", 0)
    return int(min(1 << 20, max(4 << 10, acts // 256)))


@dataclass(frozen=True)
class _Sizes:
    params: int  # bytes of all parameters as they rest (quantized ones packed)
    largest_param: int  # bytes of the largest trainable parameter (its gradient)
    state_keys: int
    trainable: int  # bytes of the trainable parameters (gradients, optimizer state)


def _sizes(model: nn.Module, opt_cls, opt_kw, world: int) -> _Sizes:
    """The sizes of one rank's shards (``world``: ranks FSDP2 shards over)."""
    from headroom.residency import is_packed, packed_nbytes

    params = {id(p): p for p in model.parameters()}
    resting = [(packed_nbytes(p) or 0) if is_packed(p) else p.numel() * p.element_size()
               for p in params.values()]
    nbytes = [p.numel() * p.element_size() for p in params.values() if p.requires_grad]
    probe = nn.Parameter(torch.zeros(2, 3))
    probe.grad = torch.zeros(2, 3)
    try:
        o = opt_cls([probe], **{k: v for k, v in opt_kw.items() if k != "fused"})
        o.step()
        keys = sum(1 for v in o.state[probe].values()
                   if isinstance(v, torch.Tensor) and v.shape == probe.shape)
    except Exception:
        keys = 2
    return _Sizes(-(-sum(resting) // world), -(-max(nbytes, default=0) // world), keys,
                  -(-sum(nbytes) // world))


def _lower(r: Estimate, c: Choice) -> int:
    """A lower bound of the peak of ``c``: the run's timeline without the categories that leave
    the device (on ``cpu`` only stores on disk leave)."""
    drop = set()
    cpu = r.device == "cpu"
    if c.params != "device" and not (cpu and c.params == "host"):
        drop |= {"parameters", "gradients"}
    if c.optimizer_state != "device" and not (cpu and c.optimizer_state == "host"):
        drop |= {"optimizer_state"}
        if not cpu:
            drop |= {"gradients"}
    idx = [i for i, cat in enumerate(CATEGORIES) if cat not in drop]
    low = max((sum(s.by_category[CATEGORIES[i]] for i in idx) for s in r.timeline), default=0)
    if r.allocator and r.peak:
        low = int(low * r.peak_reserved / r.peak)  # the same step's rounding and caching
    return low


def _host_step(c: Choice, on_cpu: bool) -> bool:
    return c.optimizer_state != "device" and not on_cpu
