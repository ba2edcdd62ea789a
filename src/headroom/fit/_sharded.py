"""FSDP2 (``fully_shard``) in a dry run: one rank's memory of a sharded training step.

`hr.estimate(..., world_size=N)` (or ``mesh=``, or a model already ``fully_shard``ed) runs the
step on a ``meta`` copy whose units (each block, then the root) behave as FSDP2's do in
torch 2.13, allocation for allocation, for the rank that holds the most (rank 0: dim 0 of each
parameter is split in ``ceil(d0 / N)`` rows, padded to a multiple of ``N``):

- between uses a unit keeps only its padded shards (the parameters the optimizer steps);
- before a unit's forward its shards are all-gathered into one flat buffer (the padded size of
  the unit), copied out into the unsharded parameters (padded too), and the flat buffer is kept
  until the next unit's copy-out (FSDP2 overlaps that copy with the next all-gather); the root
  frees the last one at the end of its forward. With one rank there is no flat buffer: the
  shards are copied into the unsharded parameters;
- after its forward a unit frees its unsharded parameters (``reshard_after_forward``), except
  the root, which keeps them until the end of backward (FSDP2's default for the root);
- in backward a unit is all-gathered again (the flat buffer freed at once), and the unit before
  it in forward order is all-gathered ahead (its flat buffer alive until its own backward);
- once a unit's backward is done (the gradients of its inputs are computed, or at the end of
  backward for a unit whose inputs need none, such as the root), its unsharded parameters are
  freed, its gradients are copied into a flat reduce-scatter input (padded, in the reduce
  dtype) and freed, and the reduce-scatter output (1/N of it) holds the unit's sharded
  gradients; the input stays alive until the next unit's reduce-scatter (FSDP2 keeps one), the
  last until the end of backward. On the CPU (gloo) the reduce-scatter also copies its input.

Units whose shards rest in host memory (`hr.offload` of the sharded model with
``store="cpu"``, or FSDP2's ``CPUOffloadPolicy``) keep shards, sharded gradients and the
optimizer's state on the host: on an accelerator the device holds the shard copies only during
the all-gather, and the reduce-scatter output until its copy to the host.

Collectives move no bytes in a dry run; their time is not priced by `hr.plan`.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from headroom.residency import AfterBackward

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
               "_backward_pre_hooks")
_STATE_DICT_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks",
                     "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


@dataclass(frozen=True)
class ShardSpec:
    """How a model is sharded, as the dry run replays it.

    Attributes:
        world: ranks in the (1-D) mesh.
        units: qualified names of the ``fully_shard``ed modules (``""``: the root), or
            ``None``: each block (found as `hr.offload` finds them) and the root.
        reshard: per unit name, whether it frees its unsharded parameters after forward;
            units not named: ``True`` for blocks, ``False`` for the root (FSDP2's defaults).
        host: names of the units whose shards rest in host memory.
        param_dtype, reduce_dtype: FSDP2's ``MixedPrecisionPolicy`` (``None``: the
            parameters' own dtype).
        device: the mesh's device, for a model already sharded (else ``None``).
    """

    world: int
    units: tuple[str, ...] | None = None
    reshard: dict[str, bool] = field(default_factory=dict)
    host: frozenset[str] = frozenset()
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    device: str | None = None


def check_world(world_size: Any, mesh: Any) -> int | None:
    """The world size given as ``world_size=`` or ``mesh=`` (a 1-D ``DeviceMesh``), or None.

    Raises:
        ValueError: ``world_size`` is not an int >= 1; a mesh that is not 1-D; both given and
            different.
        TypeError: ``mesh`` is not a ``DeviceMesh``.
    """
    world = None
    if world_size is not None:
        if isinstance(world_size, bool) or not hasattr(world_size, "__index__") \
                or int(world_size) < 1:
            raise ValueError(
                f"world_size must be an int >= 1 (the number of ranks FSDP2 shards over),"
                f" got {world_size!r}")
        world = int(world_size)
    if mesh is not None:
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh):
            raise TypeError(
                f"mesh must be a torch.distributed.device_mesh.DeviceMesh (the one given to"
                f" fully_shard), got {type(mesh).__name__}; or pass world_size=N")
        if mesh.ndim != 1:
            raise ValueError(
                f"mesh has {mesh.ndim} dimensions {tuple(mesh.shape)}; the estimate models"
                " FSDP2 over a 1-D mesh (no HSDP or tensor parallel): pass the data-parallel"
                " shard dimension, e.g. mesh['dp_shard'], or world_size=N")
        if world is not None and world != mesh.size():
            raise ValueError(
                f"world_size={world} but mesh has {mesh.size()} ranks; pass one of them")
        world = mesh.size()
    return world


# ------------------------------------------------------------------ a model already sharded
def fsdp_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the ``fully_shard``ed modules of ``model``."""
    if "torch.distributed.fsdp" not in sys.modules:  # nothing can be sharded yet
        return []
    from torch.distributed.fsdp import FSDPModule

    return [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]


def spec_of(model: nn.Module) -> ShardSpec:
    """The `ShardSpec` of a model whose modules were ``fully_shard``ed.

    Raises:
        ValueError: a mesh that is not 1-D (HSDP), or a root that is not ``fully_shard``ed.
    """
    units = fsdp_units(model)
    if not units or units[0][0] != "":
        raise ValueError(
            "the model's blocks are fully_shard'ed but the model itself is not: FSDP2 needs"
            " fully_shard(model) on the root too (after the blocks) before training; the"
            " estimate models that setup")
    world = None
    reshard: dict[str, bool] = {}
    host = set()
    pdt = rdt = None
    device = None
    for name, m in units:
        state = m._get_fsdp_state()
        group = state._fsdp_param_group
        if group is None:
            continue
        mesh = group.mesh_info.mesh
        if mesh.ndim != 1:
            raise ValueError(
                f"{name or 'the root'} is sharded over a {mesh.ndim}-D mesh (HSDP); the"
                " estimate models FSDP2 over a 1-D mesh")
        world = mesh.size()
        device = str(state._device)
        raf = group.post_forward_mesh_info is not None
        if name == "" and state._auto_reshard_after_forward:
            raf = False  # FSDP2 keeps the root unsharded after forward
        reshard[name] = raf
        if any(fp.offload_to_cpu for fp in group.fsdp_params):
            host.add(name)
        pdt = group.mp_policy.param_dtype
        rdt = group.mp_policy.reduce_dtype
    if rdt == pdt:
        rdt = None
    return ShardSpec(world or 1, tuple(n for n, _ in units), reshard, frozenset(host), pdt, rdt,
                     device)


def meta_copy(model: nn.Module) -> nn.Module:
    """A ``meta`` copy of a ``fully_shard``ed model as it was before ``fully_shard``: each
    parameter whole (its global shape), the modules of their own classes, no FSDP2 hooks or
    state (and no `hr.offload` record)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(tuple(p.shape), dtype=p.dtype, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    shells = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            base = next(c for c in type(m).__mro__[1:]
                        if not issubclass(c, FSDPModule))  # the class before fully_shard
            shell = base.__new__(base)
            memo[id(m)] = shell
            shells.append((m, shell))
    for m, shell in shells:
        d = {}
        for k, v in m.__dict__.items():
            if k.startswith("__composable_api") or k.startswith("_headroom_"):
                continue  # FSDP2's state, headroom's record of its store
            if k in _STATE_DICT_HOOKS:
                v = type(v)()
            elif k in _HOOK_DICTS:
                v = type(v)((i, h) for i, h in v.items()
                            if not isinstance(getattr(h, "__self__", None), FSDPState))
            d[k] = v
        for k in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                  "_forward_hooks_always_called"):
            if k in d:
                keep = set(d.get("_forward_pre_hooks", {})) | set(d.get("_forward_hooks", {}))
                d[k] = type(d[k])((i, v) for i, v in d[k].items() if i in keep)
        try:
            shell.__dict__.update(copy.deepcopy(d, memo))
        except Exception as e:
            raise TypeError(
                f"the estimator could not copy the sharded model onto the meta device"
                f" ({type(e).__name__}: {e}); estimate the model before fully_shard with"
                " world_size=N instead") from e
    return memo[id(model)] if id(model) in memo else copy.deepcopy(model, memo)


# ------------------------------------------------------------------ the dry run
def _padded_rows(rows: int, world: int) -> int:
    return math.ceil(rows / world) * world


class _Slot:
    __slots__ = ("owners", "shape", "numel", "padded", "master", "flat", "unsharded",
                 "requires_grad")

    def __init__(self, owners, p: nn.Parameter, world: int, dtype: torch.dtype,
                 host: bool, places: Any) -> None:
        self.owners = owners
        self.shape = tuple(p.shape)
        rows = self.shape[0] if self.shape else 1
        rest = math.prod(self.shape[1:]) if self.shape else 1
        prow = _padded_rows(rows, world)
        self.numel = p.numel()
        self.padded = prow * rest
        self.requires_grad = p.requires_grad
        shard_shape = (prow // world, *self.shape[1:]) if self.shape else (1,)
        # rank 0's shard: the padded one (the tensor the optimizer steps)
        master = torch.empty(shard_shape, dtype=p.dtype, device="meta")
        if host:
            places.on_host(master)
        self.master = nn.Parameter(master, requires_grad=p.requires_grad)
        flat = torch.empty(self.padded, dtype=dtype, device="meta")
        torch.ops.inductor.resize_storage_bytes_(flat, 0)
        self.flat = flat  # FSDP2's all-gather output of this parameter (padded)
        self.unsharded = nn.Parameter(flat[:self.numel].view(self.shape),
                                      requires_grad=p.requires_grad)

    def show(self, t: torch.Tensor) -> None:
        for module, attr in self.owners:
            module._parameters[attr] = t


class _Unit:
    def __init__(self, name: str, module: nn.Module, reshard: bool, host: bool) -> None:
        self.name = name
        self.module = module
        self.reshard = reshard
        self.host = host
        self.slots: list[_Slot] = []
        self.unsharded = False
        self.gathered: torch.Tensor | None = None  # all-gather output awaiting copy-out
        self.pending = False
        self.forward_indices: list[int] = []
        self.bwd_state = ""  # "", "pre" (in backward), "post" (reduce-scattered)


class ShardedDryRun:
    """FSDP2 over ``spec.world`` ranks on a dry run's ``meta`` model (see the module doc).

    Args:
        root: the ``meta`` copy of the whole model (unsharded; changed in place).
        spec: the sharding.
        places: where the dry run's tensors stand (host shards).
        accelerated: the target is an accelerator (host shards are copied to it and back).
    """

    def __init__(self, root: nn.Module, spec: ShardSpec, places: Any, *,
                 accelerated: bool) -> None:
        self.world = spec.world
        self.places = places
        self.accelerated = accelerated
        self.param_dtype = spec.param_dtype
        self.reduce_dtype = spec.reduce_dtype
        if spec.units is None:
            from headroom.residency import find_blocks

            names = {id(m): n for n, m in root.named_modules()}
            unit_names = [names[id(b)] for b in find_blocks(root) if id(b) in names]
            unit_names = [n for n in unit_names if n] + [""]
        else:
            unit_names = list(spec.units)
        # FSDP2 manages a parameter in the first fully_shard call that sees it: blocks first,
        # then the root (which gets the rest, tied ones included)
        order = [n for n in unit_names if n] + [""]
        self.units: list[_Unit] = []
        taken: set[int] = set()
        for name in order:
            module = root.get_submodule(name) if name else root
            unit = _Unit(name, module, spec.reshard.get(name, name != ""),
                         name in spec.host or "*" in spec.host)
            owners: dict[int, list[tuple[nn.Module, str]]] = {}
            params: dict[int, nn.Parameter] = {}
            for m in module.modules():
                for attr, p in m._parameters.items():
                    if p is None or id(p) in taken:
                        continue
                    params.setdefault(id(p), p)
                    owners.setdefault(id(p), []).append((m, attr))
            for pid, p in params.items():
                dtype = self.param_dtype if (self.param_dtype is not None
                                             and p.is_floating_point()) else p.dtype
                slot = _Slot(owners[pid], p, self.world, dtype, unit.host, places)
                slot.show(slot.master)
                unit.slots.append(slot)
                taken.update((pid, id(slot.master)))
            self.units.append(unit)
        self.root = self.units[-1]
        self.post_forward_order: list[_Unit] = []
        self.ag_state: torch.Tensor | None = None  # the last forward all-gather, kept
        self.rs_states: list[torch.Tensor] = []  # reduce-scatter inputs kept (FSDP2: one)
        self.link_bytes = 0
        self._bwd_task = -1
        for unit in self.units:
            unit.module.register_forward_pre_hook(partial(self._pre_forward, unit),
                                                  prepend=True, with_kwargs=True)
            unit.module.register_forward_hook(partial(self._post_forward, unit))

    def masters(self) -> list[nn.Parameter]:
        """The sharded parameters (what ``model.parameters()`` yields between steps)."""
        return [s.master for u in self.units for s in u.slots]

    def all_on_host(self) -> bool:
        return all(u.host for u in self.units if u.slots)

    # ------------------------------------------------------------------ all-gather
    def _unshard(self, unit: _Unit) -> None:
        if unit.unsharded or unit.pending or not unit.slots:
            return
        unit.pending = True
        if self.world == 1:
            return
        temps = []
        if unit.host and self.accelerated:  # each shard copied to the device first
            for s in unit.slots:
                temps.append(torch.empty(s.padded // self.world, dtype=s.master.dtype,
                                         device="meta"))
                self.link_bytes += temps[-1].numel() * temps[-1].element_size()
        if self.param_dtype is not None:  # cast for the all-gather input
            temps.append(torch.empty(sum(s.padded for s in unit.slots) // self.world,
                                     dtype=unit.slots[0].flat.dtype, device="meta"))
        unit.gathered = torch.empty(sum(s.padded for s in unit.slots),
                                    dtype=unit.slots[0].flat.dtype, device="meta")
        del temps

    def _wait(self, unit: _Unit, *, forward: bool) -> None:
        if not unit.pending:
            return
        unit.pending = False
        if forward and self.ag_state is not None:
            self.ag_state = None  # the previous unit's all-gather output
        for s in unit.slots:
            torch.ops.inductor.resize_storage_bytes_(s.flat, s.flat.numel()
                                                     * s.flat.element_size())
            s.show(s.unsharded)
            if s.unsharded.requires_grad != s.master.requires_grad:
                s.unsharded.requires_grad_(s.master.requires_grad)
        unit.unsharded = True
        if forward and self.world > 1:
            self.ag_state = unit.gathered
        unit.gathered = None

    def _reshard(self, unit: _Unit) -> None:
        if not unit.unsharded:
            return
        for s in unit.slots:
            s.show(s.master)
            torch.ops.inductor.resize_storage_bytes_(s.flat, 0)
        unit.unsharded = False

    # ------------------------------------------------------------------ forward
    def _pre_forward(self, unit: _Unit, module, args, kwargs):
        if torch._C._current_graph_task_id() != -1:  # recomputation (checkpointing)
            self._unshard(unit)
            self._wait(unit, forward=False)
            return None
        self._unshard(unit)
        self._wait(unit, forward=True)
        if not torch.is_grad_enabled():
            return None
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not idx:
            return None  # its backward ends at the end of backward (FSDP2 likewise)
        outs = AfterBackward.apply(partial(self._post_backward, unit), *[flat[i] for i in idx])
        outs = outs if isinstance(outs, tuple) else (outs,)
        for j, i in enumerate(idx):
            flat[i] = outs[j]
        from torch.utils._pytree import tree_unflatten

        return tree_unflatten(flat, spec)

    def _post_forward(self, unit: _Unit, module, args, output):
        if torch._C._current_graph_task_id() != -1:
            return None
        if unit.reshard:
            self._reshard(unit)
        unit.forward_indices.append(len(self.post_forward_order))
        self.post_forward_order.append(unit)
        if torch.is_grad_enabled():
            for t in _outputs(output):
                if t.requires_grad:
                    t.register_hook(partial(self._pre_backward, unit))
        if unit is self.root:
            self.ag_state = None  # the root frees the last all-gather output
        return None

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, unit: _Unit, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._bwd_task:
            self._bwd_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if unit.bwd_state:
            return
        unit.bwd_state = "pre"
        self._unshard(unit)
        self._wait(unit, forward=False)
        if unit.forward_indices:
            i = unit.forward_indices.pop()
            if i > 0:  # the unit before it in forward order, all-gathered ahead
                self._unshard(self.post_forward_order[i - 1])

    def _post_backward(self, unit: _Unit) -> None:
        if unit.bwd_state == "post":
            return
        unit.bwd_state = "post"
        grads = []
        with_grad = []
        for s in unit.slots:
            g = s.unsharded.grad
            if g is not None:
                grads.append(g)
                with_grad.append(s)
                s.unsharded.grad = None
        self._reshard(unit)
        while self.rs_states:
            self.rs_states.pop(0)
        if not grads:
            return
        reduce_dtype = self.reduce_dtype or grads[0].dtype
        total = sum(s.padded for s in with_grad)
        rs_in = torch.empty(total, dtype=reduce_dtype, device="meta")
        with torch.no_grad():
            off = 0
            for s, g in zip(with_grad, grads, strict=True):
                rs_in.narrow(0, off, s.numel).copy_(g.reshape(-1))
                off += s.padded
        del grads, g
        out = torch.empty(total // self.world, dtype=reduce_dtype, device="meta")
        if self.world > 1 and not self.accelerated:
            # gloo (the CPU's backend) reduce-scatters through a copy of the input
            scratch = rs_in.clone()
            del scratch
        orig = with_grad[0].master.dtype
        if out.dtype != orig:
            out = out.to(orig)
        off = 0
        for s in with_grad:
            n = s.padded // self.world
            piece = out.narrow(0, off, n).view(s.master.shape)
            off += n
            if unit.host and self.accelerated:
                # made as host memory before the tracker sees it
                with self.places.host_code(), torch.no_grad():
                    host = torch.empty(s.master.shape, dtype=orig, device="meta")
                    host.copy_(piece)
                self.link_bytes += host.numel() * host.element_size()
                piece = host
            p = s.master
            if p.grad is not None:
                with torch.no_grad():
                    p.grad.add_(piece)
            else:
                p.grad = piece
            for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
                hook(p)
        del out, piece
        self.rs_states.append(rs_in)

    def _end_backward(self) -> None:
        for unit in self.units:  # the root first, as FSDP2 walks its states
            if unit is self.root and unit.bwd_state != "post":
                self._post_backward(unit)
        for unit in self.units:
            if unit.bwd_state != "post":
                self._post_backward(unit)
        for unit in self.units:
            unit.bwd_state = ""
            unit.forward_indices.clear()
            unit.pending = False
            unit.gathered = None
        self.post_forward_order = []
        self.rs_states = []
        self._bwd_task = -1


def _outputs(output: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(output)
    out = [x for x in leaves if isinstance(x, torch.Tensor)]
    if out:
        return out
    stack = [output]
    while stack:  # model-output classes pytree does not know
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif hasattr(x, "__dict__") and not isinstance(x, nn.Module):
            stack.extend(vars(x).values())
    return out


def host_units(offload: Any, units: Iterable[str] | None) -> frozenset[str]:
    """The units whose shards rest in host memory under the ``offload=`` what-if of a sharded
    step: every unit, or those named in ``blocks``.

    Raises:
        ValueError: options that do not apply to a sharded model (a store on disk,
            ``compute_dtype``, unknown keys).
    """
    known = {"store", "prefetch", "blocks"}
    extra = set(offload) - known - {"compute_dtype", "module"}
    if extra:
        raise ValueError(f"offload= of a sharded step takes {sorted(known)}, not {sorted(extra)}")
    store = offload.get("store", "cpu")
    from headroom.store import Store

    if not (store in ("cpu", "host") or (isinstance(store, Store) and store.holds_host_memory)):
        raise ValueError(
            "offload= of a sharded step takes store='cpu' (each rank's shards in its host"
            " memory); the estimate does not model shards on disk yet, though hr.offload takes"
            " a DiskStore for a fully_shard'ed model. On an accelerator its device memory is"
            " that of store='cpu': estimate with store='cpu'")
    if offload.get("compute_dtype") is not None:
        raise ValueError(
            "offload= compute_dtype does not apply to a sharded step: FSDP2's"
            " MixedPrecisionPolicy(param_dtype=...) sets the dtype of the all-gathered units")
    if offload.get("module"):
        raise ValueError("offload= module does not apply to a sharded step (the whole model"
                         " is offloaded; choose units with blocks=)")
    blocks = offload.get("blocks")
    if blocks is None:
        return frozenset(["*"])
    return frozenset(blocks)


__all__ = ["ShardSpec", "ShardedDryRun", "check_world", "host_units", "meta_copy", "spec_of"]
