"""`estimate`: the memory of one training step, from a dry run on ``meta`` tensors.

The step runs under `track_memory`'s tracker with ``meta`` storages counted as the target's, so
every figure means what it means in a measured run; CUDA-like targets also get the caching
allocator model's ``allocated`` and ``reserved`` bytes.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from headroom.activations import DEFAULT_MIN_BYTES, DEFAULT_PREFETCH, offload_activations_dry_run
from headroom.fit import _dryrun
from headroom.memory import (
    CATEGORIES,
    CachingAllocatorModel,
    MemoryTracker,
    StorageInfo,
    format_bytes,
)
from headroom.memory._report import _atomic_write, advise, format_estimate, plot, to_dict


class _DryRunTracker(MemoryTracker):
    """The tracker, counting ``meta`` storages as ``device``'s (or, by ``places``, as host
    memory or nothing) and replaying them through ``allocator``."""

    def __init__(self, device: str, allocator: CachingAllocatorModel | None,
                 places: Any = None, **kwargs: Any):
        super().__init__(sample_allocator=False, **kwargs)
        self._meta_as = device
        self._target = device
        self._alloc_model = allocator
        self._places = places

    def _see(self, t, cat, *, check_size=False, force=False):
        st = None
        if isinstance(t, torch.Tensor) and (self._alloc_model is not None
                                            or self._places is not None):
            try:  # a DTensor's: its local shard's (FSDP2's shards)
                st = getattr(t, "_local_tensor", t).untyped_storage()
            except (RuntimeError, NotImplementedError):
                st = None
        known = st is not None and st._cdata in self._infos
        where = None
        if st is not None and not known and self._places is not None \
                and st.device.type == "meta":
            where = self._places.where(st._cdata)
            if where == "nowhere":
                return None
        if where == "host":
            self._meta_as = "cpu"
        try:
            info = super()._see(t, cat, check_size=check_size, force=force)
        finally:
            self._meta_as = self._target
        if (self._alloc_model is not None and st is not None and not known
                and info is not None and info.device == self._target):
            self._alloc_model.malloc(info.key, info.nbytes)
        return info

    def _freed(self, info: StorageInfo) -> None:
        if self._alloc_model is not None and info.device == self._target:
            self._alloc_model.free(info.key)
        super()._freed(info)

    def _resize(self, info: StorageInfo, nbytes: int) -> None:
        if self._alloc_model is not None and info.device == self._target:
            self._alloc_model.free(info.key)
            self._alloc_model.malloc(info.key, nbytes)
        super()._resize(info, nbytes)


class Estimate:
    """The estimated memory of one training step (see :func:`estimate`).

    Attributes:
        device: the device estimated, e.g. ``"cuda:0"``.
        peak: most bytes of tensors live at once on ``device`` (before allocator rounding).
        peak_by_category: bytes per category at that moment; they sum to ``peak``.
        max_by_category: each category's own maximum over the step.
        by_module: activation bytes saved for backward per module when activations peaked,
            largest first.
        allocator: on CUDA-like devices, the allocator model's ``peak_allocated``,
            ``peak_reserved`` and ``segments``; empty for ``cpu``.
        options: the what-if options the step ran with.
        ops: ``(flops, bytes, kind, in_optimizer_step)`` per op (`hr.plan`'s time model).
        activation_bytes_moved: with ``offload_activations``, the bytes sent to the store.
        transfers: with ``hr.offload`` or ``hr.HostOptimizer``, the bytes the step moves:
            ``disk_read``, ``disk_write``, and ``link`` (host <-> accelerator).
    """

    def __init__(self, tracker: MemoryTracker, device: str,
                 alloc: CachingAllocatorModel | None, options: dict[str, Any]) -> None:
        self.tracker = tracker
        self.device = device
        stats = tracker.stats(device) if device in tracker.devices else None
        self.peak = stats.peak if stats else 0
        self.peak_by_category = stats.peak_by_category if stats else dict.fromkeys(CATEGORIES, 0)
        self.max_by_category = stats.max_by_category if stats else dict.fromkeys(CATEGORIES, 0)
        self.by_module = tracker.by_module
        self.allocator: dict[str, int] = {}
        if alloc is not None:
            self.allocator = {
                "peak_allocated": alloc.peak_allocated,
                "peak_reserved": alloc.peak_reserved,
                "segments": alloc.segments_peak,
            }
        self.options = options
        self._context: dict[str, Any] | None = None
        self.ops: list[tuple[int, int, str, bool]] = []  # see headroom.fit._dryrun.OpCounter
        self.activation_bytes_moved = 0
        self.transfers: dict[str, int] = {}
        self._advice: list[str] | None = None

    @property
    def advice(self) -> list[str]:
        """What would cut the peak most, from a dry run with each technique (lines of text;
        computed on first use)."""
        if self._advice is None:
            self._advice = self._advise()
        return self._advice

    def _advise(self) -> list[str]:
        # for the plain step only
        ctx = self._context
        model = ctx["model"]() if ctx else None
        return [] if model is None else advise(model, ctx, device=self.device, base=self)

    @property
    def timeline(self):
        """The tracker's timeline of the dry run (its times are the dry run's)."""
        return self.tracker.timeline

    @property
    def peak_reserved(self) -> int:
        """What the device must have free: the allocator model's reserved bytes on CUDA-like
        devices, the peak itself on ``cpu``."""
        return self.allocator.get("peak_reserved", self.peak)

    def __repr__(self) -> str:
        return f"Estimate(device={self.device!r}, peak={format_bytes(self.peak)})"

    def report(self, *, file=None, top_modules: int = 10, advice: bool = True) -> str:
        """Print (to ``file``, default stdout) and return the table, as for `track_memory`,
        ending with :attr:`advice` unless ``advice=False``."""
        text = format_estimate(self, top_modules=top_modules, advice=advice)
        print(text, file=file)
        return text

    def to_dict(self) -> dict[str, Any]:
        """The tracker's JSON-ready data of the dry run, plus the estimate's own fields."""
        data = to_dict(self.tracker)
        data["format"] = "headroom.estimate/1"
        data["estimate"] = {
            "device": self.device,
            "peak": self.peak,
            "peak_by_category": self.peak_by_category,
            "allocator": self.allocator,
            "options": {k: repr(v) if not isinstance(v, (int, float, str, bool, type(None)))
                        else v for k, v in self.options.items()},
            "advice": self._advice or [],
        }
        return data

    def to_json(self, path) -> None:
        """Write :meth:`to_dict` as JSON to ``path``."""
        import json

        _atomic_write(path, json.dumps(self.to_dict(), indent=1).encode())

    def plot(self, path, *, title: str | None = None) -> None:
        """Write the dry run's step as a PNG, as `track_memory`'s plots, along the step's ops
        (the dry run's time and RSS say nothing about the device)."""
        plot(self.tracker, path, title=title or f"headroom estimate ({self.device})",
             x_axis="ops", rss=False)


def estimate(
    model: nn.Module,
    example_args: tuple | Any = (),
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: Any = None,
    device: str | torch.device | None = None,
    example_kwargs: dict[str, Any] | None = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    checkpoint: Iterable[str] = (),
    offload_activations: int | Mapping[str, int] | None = None,
    prepare: Callable[[nn.Module], nn.Module | None] | None = None,
    offload: Mapping[str, Any] | None = None,
    world_size: int | None = None,
    mesh: Any = None,
    autocast: torch.dtype | None = None,
    micro_batches: int = 1,
) -> Estimate:
    """Estimate the memory of one training step without running it on real tensors.

    The step is ``loss_fn(model(*example_args, **example_kwargs)).backward()``, then
    ``optimizer.step()`` and ``zero_grad()``, in steady state (the optimizer's state exists,
    gradients do not), on a ``meta`` copy of the model: nothing is allocated and ``model``
    (which may be on ``meta``) is not changed. `hr.offload` and `hr.HostOptimizer` run their
    own code in it. Store reads and writes are taken as done at once, so a CPU step whose disk
    lags behind backward can measure above it by the gradients not yet written (at most 64 MiB
    or one gradient).

    Args:
        model: the model, its parameters anywhere (``meta`` included), offloaded or not.
        example_args: the inputs of one step, a tuple (or a single tensor): their shapes and
            dtypes matter, and the values of integer and boolean ones (ids, masks, labels).
        loss_fn: maps the model's output to the scalar loss. Default: ``output.loss`` when the
            model returns one, else the sum of its (first) tensor output.
        optimizer: a ``torch.optim.Optimizer`` class, an instance (its class and
            hyperparameters; an `hr.HostOptimizer` also its options),
            `headroom.optim.HostOptimizerOptions` (what-if: the host optimizer), or a function
            of the parameters returning one. ``None``: forward and backward only.
        device: the device to estimate for, e.g. ``"cuda"``; default: the model's device
            (required on ``meta``). CUDA-like devices also get `Estimate.allocator`.
        example_kwargs: keyword inputs of the model.
        optimizer_kwargs: keyword arguments for ``optimizer`` when it is a class or factory.
        checkpoint: qualified names of submodules to run under non-reentrant activation
            checkpointing (what-if: the model itself is not changed).
        offload_activations: what-if: the step under ``hr.offload_activations`` with these
            options: ``min_bytes`` (an int; ``prefetch=0``) or a dict of ``min_bytes``,
            ``prefetch`` and ``modules`` (qualified names or submodules of ``model``), with the
            feature's defaults. ``None``: off.
        prepare: what-if hook: called with the ``meta`` copy before the step (it may change it
            in place or return a replacement), e.g. ``headroom.convert``.
        offload: what-if, for a model not offloaded yet: the step under ``hr.offload(model,
            **offload)``, options ``store`` (``"cpu"``, ``"disk"`` or a `hr.DiskStore`),
            ``prefetch``, ``blocks``, ``compute_dtype``, ``grad_accumulation``, and
            ``module`` (the submodule offloaded; default the model). With ``world_size``:
            ``{"store": "cpu"}`` (optionally ``blocks``), each rank's shards in host memory.
        world_size: what-if: the step of the rank holding the most under FSDP2 over this many
            ranks, ``fully_shard`` of each block and the root with FSDP2's defaults. A
            ``fully_shard``ed model is estimated over its own mesh without it.
        mesh: the 1-D ``DeviceMesh`` FSDP2 would shard over, instead of ``world_size``.
        autocast: what-if: the forward and the loss inside ``torch.autocast`` of the target
            device in this dtype (``torch.bfloat16`` or ``torch.float16``), PyTorch's own casts
            (see `headroom.fit._autocast`). ``None``: as the model runs (its regions for
            ``"meta"`` are the target's autocast).
        micro_batches: what-if: gradient accumulation, the inputs' first dimension split as
            ``tensor_split`` does: a forward and backward of ``loss / micro_batches`` per
            micro-batch (``loss_fn`` sees its output), then one optimizer step.

    Returns:
        An :class:`Estimate`.

    Raises:
        ValueError: ``device`` missing for a model on ``meta`` or not a torch device;
            ``autocast`` not ``None``, ``torch.float16`` or ``torch.bfloat16``;
            ``micro_batches`` not an int from 1 to the batch size; an ``offload=`` or
            ``offload_activations=`` option not above (or ``offload=`` for a model already
            offloaded); ``world_size`` not an int >= 1, a mesh not 1-D, either disagreeing
            with a sharded model's mesh, a store on disk for shards, or ``world_size`` for a
            model under `hr.offload`.
        TypeError: ``model`` is not an ``nn.Module``; the output has no loss and ``loss_fn``
            is not given; ``optimizer`` is not an optimizer class, instance or factory;
            ``mesh`` is not a ``DeviceMesh``.
        RuntimeError: the forward needs values a dry run does not know (``.item()`` or
            ``nonzero`` of what comes from floating-point inputs or parameters), naming the op.

    Example:
        >>> est = hr.estimate(model, (x,), optimizer=torch.optim.AdamW, device="cuda")
        >>> est.peak, est.peak_by_category["activations"]
        >>> est.report()
    """
    spec = _shard_spec(model, world_size, mesh, offload)
    target = _target_device(model, device if device is not None or spec is None
                            else spec.device)
    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    from headroom.fit._autocast import check_autocast

    amp_dtype = check_autocast(autocast, target)
    micro = _check_micro_batches(micro_batches, example_args, example_kwargs)
    checkpoint = list(checkpoint)  # once: an iterator is used up by its first pass
    options = {"loss_fn": loss_fn, "optimizer": optimizer, "checkpoint": checkpoint,
               "offload_activations": offload_activations, "prepare": prepare,
               "offload": offload, "world_size": None if spec is None else spec.world,
               "autocast": amp_dtype, "micro_batches": micro}
    features = sharded = None
    if spec is not None or _uses_features(model, optimizer, offload):
        # hr.offload, hr.HostOptimizer, FSDP2: their dry runs live with the features
        from headroom.fit._features import DryRunFeatures

        features = DryRunFeatures(model, optimizer, offload if spec is None else None, target)
    if spec is not None:
        from headroom.fit import _sharded

        if features.host is not None and not (isinstance(features.host.state_store, str)
                                              and features.host.state_store == "cpu"):
            raise ValueError(
                f"hr.HostOptimizer with state_store={features.host.state_store!r} does not"
                " take sharded (FSDP2) parameters; use state_store='cpu' (each rank keeps the"
                " state of its own shards in host memory)")
        meta_model = _dryrun.meta_copy(
            model, plain=_sharded.before_fully_shard if _sharded.fsdp_units(model) else None)
    elif features is not None:
        meta_model = features.meta_copy(model)
    else:
        meta_model = _dryrun.meta_copy(model)
    meta_model.train(model.training)
    if checkpoint:
        _dryrun.checkpoint_modules(meta_model, checkpoint)
    if prepare is not None:
        replaced = prepare(meta_model)
        if isinstance(replaced, nn.Module):
            meta_model = replaced
    if spec is not None:
        sharded = _sharded.ShardedDryRun(meta_model, spec, features.places,
                                         accelerated=target != "cpu")
    elif features is not None:
        features.install(meta_model)
    args, kwargs = _dryrun.to_meta((example_args, dict(example_kwargs or {})))
    loss_fn = loss_fn or _dryrun.default_loss
    params = [p for p in meta_model.parameters() if p.requires_grad]  # sharded ones: FSDP2's
    if features is not None:
        opt = features.optimizer(params, optimizer, dict(optimizer_kwargs or {}))
    else:
        opt = _dryrun.make_optimizer(optimizer, params, dict(optimizer_kwargs or {}))
    final = getattr(opt, "final_backward", None)  # the host optimizer steps during backward
    on_host = features.step_context if features is not None else contextlib.nullcontext
    if sharded is not None and sharded.all_host and features.host is None:
        on_host = features.places.host_code  # torch's optimizer steps the host shards

    act = _activation_options(offload_activations, model, meta_model)

    def kept() -> contextlib.AbstractContextManager:  # its stash counts what it moved
        # inside the tracker's hooks: it sees every saved tensor
        return (contextlib.nullcontext() if offload_activations is None
                else offload_activations_dry_run(**act))

    def inputs() -> list[Any]:  # made before the step, each dropped after its backward
        return [(args, kwargs)] if micro == 1 else _split_inputs(args, kwargs, micro)

    def step(parts: list[Any]) -> None:
        for i in range(micro):
            part_args, part_kwargs = parts[i]
            parts[i] = None
            last = i == micro - 1
            with final() if final is not None and last else contextlib.nullcontext():
                with attention.autocast(amp_dtype):
                    loss = loss_fn(meta_model(*part_args, **part_kwargs))
                if not isinstance(loss, torch.Tensor):
                    raise TypeError(f"loss_fn returned {type(loss).__name__}, not a tensor")
                if micro > 1:
                    loss = loss / micro
                del part_args, part_kwargs
                loss.backward()
                del loss
        if opt is not None:
            with on_host():
                opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            meta_model.zero_grad(set_to_none=True)

    alloc = CachingAllocatorModel() if target.split(":")[0] in _CACHING_ALLOCATORS else None
    attention = _dryrun.AttentionAsOnDevice(target.split(":")[0])
    # fork_rng: the caller's random state stays as it was; foreach: where torch.optim steps
    # the accelerator's tensors (not the host's)
    on_device = target.split(":")[0] != "cpu" and (features is None or (
        sharded is not None and features.host is None and not sharded.all_host))
    with sharded.running() if sharded is not None else contextlib.nullcontext(), \
            torch.random.fork_rng(devices=[]), attention, _dryrun.kernels_on_meta("fused"), \
            _dryrun.kernels_on_meta("foreach", on_device), _values_needed(), \
            _dryrun.RealTensorsAsMeta():
        if opt is not None:  # creates the state: the tracked step is a steady-state one
            with kept():
                step(inputs())
        parts = inputs()
        tracker = _DryRunTracker(target, alloc, None if features is None else features.places,
                                 model=meta_model, optimizer=opt)
        counter = _dryrun.OpCounter(lambda: tracker._in_optimizer > 0)
        if features is not None:
            features.mark()
        link = sharded.link_bytes if sharded is not None else 0
        with tracker, counter, kept() as stash:
            step(parts)
    est = Estimate(tracker, target, alloc, options)
    est.ops = counter.ops
    est.activation_bytes_moved = stash.moved if stash is not None else 0
    est.transfers = features.transfers() if features is not None else {}
    if sharded is not None and target != "cpu":
        est.transfers["link"] = est.transfers.get("link", 0) + sharded.link_bytes - link
    est._context = {"model": weakref.ref(model), "args": args, "kwargs": kwargs,
                    "loss_fn": options["loss_fn"], "optimizer": optimizer,
                    "optimizer_kwargs": optimizer_kwargs}
    if checkpoint or prepare is not None or offload_activations is not None or \
            features is not None or spec is not None or amp_dtype is not None or micro > 1:
        est._context = None  # advice is for the plain step
    return est


def _check_micro_batches(micro_batches: Any, args: tuple, kwargs: dict[str, Any] | None
                         ) -> int:
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) \
            or micro_batches < 1:
        raise ValueError(f"micro_batches= must be an int >= 1, got {micro_batches!r}")
    if micro_batches == 1:
        return 1
    batch = _batch_size(args, kwargs)
    if batch is None or batch < micro_batches:
        raise ValueError(
            f"micro_batches={micro_batches} splits the inputs' first dimension, but the batch"
            f" is {'not a tensor' if batch is None else batch}: pass at most the batch size")
    return micro_batches


def _batch_size(args: tuple, kwargs: dict[str, Any] | None) -> int | None:
    for t in tree_flatten((args, dict(kwargs or {})))[0]:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return t.shape[0]
    return None


def _split_inputs(args: tuple, kwargs: dict[str, Any], parts: int) -> list[tuple[tuple, dict]]:
    """Each micro-batch's inputs: batch-sized tensors ``tensor_split``, each piece cloned."""
    batch = _batch_size(args, kwargs)
    flat, spec = tree_flatten((args, kwargs))
    pieces = [t.tensor_split(parts) if isinstance(t, torch.Tensor) and t.dim() > 0
              and t.shape[0] == batch else None for t in flat]
    return [tree_unflatten([p[i].clone() if p is not None else t
                            for t, p in zip(flat, pieces, strict=True)], spec)
            for i in range(parts)]


def _activation_options(what_if: Any, model: nn.Module, meta_model: nn.Module) -> dict[str, Any]:
    """``offload_activations=`` as the dry run's options (``modules``: the copy's)."""
    if what_if is None:
        return {}
    if isinstance(what_if, Mapping):
        extra = set(what_if) - {"min_bytes", "prefetch", "modules"}
        if extra:
            raise ValueError(f"offload_activations= takes min_bytes, prefetch and modules,"
                             f" not {sorted(extra)}")
        out = {"min_bytes": what_if.get("min_bytes", DEFAULT_MIN_BYTES),
               "prefetch": what_if.get("prefetch", DEFAULT_PREFETCH)}
        for k, v in out.items():
            if isinstance(v, bool) or not hasattr(v, "__index__") or v < 0:
                raise ValueError(f"offload_activations= {k} must be an int >= 0, got {v!r}")
            out[k] = int(v)
        if what_if.get("modules") is not None:
            out["modules"] = _meta_modules(what_if["modules"], model, meta_model)
        return out
    if isinstance(what_if, bool) or not isinstance(what_if, int) or what_if < 0:
        raise ValueError(
            f"offload_activations= is min_bytes (an int >= 0) or a dict(min_bytes=...,"
            f" prefetch=..., modules=...), got {what_if!r}")
    return {"min_bytes": what_if, "prefetch": 0}


def _meta_modules(given: Any, model: nn.Module, meta_model: nn.Module) -> list[nn.Module]:
    """The ``meta`` copy's submodules for ``given`` (names, or submodules of ``model``)."""
    if isinstance(given, (str, nn.Module)):
        given = [given]
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for g in given:
        name = names.get(id(g)) if isinstance(g, nn.Module) else g
        if not isinstance(name, str):
            raise ValueError(
                f"offload_activations= modules must be qualified names or submodules of the"
                f" model, got {g!r}")
        try:
            out.append(meta_model.get_submodule(name))
        except AttributeError:
            raise ValueError(
                f"offload_activations= modules: the model has no submodule {name!r}") from None
    return out


def _shard_spec(model: nn.Module, world_size: Any, mesh: Any, offload: Any) -> Any:
    """The step's FSDP2 `ShardSpec`: the model's own, else ``world_size=``/``mesh=``'s, or None."""
    from headroom.fit import _sharded
    from headroom.residency import offload_states

    world = _sharded.check_world(world_size, mesh)
    if isinstance(model, nn.Module) and _sharded.fsdp_units(model):
        spec = _sharded.spec_of(model)
        if world is not None and world != spec.world:
            raise ValueError(
                f"the model is fully_shard'ed over {spec.world} ranks, but world_size/mesh say"
                f" {world}: a sharded model is estimated over its own mesh; drop world_size="
                " and mesh=, or estimate the model before fully_shard with world_size=N")
        if offload is not None:
            raise ValueError(
                "offload= is a what-if for a model not offloaded yet; a fully_shard'ed model is"
                " estimated as it is: drop offload=, or estimate the model before fully_shard"
                " with world_size=N and offload={'store': 'cpu'}")
        return spec
    if world is None:
        return None
    if isinstance(model, nn.Module) and offload_states(model):
        raise ValueError(
            "world_size= estimates FSDP2 of a model not offloaded yet, and fully_shard cannot"
            " wrap a model under hr.offload: estimate the model before hr.offload with"
            " world_size=N and offload={'store': 'cpu'}")
    host = frozenset() if offload is None else _sharded.host_units(offload)
    return _sharded.ShardSpec(world, host=host)


def _uses_features(model: nn.Module, optimizer: Any, offload: Any) -> bool:
    from headroom.residency import offload_states

    if offload is not None or offload_states(model):
        return True
    options = getattr(optimizer, "options", optimizer)
    return hasattr(options, "state_store") and hasattr(options, "optimizer_class")


def parse_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` (it need not exist here), or a ValueError naming it."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"device {device!r} is not a torch device ({' '.join(str(e).split())}); pass e.g."
            " device=\"cuda\", \"cuda:1\" or \"cpu\""
        ) from None


def _target_device(model: nn.Module, device: str | torch.device | None) -> str:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if device is None:
        from headroom.residency import offload_states

        states = [state for _, _, state in offload_states(model)]
        p = next(iter([*model.parameters(), *model.buffers()]), None)
        if states:  # its parameters are masters in a store: the device is the offload's
            device = states[0].device
    if device is None:
        if p is None or p.device.type == "meta":
            raise ValueError(
                "the model is on the meta device (or has no parameters): say which device to"
                " estimate for, e.g. device=\"cuda\""
            )
        device = p.device
    dev = parse_device(device)
    if dev.type == "meta":
        raise ValueError("device='meta' takes no memory; estimate for e.g. device='cuda'")
    if dev.type == "cpu":
        return "cpu"
    return f"{dev.type}:{dev.index or 0}"


_CACHING_ALLOCATORS = ("cuda", "xpu", "hip", "mtia")


@contextlib.contextmanager
def _values_needed():
    """Turns the error of an op that needs values on ``meta`` into one that says why."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    except (NotImplementedError, RuntimeError) as e:
        text = str(e)
        if "meta" in text or "item()" in text or "data-dependent" in text.lower():
            raise RuntimeError(
                "the dry run hit an op that needs tensor values it does not know"
                f" ({text.splitlines()[0][:300]}): it knows those of integer and boolean inputs"
                " and what is computed from them alone, not of floating-point inputs or"
                " parameters. Move a branch on those (.item(), nonzero) out of the forward, or"
                " measure with hr.track_memory()."
            ) from e
        raise
