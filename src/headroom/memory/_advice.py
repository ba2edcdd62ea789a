"""Advice at the end of reports: what would cut the peak most, from dry runs of the step.

The figures come from `headroom.fit` through `headroom._providers`, which memory/ never imports.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from headroom.memory._tracker import MemoryTracker


def tracker_advice(mem: MemoryTracker) -> list[str]:
    ctx = mem._context
    if not ctx:
        return []
    if "advice" in ctx:  # computed once: a report printed and written costs one set of dry runs
        return ctx["advice"]
    model = ctx["model"]()
    if model is None:
        return ["(no advice: the model that ran is no longer alive; report before it is freed)"]
    if _fsdp_sharded(model):
        ctx["advice"] = ["(no advice: the model is sharded with FSDP2 (fully_shard), whose"
                         " collectives the dry runs do not model; the figures above are this"
                         " rank's)"]
        return ctx["advice"]
    p = next(iter([*model.parameters(), *model.buffers()]), None)
    device = str(p.device) if p is not None and p.device.type != "meta" else "cpu"
    resting = max((by.get("activations", 0) for by in mem.resting_max.values()), default=0)
    try:
        from headroom._providers import advice_provider

        ctx["advice"] = advice_provider()(
            model, ctx["args"], kwargs=ctx.get("kwargs"), loss_fn=ctx.get("loss_fn"),
            optimizer=ctx.get("optimizer"), optimizer_kwargs=ctx.get("optimizer_kwargs"),
            device=device, base=None, measured=mem.peak, resting_activations=resting,
            autocast=ctx.get("autocast"))
    except Exception as e:  # advice never breaks a report
        first = str(e).splitlines()[0][:200] if str(e) else ""
        ctx["advice"] = [f"(no advice: a dry run of the step failed: {type(e).__name__}: {first})"]
    return ctx["advice"]


def _fsdp_sharded(model: Any) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(fsdp, "FSDPModule", None)
    return cls is not None and any(isinstance(m, cls) for m in model.modules())
