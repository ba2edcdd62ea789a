"""Given a budget, pick what to turn on, from the estimator's figures."""

from headroom.plan._plan import Choice, Plan, PlanError, parse_bytes, plan
from headroom.plan._time import Speeds

__all__ = ["Choice", "Plan", "PlanError", "Speeds", "parse_bytes", "plan"]
