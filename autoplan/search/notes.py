"""Plain-words reasons for each plan (what dominates the time, why these degrees, what memory forced),
and the message when nothing fits (by how much, and what would make it fit).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from autoplan.cluster.types import ClusterSpec
from autoplan.graph.types import LayerGraph
from autoplan.plan.types import ParallelConfig, Plan, Recompute
from autoplan.search.space import COLUMNS, RECOMPUTES, SearchOptions, Space
from autoplan.search.surrogate import Quick

GIB = 2**30
_CAUSES = {
    "compute": "compute", "recompute": "recomputation", "tp_comm": "tensor-parallel communication",
    "dp_comm": "data-parallel gradient sync", "pp_bubble": "pipeline bubble", "pp_comm": "pipeline sends",
    "ep_comm": "expert all-to-all", "cp_comm": "context-parallel exchange", "optimizer": "optimizer step",
}


def top_causes(plan: Plan, n: int = 3) -> list[tuple[str, float]]:
    """(cause, fraction of the step) of the n largest entries of the breakdown."""
    b = plan.estimate.breakdown
    total = b.total_s or 1.0
    return sorted(((k, v / total) for k, v in b.items() if v > 0), key=lambda kv: -kv[1])[:n]


def _same_except(space: Space, row: int, **changes: int) -> np.ndarray:
    """The rows equal to `row` in every column but those changed (ascending): the first column compared over
    the whole space, the others over what is left."""
    first, *rest = COLUMNS
    rows = np.nonzero(space.columns[first] == changes.get(first, space.columns[first][row]))[0]
    for col in rest:
        rows = rows[space.columns[col][rows] == changes.get(col, space.columns[col][row])]
    return rows


def plan_notes(plan: Plan, plans: list[Plan], graph: LayerGraph, cluster: ClusterSpec, space: Space, quick: Quick,
               row: int, cost: Any = None) -> tuple[str, ...]:
    c, est = plan.config, plan.estimate
    notes = ["Time per step {:.3g} s: {}.".format(est.step_time_s, ", ".join(
        f"{_CAUSES[k]} {f:.0%}" for k, f in top_causes(plan)))]
    link = cluster.intra_node.name
    if c.tp > 1:
        notes.append(f"tp={c.tp} splits every layer over {c.tp} devices of one node, so its per-layer "
                     f"collectives stay on {link} (tensor-parallel communication "
                     f"{est.breakdown.tp_comm / est.step_time_s:.0%} of the step)"
                     + ("; sequence parallelism divides the remaining activations by tp too." if c.sp else "."))
    else:
        notes.append("tp=1: layers run whole on each device, with no per-layer communication.")
    ctx = {"space": space, "quick": quick, "row": row, "cost": cost, "graph": graph, "cluster": cluster}
    notes += _alternatives("tp", plan, ctx)
    blocks = len(graph.blocks)
    if c.pp > 1:
        names = {b.name for b in graph.blocks}
        sizes = [sum(1 for n in s.layer_names if n in names) for s in plan.stages]
        mbs = _n(c.num_microbatches(plan.global_batch), "microbatch")
        notes.append(f"pp={c.pp} cuts the {blocks} blocks into {len(plan.stages)} stages ({_sizes(sizes)} blocks) so "
                     f"each device holds 1/{c.pp} of the weights; with {mbs} the bubble costs "
                     f"{est.breakdown.pp_bubble / est.step_time_s:.0%} "
                     f"(schedule {c.schedule.value}" + (f", v={c.virtual_stages})." if c.virtual_stages > 1 else ")."))
    else:
        notes.append("pp=1: every device holds all the blocks; no pipeline bubble.")
    notes += _alternatives("pp", plan, ctx)
    notes += _context_and_experts(plan, ctx)
    m = est.memory
    notes.append(f"Memory per device {est.peak_mem_bytes / GIB:.3g} of {est.mem_capacity_bytes / GIB:.0f} GiB: "
                 f"weights {m.weights / GIB:.3g}, gradients {m.gradients / GIB:.3g}, optimizer {m.optimizer / GIB:.3g}, "
                 f"activations {m.activations / GIB:.3g}, reserve {m.reserve / GIB:.3g}.")
    notes += _memory_reasons(plan, space, quick, row)
    if c.dp * c.ep > 1:
        notes.append(f"dp={c.dp}" + (f" x ep={c.ep}" if c.ep > 1 else "") + f" replicas split the global batch of "
                     f"{plan.global_batch}; gradient sync exposed {est.breakdown.dp_comm / est.step_time_s:.0%}.")
    others = [p for p in plans if p is not plan]
    if others and plan.rank == 1:
        nxt = others[0]
        diff = config_diff(c, nxt.config)
        gain = nxt.estimate.step_time_s / est.step_time_s - 1
        notes.append(f"{gain:.1%} faster than plan #2 ({diff or 'a different stage split'}).")
    return tuple(notes)


def config_diff(config: ParallelConfig, other: ParallelConfig) -> str:
    """'key value' of `other` for every field where it differs from `config` ("" when none). to_dict leaves
    out etp / eep when they are 0, so a key one side lacks counts as 0 (a MoE-folded plan against an unfolded
    one)."""
    a, b = config.to_dict(), other.to_dict()
    return ", ".join(f"{k} {b.get(k, 0)}" for k in dict.fromkeys([*a, *b]) if a.get(k, 0) != b.get(k, 0))


def _context_and_experts(plan: Plan, ctx: dict[str, Any]) -> list[str]:
    """What cp and ep do in this plan, and the best plan found at their other degrees (when searched)."""
    c, est, out = plan.config, plan.estimate, []
    if c.cp > 1:
        out.append(f"cp={c.cp} splits each sequence over {c.cp} devices (2*cp load-balanced chunks), dividing "
                   f"activations by {c.cp}; the key/value exchange costs {_share(est.breakdown.cp_comm, est)} "
                   f"of the step.")
    out += _alternatives("cp", plan, ctx)
    if c.ep > 1:
        out.append(f"ep={c.ep} spreads each MoE layer's experts over {c.ep} devices; the token all-to-all costs "
                   f"{_share(est.breakdown.ep_comm, est)} of the step.")
    return out + _alternatives("ep", plan, ctx)


ALTERNATIVE_AXES = ("tp", "pp", "cp", "ep")  # the degrees the best plan's notes weigh (_alternatives)


def alternative_rows(axis: str, space: Space, quick: Quick, row: int, capacity: float) -> list[tuple[int, list[int]]]:
    """(degree, rows) for each degree of `axis` other than row's: its two quickest candidates that fit by
    the quick estimate (fewer when fewer fit), whose exact estimates _alternatives weighs."""
    col = space.columns[axis]
    fit = np.nonzero(quick.peak_mem_bytes <= capacity)[0]
    fit_col = col[fit]
    out = []
    for value in np.unique(col).tolist():
        if value == col[row]:
            continue
        idx = fit[fit_col == value]
        out.append((value, idx[np.argsort(quick.step_time_s[idx])[:2]].tolist()))
    return out


def _alternatives(axis: str, plan: Plan, ctx: dict[str, Any]) -> list[str]:
    """Why this degree (for the best plan): at each other degree, the fastest of its two quickest
    fitting candidates by the exact estimate, relative to this plan."""
    space, quick, row, cost = ctx["space"], ctx["quick"], ctx["row"], ctx["cost"]
    if row < 0 or plan.rank != 1 or cost is None:
        return []
    parts = []
    for value, rows in alternative_rows(axis, space, quick, row, plan.estimate.mem_capacity_bytes):
        times = [e.step_time_s for e in (cost.estimate_config(ctx["graph"], ctx["cluster"], space.config(r),
                                                              global_batch=plan.global_batch) for r in rows) if e.fits]
        parts.append(f"{axis}={value} " + (f"{min(times) / plan.estimate.step_time_s - 1:+.0%}" if times
                                           else "does not fit"))
    if not parts:
        return []
    return [f"Best plan found at other {axis} degrees, vs this one: " + ", ".join(parts) + "."]


def _memory_reasons(plan: Plan, space: Space, quick: Quick, row: int) -> list[str]:
    out = []
    cap = plan.estimate.mem_capacity_bytes
    if row < 0:
        return out
    modes = {r for _, r in plan.layer_recompute} | {plan.config.recompute}
    if modes != {Recompute.NONE}:
        alt = _same_except(space, row, recompute=RECOMPUTES.index(Recompute.NONE))
        if len(alt):
            need = float(quick.peak_mem_bytes[alt[0]])
            verdict = "would not fit" if need > cap else "would fit but runs slower here"
            out.append(f"Recompute ({_mode_summary(plan)}): without it this mesh needs about {need / GIB:.3g} GiB "
                       f"per device, so it {verdict}.")
    if plan.config.zero > 0:
        alt = _same_except(space, row, zero=0)
        if len(alt):
            out.append(f"ZeRO-{plan.config.zero} shards model states over the data-parallel group; unsharded this "
                       f"mesh needs about {float(quick.peak_mem_bytes[alt[0]]) / GIB:.3g} GiB per device.")
    return out


def _mode_summary(plan: Plan) -> str:
    if not plan.layer_recompute:
        return plan.config.recompute.value
    over = {}
    for _, r in plan.layer_recompute:
        over[r.value] = over.get(r.value, 0) + 1
    return f"{plan.config.recompute.value} except " + ", ".join(f"{n} layers {r}" for r, n in over.items())


def _share(seconds: float, est: Any) -> str:
    """A cause's share of the step: whole percent, one decimal under 1 %."""
    f = seconds / est.step_time_s if est.step_time_s else 0.0
    return f"{f:.0%}" if f >= 0.01 or f == 0 else f"{f:.1%}"


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else ("es" if noun.endswith("ch") else "s"))


def _sizes(sizes: list[int]) -> str:
    if len(set(sizes)) == 1:
        return f"{len(sizes)} x {sizes[0]}"
    return "/".join(str(s) for s in sizes) if len(sizes) <= 12 else f"{min(sizes)}-{max(sizes)}"


def nothing_fits_message(graph: LayerGraph, cluster: ClusterSpec, space: Space, quick: Quick,
                         options: SearchOptions, cost: Any) -> str:
    """By how much the least memory-hungry candidate overflows (exact estimate), and the remedies."""
    order = np.argsort(quick.peak_mem_bytes)[:16]
    best = None
    for row in order.tolist():
        est = cost.estimate_config(graph, cluster, space.config(row), global_batch=options.global_batch)
        if best is None or est.peak_mem_bytes < best[1].peak_mem_bytes:
            best = (row, est)
    row, est = best
    config = space.config(row)
    need, cap = est.peak_mem_bytes, est.mem_capacity_bytes
    ratio = need / cap
    remedies = [f"more devices (about {int(np.ceil(ratio * cluster.num_nodes))} nodes instead of {cluster.num_nodes})"]
    for label, change in (("a microbatch of 1", {"microbatch": 1}), ("full recompute", {"recompute": Recompute.FULL}),
                          ("ZeRO-3", {"zero": 3})):
        try:
            alt = cost.estimate_config(graph, cluster, dataclasses.replace(config, **change),
                                       global_batch=options.global_batch)
        except ValueError:
            continue
        if alt.peak_mem_bytes < need:
            remedies.append(f"{label} (-> {alt.peak_mem_bytes / GIB:.1f} GiB)")
    remedies.append("a shorter sequence or devices with more memory")
    cfg = ", ".join(f"{k}={v}" for k, v in config.to_dict().items())
    return (f"nothing fits in {cap / GIB:.0f} GiB per device: the least memory-hungry of {len(space):,} "
            f"candidates ({cfg}) needs {need / GIB:.1f} GiB, {(need - cap) / GIB:.1f} GiB ({ratio - 1:.0%}) over; "
            f"try " + ", ".join(remedies))
