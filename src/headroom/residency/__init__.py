"""Parameters kept off the device: residency of groups of parameters, blocks, `offload`."""

from headroom.residency._adapters import init_adapters
from headroom.residency._offload import (
    MODULE_ATTRS,
    describe,
    offload,
    offload_states,
    prefetch,
    state_of,
    unoffload,
)
from headroom.residency._plan import (
    GroupPlan,
    OffloadOptions,
    OffloadPlan,
    ParamPlan,
    plan_offload,
)

__all__ = [
    "MODULE_ATTRS",
    "GroupPlan",
    "OffloadOptions",
    "OffloadPlan",
    "ParamPlan",
    "describe",
    "init_adapters",
    "offload",
    "offload_states",
    "plan_offload",
    "prefetch",
    "state_of",
    "unoffload",
]
