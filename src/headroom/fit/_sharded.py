"""FSDP2 (``fully_shard``) in a dry run: one rank's memory of a sharded training step.

`hr.estimate(..., world_size=N)` (or ``mesh=``, or a model already ``fully_shard``ed) runs the
step on a ``meta`` copy sharded by torch's own ``fully_shard`` (each block, then the root, or
the model's own units, with its ``MixedPrecisionPolicy`` and ``reshard_after_forward``), as
the rank that holds the most (rank 0: dim 0 of each parameter split in ``ceil(d0 / N)`` rows,
padded to a multiple of ``N``). Shards, all-gather and reduce-scatter buffers and unsharded
units are FSDP2's own; see [Note: FSDP2 itself in a dry run] for how it runs on ``meta``.

Units whose shards rest in host memory (`hr.offload` of the sharded model with
``store="cpu"``, or FSDP2's ``CPUOffloadPolicy``) run with ``CPUOffloadPolicy``: shards,
sharded gradients and the optimizer's state stay on the host; on an accelerator the device
holds the shard copies only during the all-gather, and the reduce-scatter output until its
copy to the host. On the CPU (gloo) a reduce-scatter also copies its input, as gloo does.

Collectives move no bytes in a dry run; their time is not priced by `hr.plan`.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import sys
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

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
# [Note: FSDP2 itself in a dry run]
# The dry run applies torch's own ``fully_shard`` to the ``meta`` copy, over a mesh of a fake
# process group (torch's ``FakeProcessGroup``: collectives that move nothing and return at
# once) built here and never made the default group: a user estimating inside a real
# distributed job keeps their process groups as they are, and the fake one is registered
# under a name of its own only while the dry run lives. Every buffer FSDP2 makes (padded
# shards, all-gather and reduce-scatter buffers, unsharded units, mixed-precision casts) is
# then FSDP2's own, so the estimate follows the installed torch.
#
# FSDP2 takes ``meta`` parameters only to ``to_empty`` them before a step; the dry run takes
# it through the step by changing the objects ``fully_shard`` made, never torch's code:
# - each parameter group skips its checks that parameters are materialized (and, with
#   ``CPUOffloadPolicy``, on the CPU): ``meta`` stands for the device, or for the host;
# - the groups and their parameters compute on ``meta``, the mesh's device staying ``cpu``;
#   FSDP2 looks a device's stream module up as ``torch.<device type>``, so while the step
#   runs (`ShardedDryRun.running`) ``torch.meta`` names ``torch.cpu``, whose streams and
#   events are no-ops, as ``meta``'s would be;
# - shards that rest in host memory are marked so (`headroom.store.Places`), and FSDP2's
#   copies of them to the device and of their reduced gradients back, no-ops between
#   ``meta`` tensors, are made as new ``meta`` tensors (`_HostCopies`);
# - on a CPU target each reduce-scatter also copies its input, as gloo does (the fake group
#   copies nothing).
# A torch whose FSDP2 lacks one of these attributes gets a clear error, not a wrong number;
# tests/memory/test_estimate_sharded.py checks the estimates byte for byte.
_FAKE_GROUPS = itertools.count()


def _fake_mesh(world: int) -> Any:
    """A 1-D ``cpu`` mesh of ``world`` ranks over a fake process group, this process rank 0
    (the rank that holds the padded rows); its group is registered under a name of its own."""
    from torch._C._distributed_c10d import (
        FakeProcessGroup,
        HashStore,
        ProcessGroup,
        _register_process_group,
    )
    from torch.distributed.device_mesh import DeviceMesh

    backend = FakeProcessGroup._create_internal(0, world)
    group = ProcessGroup(HashStore(), 0, world)
    group._set_default_backend(ProcessGroup.BackendType.CUSTOM)
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.CUSTOM, backend)
    group._set_group_name(f"headroom_dry_run_{next(_FAKE_GROUPS)}")
    _register_process_group(group.group_name, group)
    mesh = DeviceMesh("cpu", torch.arange(world), _init_backend=False, _rank=0)
    mesh._dim_group_names = [group.group_name]
    mesh._pg_registry[group.group_name] = group  # the registry above holds it weakly
    return mesh


class _HostCopies(TorchFunctionMode):
    """FSDP2's copies (``.to``) between host shards and the device, which are no-ops between
    ``meta`` tensors: to the device (of a host shard) and to ``cpu`` (a reduced gradient)
    make new tensors on an accelerator, counted in ``link_bytes`` of ``run``; on the CPU both
    are the tensor itself, as there."""

    def __init__(self, run: ShardedDryRun) -> None:
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.Tensor.to or not args[0].is_meta:
            return func(*args, **kwargs)
        t, run = args[0], self.run
        # a reduced gradient (floating point, in backward) copied to its host shard
        to_host = t.is_floating_point() and torch._C._current_graph_task_id() != -1 and any(
            isinstance(a, torch.device | str) and torch.device(a).type == "cpu"
            for a in (*args[1:], kwargs.get("device")))
        if not to_host and t.untyped_storage()._cdata not in run.places.host:
            return func(*args, **kwargs)
        if not run.accelerated:
            return t
        with run.places.host_code() if to_host else contextlib.nullcontext(), torch.no_grad():
            out = torch.empty_like(t)
        run.link_bytes += out.nbytes
        return out


class ShardedDryRun:
    """FSDP2 over ``spec.world`` ranks on a dry run's ``meta`` model: torch's ``fully_shard``
    of each unit (each block, then the root, or ``spec.units``) over a fake process group
    (see [Note: FSDP2 itself in a dry run]).

    Args:
        root: the ``meta`` copy of the whole model (unsharded; sharded in place).
        spec: the sharding.
        places: where the dry run's tensors stand (host shards).
        accelerated: the target is an accelerator (host shards are copied to it and back).

    Raises:
        RuntimeError: a torch without ``torch.distributed``, or whose FSDP2 cannot run in a
            dry run.
    """

    def __init__(self, root: nn.Module, spec: ShardSpec, places: Any, *,
                 accelerated: bool) -> None:
        if not torch.distributed.is_available():
            raise RuntimeError(
                "world_size=/mesh= estimates run torch's FSDP2, and this torch build has no"
                " torch.distributed: estimate on a build that has it (Linux wheels do)")
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        self.places = places
        self.accelerated = accelerated
        self.link_bytes = 0
        if spec.units is None:
            from headroom.residency import find_blocks

            names = {id(m): n for n, m in root.named_modules()}
            units = [names[id(b)] for b in find_blocks(root) if id(b) in names]
        else:
            units = list(spec.units)
        self.mesh = _fake_mesh(spec.world)
        self._close = weakref.finalize(self, _unregister, self.mesh._dim_group_names[0])
        mp = MixedPrecisionPolicy(param_dtype=spec.param_dtype, reduce_dtype=spec.reduce_dtype)
        self.all_host = True
        try:
            # inner units first (as FSDP2 needs), the root last: it gets the rest, tied
            # parameters included
            for name in sorted(dict.fromkeys([*units, ""]),
                               key=lambda n: -(n.count(".") + 1) if n else 0):
                host = name in spec.host or "*" in spec.host
                module = root.get_submodule(name) if name else root
                kw = {} if name not in spec.reshard else {
                    "reshard_after_forward": spec.reshard[name]}
                fully_shard(module, mesh=self.mesh, mp_policy=mp, **kw, offload_policy=(
                    CPUOffloadPolicy(False) if host else OffloadPolicy()))
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    self._to_meta(group, host, spec.world)
        except AttributeError as e:
            self.close()
            raise RuntimeError(
                f"this torch's FSDP2 ({torch.__version__}) cannot run in headroom's dry run"
                f" ({type(e).__name__}: {e}); estimate without world_size=/mesh=, or use a"
                " torch headroom states it supports") from e
        except BaseException:
            self.close()
            raise

    def _to_meta(self, group: Any, host: bool, world: int) -> None:
        meta = torch.device("meta")
        _replace(group, _validate_no_meta_params=_nothing, _validate_cpu_offload_params=_nothing,
                 device=meta, _all_gather_output=torch.empty(0, device=meta))
        for fp in group.fsdp_params:
            _replace(fp, device=meta)
            if host:
                self.places.on_host(fp.sharded_param._local_tensor)
                self.places.on_host(fp._sharded_param_data)
        if host:  # its all-gathers and reduce-scatters copy from and to the host
            _replace(group, **{m: partial(_with_mode, _HostCopies(self), getattr(group, m))
                               for m in ("unshard", "post_backward")})
        if not self.accelerated and world > 1:
            _replace(group, _reduce_scatter_comm=_gloo_reduce_scatter())
        self.all_host = self.all_host and host

    def all_on_host(self) -> bool:
        return self.all_host

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The context the dry run's steps run in; the fake process group is gone after it."""
        had = "meta" in vars(torch)
        try:
            if not had:
                torch.meta = torch.cpu  # see the Note
            yield
        finally:
            if not had:
                del torch.meta
            self.close()

    def close(self) -> None:
        """Unregisters the fake process group (idempotent; also when the dry run is dropped)."""
        self._close()


def _nothing() -> None:
    return None


def _replace(obj: Any, **attrs: Any) -> None:
    for name, value in attrs.items():
        getattr(obj, name)  # AttributeError where this torch's FSDP2 has no such attribute
        setattr(obj, name, value)


def _gloo_reduce_scatter() -> Any:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class GlooReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, *args, **kwargs):
            copy = input_tensor.clone()  # gloo reduce-scatters through a copy of its input
            del copy
            return super().__call__(output_tensor, input_tensor, *args, **kwargs)

    return GlooReduceScatter()


def _with_mode(mode: TorchFunctionMode, method: Any, *args: Any, **kwargs: Any) -> Any:
    with mode:
        return method(*args, **kwargs)


def _unregister(name: str) -> None:
    from torch._C._distributed_c10d import _unregister_process_group

    _unregister_process_group(name)


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
