"""Parameters kept off the device: residency of groups of parameters, blocks, `offload`."""

from headroom.residency._offload import describe, offload, prefetch, state_of, unoffload
from headroom.residency._plan import (
    GroupPlan,
    OffloadOptions,
    OffloadPlan,
    ParamPlan,
    plan_offload,
)

__all__ = [
    "GroupPlan",
    "OffloadOptions",
    "OffloadPlan",
    "ParamPlan",
    "describe",
    "offload",
    "plan_offload",
    "prefetch",
    "state_of",
    "unoffload",
]
