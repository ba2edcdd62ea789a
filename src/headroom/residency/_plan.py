"""Offload plans as data: which parameters go into which group, and what the device holds.

`plan_offload` works out the blocks, each one's parameters (a parameter is in a block only if
every module registering it is inside it; the rest form the *outside* group), their device bytes
and the device budget, reading no values (a model on ``meta`` works). ``str(plan)`` is the table
`hr.describe` prints.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn

from headroom.residency._blocks import check_blocks, find_blocks, with_outside_blocks
from headroom.residency._packed import is_packed, packed_nbytes
from headroom.transfer import check_device

__all__ = ["GroupPlan", "OffloadOptions", "OffloadPlan", "ParamPlan", "plan_offload"]

OUTSIDE = "(outside blocks)"


@dataclass(frozen=True)
class OffloadOptions:
    """The options of `hr.offload` that shape a plan (the store does not)."""

    device: torch.device
    prefetch: int = 1
    compute_dtype: torch.dtype | None = None
    blocks_given: bool = False


@dataclass(frozen=True)
class ParamPlan:
    """One parameter (tied ones once): its names, shape, dtypes and device bytes."""

    name: str
    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    compute_dtype: torch.dtype
    owners: tuple[str, ...]  # "Module.attr" of every registration (more than one: tied)
    # a quantized parameter resting packed: the bytes of its parts (its real size)
    packed: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of its device copy."""
        if self.packed is not None:
            return self.packed
        return math.prod(self.shape) * self.compute_dtype.itemsize


@dataclass(frozen=True)
class GroupPlan:
    """Parameters fetched and released together: a block, or the outside group."""

    name: str
    module_type: str
    params: tuple[ParamPlan, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)


ON_DEVICE = "(kept on the device)"


@dataclass(frozen=True)
class OffloadPlan:
    """What `hr.offload` does to a model, as data; ``str()`` is a readable table."""

    options: OffloadOptions
    blocks: tuple[GroupPlan, ...]
    outside: GroupPlan
    buffers: tuple[str, ...]
    store: str = "(not chosen)"
    # adapters (PEFT's LoRA weights) that stay on the device, not offloaded
    on_device: GroupPlan = GroupPlan(ON_DEVICE, "", ())

    @property
    def largest_block_bytes(self) -> int:
        return max((b.nbytes for b in self.blocks), default=0)

    @property
    def device_budget(self) -> int:
        """Device bytes of parameters at most: ``(prefetch+1) x largest block + outside``,
        plus the adapters kept on the device."""
        return ((self.options.prefetch + 1) * self.largest_block_bytes + self.outside.nbytes
                + self.on_device.nbytes)

    def __str__(self) -> str:
        o = self.options

        def mb(n: int) -> str:
            return f"{n / 2**20:.2f} MiB"

        lines = [
            f"headroom offload: device={o.device}, store={self.store}, prefetch={o.prefetch},"
            f" compute_dtype={o.compute_dtype}",
            f"blocks ({len(self.blocks)}, {'given' if o.blocks_given else 'found automatically'}):"
            " fetched before their forward and backward, released right after",
        ]
        for b in self.blocks:
            lines.append(f"  {b.name:<40} {b.module_type:<24} {len(b.params):>4} params"
                         f"  {mb(b.nbytes):>12}")
        rest = self.outside
        lines.append(
            f"outside blocks: {len(rest.params)} params, {mb(rest.nbytes)} on the device from"
            " the start of forward to the end of backward (not inside any block, or shared by"
            " several)"
        )
        for p in rest.params:
            extra = f" (tied: {', '.join(p.owners)})" if len(p.owners) > 1 else ""
            lines.append(f"  {p.name:<40} {p.shape!s:<24} {mb(p.nbytes):>12}{extra}")
        kept = self.on_device
        if kept.params:
            lines.append(f"adapters kept on the device: {len(kept.params)} params,"
                         f" {mb(kept.nbytes)}")
        lines.append(f"buffers resident on the device: {len(self.buffers)}")
        plus = f" + {mb(kept.nbytes)}" if kept.params else ""
        lines.append(
            f"device parameter bytes at most: (prefetch+1) x largest block + outside"
            f"{' + adapters' if kept.params else ''} ="
            f" {o.prefetch + 1} x {mb(self.largest_block_bytes)} + {mb(rest.nbytes)}{plus}"
            f" = {mb(self.device_budget)}"
        )
        return "\n".join(lines)


@dataclass
class Layout:
    """A plan together with the module objects it names (what `hr.offload` applies)."""

    plan: OffloadPlan
    block_modules: list[nn.Module]
    params: dict[int, nn.Parameter]  # id -> parameter, in registration order
    names: dict[int, str]  # id -> its first registration name (its store key)
    owners: dict[int, list[tuple[nn.Module, str]]]
    group_of: dict[int, int]  # parameter id -> index into block_modules, or -1: outside
    # adapters kept on the device (``adapters="device"``): id -> parameter, not in ``params``
    kept: dict[int, nn.Parameter] | None = None


def check_options(prefetch: int, compute_dtype: torch.dtype | None) -> None:
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    if compute_dtype is not None and (
        not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point
    ):
        raise ValueError(
            f"compute_dtype must be a floating-point torch.dtype (e.g. torch.bfloat16), got"
            f" {compute_dtype!r}"
        )


def plan_offload(
    model: nn.Module,
    *,
    device: str | torch.device,
    blocks: Iterable[nn.Module] | None = None,
    prefetch: int = 1,
    compute_dtype: torch.dtype | None = None,
) -> OffloadPlan:
    """The plan `hr.offload` would run ``model`` with, without moving or reading anything.

    Args:
        model: the model (parameters anywhere, ``meta`` included).
        device, blocks, prefetch, compute_dtype: as for `hr.offload`.

    Returns:
        The `OffloadPlan` (``str()`` for the table; ``device_budget`` for the bytes).

    Raises:
        ValueError: bad ``blocks``, ``prefetch`` or ``compute_dtype``.
        RuntimeError: ``device`` is not available.

    Example:
        >>> with torch.device("meta"):                        # doctest: +SKIP
        ...     model = build_model()
        >>> plan = plan_offload(model, device="cuda")          # doctest: +SKIP
        >>> print(plan); plan.device_budget                    # doctest: +SKIP
    """
    return layout(model, device=check_device(device), blocks=blocks, prefetch=prefetch,
                  compute_dtype=compute_dtype).plan


def adapter_modules(root: nn.Module) -> set[int]:
    """Ids of the modules that hold adapters: inside a wrapper (a module with a ``base_layer``
    submodule, as PEFT's tuner layers are) but not inside its ``base_layer``."""
    out: set[int] = set()
    for m in root.modules():
        base = m._modules.get("base_layer")
        if not isinstance(base, nn.Module):
            continue
        inner = {id(x) for x in base.modules()}
        out.update(id(x) for x in m.modules() if x is not m and id(x) not in inner)
        out.add(id(m))  # its own parameters too (none in PEFT's layers)
    return out


def is_adapter(p: torch.Tensor, owners: list[tuple[nn.Module, str]], mods: set[int]) -> bool:
    """Whether a parameter is an adapter kept on the device: all its ``owners`` hold adapters
    and it has values (one on ``meta`` rests in the store, pending)."""
    return bool(owners) and all(id(m) in mods for m, _ in owners) and not p.is_meta


def layout(model: nn.Module, *, device: torch.device, blocks: Iterable[nn.Module] | None,
           prefetch: int, compute_dtype: torch.dtype | None,
           adapters: str | set[int] = "store") -> Layout:
    """`plan_offload` with the module objects; ``adapters="device"`` (or a set of parameter
    ids) keeps adapters out of the groups, on the device."""
    check_options(prefetch, compute_dtype)
    auto = blocks is None
    block_mods = find_blocks(model) if auto else check_blocks(model, list(blocks))
    if auto and block_mods:
        block_mods = with_outside_blocks(model, block_mods)
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    homes_of: dict[int, set[int]] = {}  # module id -> the blocks it is inside (shared: several)
    for i, b in enumerate(block_mods):
        for m in b.modules():
            homes_of.setdefault(id(m), set()).add(i)
    params: dict[int, nn.Parameter] = {}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    pnames: dict[int, list[str]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is None:
                continue
            params.setdefault(id(p), p)
            own = owners.setdefault(id(p), [])
            if not any(o is m and a == attr for o, a in own):
                own.append((m, attr))
            full = f"{mname}.{attr}" if mname else attr
            if full not in pnames.setdefault(id(p), []):
                pnames[id(p)].append(full)
    group_of: dict[int, int] = {}
    for pid in params:
        homes = set().union(*(homes_of.get(id(m), {-1}) for m, _ in owners[pid]))
        group_of[pid] = homes.pop() if len(homes) == 1 else -1
    kept: dict[int, nn.Parameter] = {}
    if isinstance(adapters, set):
        kept = {pid: p for pid, p in params.items() if pid in adapters}
    elif adapters == "device":
        mods = adapter_modules(model)
        kept = {pid: p for pid, p in params.items() if is_adapter(p, owners[pid], mods)}
    params = {pid: p for pid, p in params.items() if pid not in kept}
    members: list[list[ParamPlan]] = [[] for _ in block_mods]
    outside: list[ParamPlan] = []
    on_device: list[ParamPlan] = []
    for pid, p in [*params.items(), *kept.items()]:
        packed = packed_nbytes(p) if is_packed(p) else None
        cdtype = compute_dtype if compute_dtype is not None and p.is_floating_point() \
            and packed is None else p.dtype
        pp = ParamPlan(pnames[pid][0], tuple(pnames[pid]), tuple(p.shape), p.dtype, cdtype,
                       tuple(f"{type(m).__name__}.{a}" for m, a in owners[pid]), packed)
        if pid in kept:
            on_device.append(pp)
        else:
            (members[group_of[pid]] if group_of[pid] >= 0 else outside).append(pp)
    # Found blocks whose parameters all went outside (e.g. a tied embedding) are dropped.
    keep = [i for i in range(len(block_mods)) if members[i] or not auto]
    renumber = {old: new for new, old in enumerate(keep)}
    group_of = {pid: renumber.get(g, -1) if g >= 0 else -1 for pid, g in group_of.items()}
    block_mods = [block_mods[i] for i in keep]
    buffers = tuple(f"{mn}.{bn}" if mn else bn for mn, m in model.named_modules()
                    for bn, b in m._buffers.items() if b is not None)
    plan = OffloadPlan(
        options=OffloadOptions(device, prefetch, compute_dtype, not auto),
        blocks=tuple(GroupPlan(names[id(block_mods[j])], type(block_mods[j]).__name__,
                               tuple(members[i])) for j, i in enumerate(keep)),
        outside=GroupPlan(OUTSIDE, "", tuple(outside)),
        buffers=buffers,
        on_device=GroupPlan(ON_DEVICE, "", tuple(on_device)),
    )
    return Layout(plan, block_mods, params, {pid: n[0] for pid, n in pnames.items()}, owners,
                  group_of, kept)
