"""headroom's own features in a dry run: `hr.offload` (its own code, `offload_dry_run`, into
`MetaStore`s moved by an `InstantMover`) and the host optimizer (`DryHostOptimizer`).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from headroom.fit import _dryrun
from headroom.fit._sharded import _HOOK_DICTS, _STATE_DICT_HOOKS
from headroom.optim import DryHostOptimizer
from headroom.residency import Offload, offload_dry_run, offload_states
from headroom.store import MetaStore, Places
from headroom.transfer import MAX_STAGED_BYTES, Mover, ParamBinding, Ticket


@dataclass(frozen=True)
class OffloadConfig:
    """The options of one `hr.offload` call (see there), as a dry run replays them:
    ``module`` (``""``: the model), ``store`` (``"host"`` or ``"disk"``), ``blocks`` and
    ``kept`` (names inside ``module``; ``None``: as `hr.offload` chooses)."""

    module: str = ""
    store: str = "host"
    prefetch: int = 1
    blocks: tuple[str, ...] | None = None
    compute_dtype: torch.dtype | None = None
    grad_accumulation: str = "store"
    adapters: str = "device"
    kept: tuple[str, ...] | None = None


def configs_of(model: nn.Module) -> list[OffloadConfig]:
    """The `OffloadConfig` of every `hr.offload` applied to ``model`` or its submodules."""
    out = []
    for name, m, state in offload_states(model):
        inner = {id(sub): n for n, sub in m.named_modules()}
        kept = tuple(n for n, p in m.named_parameters(remove_duplicate=False)
                     if state.kept.get(id(p)) is p)
        out.append(OffloadConfig(
            module=name,
            store="host" if state.store.holds_host_memory else "disk",
            prefetch=state.prefetch,
            blocks=tuple(inner[id(b.module)] for b in state.blocks),
            compute_dtype=state.compute_dtype,
            grad_accumulation=state.grad_accumulation,
            adapters=getattr(state, "adapters", "device"),
            kept=kept,
        ))
    return out


def is_offload_hook(fn: Any) -> bool:
    """Whether a module hook belongs to an `hr.offload` state (not copied into dry runs)."""
    # hr.offload registers its hooks wrapped by torch.compiler.disable
    fn = getattr(fn, "_torchdynamo_orig_callable", fn)
    while isinstance(fn, partial):
        if any(isinstance(a, Offload) for a in fn.args):
            return True
        fn = fn.func
    if isinstance(getattr(fn, "__self__", None), Offload):
        return True
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            if isinstance(cell.cell_contents, Offload):
                return True
        except ValueError:  # an empty cell
            continue
    return False


class InstantMover(Mover):
    """`headroom.transfer.Mover` for a dry run's `MetaStore`: every copy is done when it starts
    (a gradient written to disk is gone when handed over). On an accelerator the link's bytes
    are counted, and gradients sent to the host stay on the device until reaped: past
    `MAX_STAGED_BYTES` in flight, and at `synchronize` (the end of backward).
    """

    def __init__(self, store: MetaStore, *, accelerated: bool) -> None:
        super().__init__("meta", store)
        self.link = accelerated
        self._sent: deque[torch.Tensor] = deque()
        self._sent_bytes = 0

    def fetch_many(self, items: list, *, after: Any = None, batch: Any = None) -> list[Ticket]:
        tickets = []
        for h, dst in items:
            host = self.store.host_tensor(h)
            if host is None:
                self.store.read(h, out=dst)
            else:
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(dst):
                    dst.detach().copy_(host)
                if self.link:
                    self.store.read_bytes += h.nbytes
            tickets.append(Ticket(dst, done=True))
        return tickets

    def push_grad(self, grad: torch.Tensor, b: ParamBinding, *, accumulate: bool) -> None:
        gh = b.grad_handle
        b.has_grad = True
        if self.link:  # on the device until its copy to the host is reaped
            self._sent.append(grad)
            self._sent_bytes += grad.numel() * grad.element_size()
            while self._sent_bytes > MAX_STAGED_BYTES:
                done = self._sent.popleft()
                self._sent_bytes -= done.numel() * done.element_size()
        host = self.store.host_tensor(gh)
        with torch.no_grad():
            if host is not None:
                host.add_(grad) if accumulate else host.copy_(grad)
                if self.link:
                    self.store.written_bytes += gh.nbytes
                return
            if accumulate:  # read, add, write back
                self.store.read_bytes += gh.nbytes
            if grad.dtype != gh.dtype:
                grad = grad.to(gh.dtype)  # the disk write gets a copy in its dtype
            self.store.write(gh, grad)

    def synchronize(self) -> None:
        self._sent.clear()
        self._sent_bytes = 0


def host_options(optimizer: Any) -> Any:
    """The `HostOptimizerOptions` of an `hr.HostOptimizer` (an instance or its options)."""
    options = getattr(optimizer, "options", optimizer)
    if all(hasattr(options, k) for k in ("optimizer_class", "state_store", "slice_bytes",
                                         "overlap", "bucket_bytes")):
        return options
    return None


def offload_config(what_if: Mapping[str, Any] | OffloadConfig) -> OffloadConfig:
    """The ``offload=`` what-if of `hr.estimate` as an `OffloadConfig` (or a ValueError)."""
    if isinstance(what_if, OffloadConfig):
        return what_if
    known = {"store", "prefetch", "blocks", "compute_dtype", "grad_accumulation", "module"}
    extra = set(what_if) - known
    if extra:
        raise ValueError(
            f"offload= takes hr.offload's options {sorted(known - {'module'})} (and module=, the"
            f" submodule offloaded), not {sorted(extra)}")
    store = what_if.get("store", "cpu")
    from headroom.store import Store

    if (isinstance(store, Store) and not store.holds_host_memory) or store == "disk":
        kind = "disk"
    elif store in ("cpu", "host"):
        kind = "host"
    else:
        raise ValueError(f"offload= store must be 'cpu', 'disk' or a hr.DiskStore, got {store!r}")
    blocks = what_if.get("blocks")
    return OffloadConfig(module=what_if.get("module", ""), store=kind,
                         prefetch=int(what_if.get("prefetch", 1)),
                         blocks=None if blocks is None else tuple(blocks),
                         compute_dtype=what_if.get("compute_dtype"),
                         grad_accumulation=what_if.get("grad_accumulation", "store"))


class DryRunFeatures:
    """Parameter offload and the host optimizer in a dry run of ``model`` (not changed), from
    `hr.estimate`'s ``optimizer=`` and ``offload=``, for the device ``target``."""

    def __init__(self, model: nn.Module, optimizer: Any, offload: Any, target: str) -> None:
        self.places = Places()
        self.configs = configs_of(model)
        if offload is not None:
            if self.configs:
                raise ValueError(
                    "offload= is a what-if for a model that is not offloaded yet; this one is"
                    " (its own hr.offload is estimated): drop offload=")
            self.configs = [offload_config(offload)]
        self.host = host_options(optimizer)
        self.cpu = target == "cpu"
        self.offloads: list[Offload] = []  # the dry run's own hr.offload states

    def meta_copy(self, model: nn.Module) -> nn.Module:
        """A ``meta`` copy of ``model`` as it was before `hr.offload`."""
        from headroom.residency import MODULE_ATTRS

        memo: dict[int, Any] = {}
        offloaded = False
        for m in model.modules():
            for attr in MODULE_ATTRS:
                obj = m.__dict__.get(attr)
                if obj is not None:
                    memo[id(obj)] = None
                    offloaded = True
            if not offloaded:
                continue
            for attr in (*_HOOK_DICTS, *_STATE_DICT_HOOKS):
                hooks = m.__dict__.get(attr)
                if hooks:
                    memo[id(hooks)] = type(hooks)(
                        (k, v) for k, v in hooks.items()
                        if not is_offload_hook(getattr(v, "hook", v)))

        def plain(m: nn.Module) -> tuple[type, dict] | None:
            base = type(m).__dict__.get("_headroom_base")
            if base is None and not any(a in m.__dict__ for a in MODULE_ATTRS):
                return None
            return base or type(m), {k: v for k, v in m.__dict__.items() if k not in MODULE_ATTRS}

        return _dryrun.meta_copy(model, memo=memo, plain=plain)

    def install(self, meta_model: nn.Module) -> None:
        """Offload the copy as the configurations say (after `hr.convert` and checkpointing)."""
        for c in self.configs:
            module = meta_model.get_submodule(c.module) if c.module else meta_model
            store = MetaStore(self.places, host=c.store == "host")
            state = offload_dry_run(
                module, store, prefetch=c.prefetch, compute_dtype=c.compute_dtype,
                blocks=None if c.blocks is None else [module.get_submodule(n) for n in c.blocks],
                grad_accumulation=c.grad_accumulation, adapters=c.adapters, kept=c.kept)
            state.res.mover = InstantMover(store, accelerated=not self.cpu)
            # a CPU target's frozen device copies show their masters' memory, as for real
            state.res.shares = self.cpu and store.host
            self.offloads.append(state)

    def optimizer(self, params: list[nn.Parameter], base: Any,
                  kwargs: dict[str, Any]) -> torch.optim.Optimizer | None:
        """The dry run's host optimizer, or ``base`` as `hr.estimate` makes it."""
        if self.host is not None:
            options = self.host
            if kwargs:
                from dataclasses import replace

                options = replace(options, optimizer_kwargs={**options.optimizer_kwargs,
                                                             **kwargs})
            self._opt = DryHostOptimizer(params, options, self.places, cpu=self.cpu)
            return self._opt
        opt = _dryrun.make_optimizer(base, params, kwargs)
        masters = {id(s.param) for st in self.offloads for s in st.slots}
        if opt is not None and self.offloads and all(id(p) in masters for p in params):
            # every parameter is a master in a store: torch's optimizer steps them on the host
            self._host_step = True
        return opt

    _host_step = False
    _opt: Any = None
    _mark: dict[str, int] | None = None

    def _totals(self) -> dict[str, int]:
        out = {"disk_read": 0, "disk_write": 0, "link": 0}
        stores = [st.store for st in self.offloads]
        if isinstance(self._opt, DryHostOptimizer):
            stores += self._opt.stores()
            out["link"] += self._opt.link_bytes
        for st in stores:
            if not st.host:
                out["disk_read"] += st.read_bytes
                out["disk_write"] += st.written_bytes
            elif not self.cpu:
                out["link"] += st.read_bytes + st.written_bytes
        return out

    def mark(self) -> None:
        """Start counting transfers (before the tracked step)."""
        self._mark = self._totals()

    def transfers(self) -> dict[str, int]:
        """Bytes moved since `mark`, by way: ``disk_read``, ``disk_write``, ``link``."""
        now, before = self._totals(), self._mark or {}
        return {k: v - before.get(k, 0) for k, v in now.items()}

    def step_context(self) -> contextlib.AbstractContextManager:
        """Around ``optimizer.step()``: host memory when the optimizer steps host masters."""
        return self.places.host_code() if self._host_step else contextlib.nullcontext()
