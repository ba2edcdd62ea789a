"""Estimates of steps that use `hr.HostOptimizer`: what its state leaves on the device.

The dry run steps the optimizer class the host optimizer runs, on the device; this replaces its
state by what stays there (none on an accelerator; on ``cpu`` with state on disk, the slices in
flight during the step), the same bound `hr.plan` uses.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from headroom.memory._categories import CATEGORIES
from headroom.memory._estimate import Estimate


def apply_host_optimizer(est: Estimate, model: nn.Module, optimizer: Any) -> None:
    """Change ``est`` in place for ``optimizer`` (an `hr.HostOptimizer`)."""
    from headroom.planner._plan import Choice, _peak, _Run, _sizes

    options = optimizer.options
    on_disk = options.state_store != "cpu"
    if est.device == "cpu" and not on_disk:
        return  # host memory is the device's: the dry run already counts it where it is
    sizes = _sizes(model, est.device, options.optimizer_class,
                   {k: v for k, v in options.optimizer_kwargs.items() if k != "fused"})
    samples = [[s.by_category[c] for c in CATEGORIES] for s in est.timeline]
    run = _Run(est, samples, [s.phase == "optimizer" for s in est.timeline])
    choice = Choice(optimizer_state="disk" if on_disk else "host")
    peak, cats = _peak(run, choice, sizes, options.slice_bytes)
    if est.allocator and est.peak:
        peak = int(peak * est.peak / est.peak_reserved)  # back to tensor bytes
    est.peak = peak
    est.peak_by_category = cats
    est.bound = ("hr.HostOptimizer: optimizer state"
                 f" {'on disk' if on_disk else 'in host memory'}, counted at most as the slices in"
                 " flight during the step (an upper bound)")
