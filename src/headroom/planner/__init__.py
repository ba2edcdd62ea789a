"""`hr.plan` and its helpers under their former path: the planner lives in `headroom.fit`."""

from headroom.fit import (
    Choice,
    Plan,
    PlanError,
    Speeds,
    measure_speeds,
    offload_activations_in_forward,
    parse_bytes,
    plan,
)

__all__ = ["Choice", "Plan", "PlanError", "Speeds", "measure_speeds",
           "offload_activations_in_forward", "parse_bytes", "plan"]
