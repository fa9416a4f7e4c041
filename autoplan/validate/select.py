"""Which plans a validation runs: the planner's top plans, plus a spread of worse ones (the best plan of
other mesh shapes, spaced out in predicted step time), so that the ranking itself is tested and not only
the few plans at the top."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from autoplan.plan.types import Plan


def mesh_of(plan: Plan) -> tuple[int, ...]:
    c = plan.config
    return (c.tp, c.pp, c.dp, c.cp, c.ep)


def candidate_plans(model: Any, cluster: Any, *, global_batch: int, seq_len: int, num_top: int,
                    per_mesh: int = 2) -> tuple[Plan, ...]:
    """The search's top `num_top` plans and the best `per_mesh` plans of every mesh shape that has a
    fitting plan, fastest first, one entry per configuration."""
    from autoplan.search.api import autoplan, model_graph
    from autoplan.search.space import SearchOptions, mesh_shapes

    found = list(autoplan(model, cluster, global_batch=global_batch, seq_len=seq_len, top_k=num_top))
    graph = model_graph(model, seq_len)
    for tp, pp, dp, cp, ep in mesh_shapes(graph, cluster, SearchOptions(global_batch=global_batch)):
        try:
            found += autoplan(graph, cluster, global_batch=global_batch, seq_len=seq_len, top_k=per_mesh,
                              tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, use_ilp=False)
        except ValueError:  # nothing of this mesh fits
            continue
    unique: dict[Any, Plan] = {}
    for plan in found:
        unique.setdefault((plan.config, plan.stages, plan.layer_recompute), plan)
    return tuple(sorted(unique.values(), key=lambda p: p.estimate.step_time_s))


def spread(candidates: Sequence[Plan], num_plans: int, num_top: int) -> tuple[Plan, ...]:
    """The `num_top` fastest candidates, then `num_plans - num_top` more at evenly spaced log step times
    up to the slowest candidate, each the candidate nearest its target, a mesh shape not chosen yet
    counting as nearer (log distance - 0.25)."""
    ordered = sorted(candidates, key=lambda p: p.estimate.step_time_s)
    chosen = list(ordered[:num_top])
    rest = ordered[num_top:]
    need = min(num_plans - len(chosen), len(rest))
    if need <= 0:
        return tuple(chosen)
    lo = math.log(rest[0].estimate.step_time_s)
    hi = math.log(rest[-1].estimate.step_time_s)
    for k in range(need):
        target = lo + (hi - lo) * (k / (need - 1) if need > 1 else 0.0)
        meshes = {mesh_of(p) for p in chosen}
        best = min(rest, key=lambda p: abs(math.log(p.estimate.step_time_s) - target)
                   - (0.25 if mesh_of(p) not in meshes else 0.0))
        chosen.append(best)
        rest.remove(best)
    return tuple(sorted(chosen, key=lambda p: p.estimate.step_time_s))


def select_plans(model: Any, cluster: Any, *, global_batch: int, seq_len: int, num_plans: int = 8,
                 num_top: int = 3) -> tuple[Plan, ...]:
    """`num_plans` plans to run: the top `num_top` and a spread of worse ones (see spread), fastest
    predicted first. Fewer when the space holds fewer fitting plans."""
    for name, value in (("num_plans", num_plans), ("num_top", num_top)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    num_top = min(num_top, num_plans)
    pool = candidate_plans(model, cluster, global_batch=global_batch, seq_len=seq_len, num_top=num_top)
    return spread(pool, num_plans, num_top)
