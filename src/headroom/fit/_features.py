"""headroom's own features in a dry run: parameter offload and the host optimizer.

`hr.estimate` asks this module (lazily: the memory layer imports nothing above it when it
loads) whenever the step uses `hr.offload` (a model already offloaded, or the ``offload=``
what-if) or an `hr.HostOptimizer` (an instance, or its options). `DryRunFeatures` then makes the
``meta`` copy of the model without the offload machinery, installs `OffloadDryRun` on it and
builds a `DryHostOptimizer` (the host optimizer itself, over meta stores), so the dry run keeps
on the device what the real schedule keeps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from headroom.fit import _dryrun
from headroom.optim import DryHostOptimizer
from headroom.residency import OffloadConfig, OffloadDryRun, configs_of
from headroom.store import Places

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks", "_backward_hooks", "_backward_pre_hooks")


def host_options(optimizer: Any) -> Any:
    """The `HostOptimizerOptions` of an `hr.HostOptimizer` (an instance or its options)."""
    options = getattr(optimizer, "options", optimizer)
    if all(hasattr(options, k) for k in ("optimizer_class", "state_store", "slice_bytes",
                                         "overlap", "bucket_bytes")):
        return options
    return None


def offload_config(what_if: Mapping[str, Any] | OffloadConfig) -> OffloadConfig:
    """The ``offload=`` what-if of `hr.estimate` as an `OffloadConfig`.

    Raises:
        ValueError: an unknown key, or a store that is neither host memory nor a disk.
    """
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
    """Parameter offload and the host optimizer, as a dry run of one step runs them.

    Args:
        model: the user's model (offloaded or not; not changed).
        optimizer: what `hr.estimate` was given as ``optimizer=``.
        offload: the ``offload=`` what-if, or ``None``.
        target: the device estimated (``"cpu"``, ``"cuda:0"``, ...).
    """

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
        self.sims: list[OffloadDryRun] = []

    def meta_copy(self, model: nn.Module) -> nn.Module:
        """A ``meta`` copy of ``model`` as it was before `hr.offload` (hooks and guards left
        out), or a plain meta copy of a model that is not offloaded."""
        from headroom.residency import MODULE_ATTRS, is_offload_hook

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
            for attr in _HOOK_DICTS:
                hooks = m.__dict__.get(attr)
                if hooks:
                    memo[id(hooks)] = type(hooks)(
                        (k, v) for k, v in hooks.items()
                        if not is_offload_hook(getattr(v, "hook", v)))
        copy = _dryrun.meta_copy(model, memo=memo)
        for m in copy.modules():
            for attr in MODULE_ATTRS:
                m.__dict__.pop(attr, None)
            base = type(m).__dict__.get("_headroom_base")
            if base is not None:
                m.__class__ = base
        return copy

    def install(self, meta_model: nn.Module) -> None:
        """Offload the copy as the configurations say (after `hr.convert` and checkpointing)."""
        for c in self.configs:
            self.sims.append(OffloadDryRun(meta_model, c, self.places, accelerated=not self.cpu))

    def optimizer(self, params: list[nn.Parameter], base: Any,
                  kwargs: dict[str, Any]) -> torch.optim.Optimizer | None:
        """The dry run's optimizer: the host optimizer's, or ``base`` as `hr.estimate` makes it."""
        if self.host is not None:
            options = self.host
            if kwargs:
                from dataclasses import replace

                options = replace(options, optimizer_kwargs={**options.optimizer_kwargs,
                                                             **kwargs})
            self._opt = DryHostOptimizer(params, options, self.places, self.sims, cpu=self.cpu)
            return self._opt
        opt = _dryrun.make_optimizer(base, params, kwargs)
        masters = {id(s.master) for sim in self.sims for s in sim.slots}
        if opt is not None and self.sims and all(id(p) in masters for p in params):
            # every parameter is a master in a store: torch's optimizer steps them on the host
            self._host_step = True
        return opt

    _host_step = False
    _opt: Any = None
    _mark: dict[str, int] | None = None

    def _totals(self) -> dict[str, int]:
        out = {"disk_read": 0, "disk_write": 0, "link": 0}
        stores = [sim.store for sim in self.sims]
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
        """Bytes moved since `mark`: read from and written to disk, over the host link."""
        now, before = self._totals(), self._mark or {}
        return {k: v - before.get(k, 0) for k, v in now.items()}

    def step_context(self) -> contextlib.AbstractContextManager:
        """Around ``optimizer.step()``: host memory when the optimizer steps host masters."""
        return self.places.host_code() if self._host_step else contextlib.nullcontext()


__all__ = ["DryRunFeatures", "host_options", "offload_config"]
