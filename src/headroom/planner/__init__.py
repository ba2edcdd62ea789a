"""Given a budget, pick what to turn on, from the estimator's figures (`hr.plan`).

The package is `planner` rather than `plan` so that `headroom.plan` stays the function: a
subpackage of that name would replace it as an attribute of `headroom` once imported.
"""

from headroom.planner._apply import offload_activations_in_forward
from headroom.planner._plan import Choice, Plan, PlanError, parse_bytes, plan
from headroom.planner._time import Speeds, measure_speeds

__all__ = ["Choice", "Plan", "PlanError", "Speeds", "measure_speeds",
           "offload_activations_in_forward", "parse_bytes", "plan"]
