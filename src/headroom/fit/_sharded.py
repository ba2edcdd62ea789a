"""FSDP2 (``fully_shard``) in a dry run: one rank's memory of a sharded training step.

The ``meta`` copy is sharded by torch's own ``fully_shard`` (see [Note: FSDP2 itself in a dry
run]), as the rank holding the most (rank 0: padded rows). Units resting in host memory run
with ``CPUOffloadPolicy``. Collectives move no bytes; `hr.plan` does not price their time.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import weakref
from collections.abc import Iterator
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
        units: names of the ``fully_shard``ed modules (``""``: the root), or ``None``: each
            block and the root.
        reshard: per unit, ``reshard_after_forward`` (unnamed units: FSDP2's defaults).
        host: names of the units whose shards rest in host memory (``"*"``: all).
        param_dtype, reduce_dtype: FSDP2's ``MixedPrecisionPolicy``.
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
    """The world size given as ``world_size=`` or ``mesh=`` (a 1-D ``DeviceMesh``), or None;
    a ValueError or TypeError for anything else."""
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
    """The `ShardSpec` of a ``fully_shard``ed model; a ValueError for HSDP or an unsharded root."""
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
    return ShardSpec(world or 1, tuple(n for n, _ in units), reshard, frozenset(host), pdt,
                     None if rdt == pdt else rdt, device)


def before_fully_shard(m: nn.Module) -> tuple[type, dict] | None:
    """A module's class and ``__dict__`` as before ``fully_shard`` (and `hr.offload`), for
    `_dryrun.meta_copy`; ``None`` for a module not sharded."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    if not isinstance(m, FSDPModule):
        return None
    base = next(c for c in type(m).__mro__[1:] if not issubclass(c, FSDPModule))
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
    return base, d


# ------------------------------------------------------------------ the dry run
# [Note: FSDP2 itself in a dry run]
# torch's own ``fully_shard`` shards the ``meta`` copy over a mesh of a ``FakeProcessGroup``
# (collectives that move nothing), never the default group and registered under a name of its
# own only while the dry run lives, so a real job's groups stay as they are. Every buffer
# (padded shards, all-gather and reduce-scatter buffers, mixed-precision casts) is FSDP2's own.
# The dry run patches the objects ``fully_shard`` made, never torch's code:
# - parameter groups skip their checks that parameters are materialized (and on the CPU);
# - groups and parameters compute on ``meta``; FSDP2 finds streams in ``torch.<device type>``,
#   so while the step runs ``torch.meta`` names ``torch.cpu`` (no-op streams);
# - host shards are marked (`headroom.store.Places`) and FSDP2's copies to and from them,
#   no-ops between ``meta`` tensors, made new tensors (`_HostCopies`);
# - on a CPU target each reduce-scatter copies its input, as gloo does.
# A torch whose FSDP2 lacks one of these attributes gets a clear error, not a wrong number
# (tests/memory/test_estimate_sharded.py checks the estimates byte for byte).
_FAKE_GROUPS = itertools.count()


def _fake_mesh(world: int) -> Any:
    """A 1-D ``cpu`` mesh of ``world`` ranks over a fake process group, this process rank 0."""
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
    """FSDP2's copies (``.to``) of host shards to the device and of reduced gradients back: new
    tensors on an accelerator (counted in ``run.link_bytes``), the tensor itself on the CPU."""

    def __init__(self, run: ShardedDryRun) -> None:
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.Tensor.to or not args[0].is_meta:
            return func(*args, **kwargs)
        t, run = args[0], self.run
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
    """``fully_shard`` of ``root`` (the ``meta`` copy, in place) as ``spec`` says, over a fake
    process group (see [Note: FSDP2 itself in a dry run]); ``places`` marks host shards,
    ``accelerated`` says they are copied to the device and back. A RuntimeError where this
    torch's FSDP2 cannot run in a dry run."""

    def __init__(self, root: nn.Module, spec: ShardSpec, places: Any, *,
                 accelerated: bool) -> None:
        if not torch.distributed.is_available():
            raise RuntimeError(
                "world_size=/mesh= estimates run torch's FSDP2, and this torch build has no"
                " torch.distributed: estimate on a build that has it (Linux wheels do)")
        from torch._C._distributed_c10d import _unregister_process_group
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        self.places = places
        self.accelerated = accelerated
        self.link_bytes = 0
        from headroom.fit._dryrun import block_names

        units = block_names(root) if spec.units is None else list(spec.units)
        self.mesh = _fake_mesh(spec.world)
        self._close = weakref.finalize(self, _unregister_process_group,
                                       self.mesh._dim_group_names[0])
        mp = MixedPrecisionPolicy(param_dtype=spec.param_dtype, reduce_dtype=spec.reduce_dtype)
        self.all_host = True
        try:
            # inner units first, the root last: it gets the rest, tied parameters included
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
        _replace(group, _validate_no_meta_params=lambda: None,
                 _validate_cpu_offload_params=lambda: None, device=meta,
                 _all_gather_output=torch.empty(0, device=meta))
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

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The context of the dry run's steps; the fake process group is gone after it."""
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
        """Unregisters the fake process group (idempotent)."""
        self._close()


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


def host_units(offload: Any) -> frozenset[str]:
    """The units resting in host memory under ``offload=`` of a sharded step (``"*"``: all);
    a ValueError for options that do not apply to a sharded model."""
    known = {"store", "prefetch", "blocks"}
    extra = set(offload) - known - {"compute_dtype", "module"}
    if extra:
        raise ValueError(f"offload= of a sharded step takes {sorted(known)}, not {sorted(extra)}")
    store = offload.get("store", "cpu")
    from headroom.store import Store

    if not (store in ("cpu", "host") or (isinstance(store, Store) and store.holds_host_memory)):
        raise ValueError(
            "offload= of a sharded step takes store='cpu': the estimate does not model shards"
            " on disk, whose device memory on an accelerator is that of store='cpu'")
    if offload.get("compute_dtype") is not None:
        raise ValueError(
            "offload= compute_dtype does not apply to a sharded step: FSDP2's"
            " MixedPrecisionPolicy(param_dtype=...) sets the dtype of the all-gathered units")
    if offload.get("module"):
        raise ValueError("offload= module does not apply to a sharded step (the whole model"
                         " is offloaded; choose units with blocks=)")
    blocks = offload.get("blocks")
    return frozenset(["*"] if blocks is None else blocks)
