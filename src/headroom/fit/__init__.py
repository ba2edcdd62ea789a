"""What fits: `hr.estimate` (the memory of a step, from a dry run), `hr.plan` (what to turn on
for a budget), and the advice ending reports (registered with `headroom._providers`: the top
layer, which no feature imports).
"""

from headroom._providers import register_advice as _register_advice
from headroom.fit._advice import advise as _advise
from headroom.fit._apply import offload_activations_in_forward
from headroom.fit._dryrun import checkpoint_modules
from headroom.fit._estimate import Estimate, estimate
from headroom.fit._plan import Choice, Plan, PlanError, parse_bytes, plan
from headroom.fit._time import Speeds, measure_speeds

_register_advice(_advise)

__all__ = ["Choice", "Estimate", "Plan", "PlanError", "Speeds", "checkpoint_modules",
           "estimate", "measure_speeds", "offload_activations_in_forward", "parse_bytes", "plan"]
