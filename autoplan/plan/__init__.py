"""The plan: its types, its JSON form and its plain-words explanation. Imports nothing else from autoplan."""

from __future__ import annotations

from autoplan.plan.explain import explain
from autoplan.plan.io import (
    SCHEMA_VERSION,
    load_plan,
    load_plans,
    plan_from_json,
    plan_to_json,
    plans_to_json,
    save_plan,
)
from autoplan.plan.types import (
    Breakdown,
    Estimate,
    MemoryBreakdown,
    ParallelConfig,
    Plan,
    Recompute,
    Schedule,
    Stage,
)

__all__ = [
    "SCHEMA_VERSION", "Breakdown", "Estimate", "MemoryBreakdown", "ParallelConfig", "Plan", "Recompute",
    "Schedule", "Stage", "explain", "load_plan", "load_plans", "plan_from_json", "plan_to_json", "plans_to_json",
    "save_plan",
]
