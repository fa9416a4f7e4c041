"""A plan in plain words: the configuration, where the time and the memory go, and the search's reasons."""

from __future__ import annotations

from autoplan.plan.types import Plan

_GIB = 2**30
_CAUSES = {
    "compute": "compute", "recompute": "recomputation", "tp_comm": "tensor-parallel communication",
    "dp_comm": "data-parallel gradient sync", "pp_bubble": "pipeline bubble", "pp_comm": "pipeline sends",
    "ep_comm": "expert all-to-all", "cp_comm": "context-parallel exchange", "optimizer": "optimizer step",
}


def describe_config(plan: Plan) -> str:
    c = plan.config
    parts = [f"tp={c.tp}", f"pp={c.pp}", f"dp={c.dp}", f"cp={c.cp}", f"ep={c.ep}", f"sp={'on' if c.sp else 'off'}",
             f"zero={c.zero}", f"microbatch={c.microbatch}", f"schedule={c.schedule.value}"]
    if c.virtual_stages > 1:
        parts.append(f"virtual_stages={c.virtual_stages}")
    if c.folded:  # MoE parallel folding: the experts' own degrees over the same devices
        parts.append(f"experts folded: eep={c.expert_ep}, etp={c.expert_tp}, edp={c.expert_dp}")
    parts.append(f"recompute={c.recompute.value}" + (f" ({len(plan.layer_recompute)} layers differ)"
                                                     if plan.layer_recompute else ""))
    return ", ".join(parts)


def listing(items: tuple[str, ...], most: int = 6) -> str:
    """Up to `most` items joined by '; ', then how many more."""
    shown = "; ".join(items[:most])
    return shown + (f"; and {len(items) - most} more" if len(items) > most else "")


def seconds(t: float) -> str:
    """Three decimals, or three significant digits under 10 ms (a small model's step is not 0.000 s)."""
    return f"{t:.3f}" if t >= 0.01 else f"{t:.3g}"


def _batch(plan: Plan) -> str:
    """What one step trains on: sequences of tokens, or samples of the assumed input shape."""
    if plan.sample_shape:
        shape = " x ".join(map(str, plan.sample_shape))
        return f"global batch {plan.global_batch} samples of input shape {shape} (the shape the plan assumes)"
    return f"global batch {plan.global_batch} x {plan.seq_len} tokens"


def throughput_text(plan: Plan, *, units: bool = True) -> str:
    """The plan's predicted throughput: samples/s for a model without tokens, else tokens/s."""
    if plan.sample_shape:
        return f"{plan.samples_per_s:,.1f}" + (" samples/s" if units else "")
    return f"{plan.estimate.tokens_per_s:,.0f}" + (" tokens/s" if units else "")


def explain(plan: Plan) -> str:
    """Several lines: what the plan is, its predicted cost, and why the search chose it."""
    e = plan.estimate
    head = f"Plan #{plan.rank}" if plan.rank else "Plan"
    lines = [
        f"{head} for {plan.model_name} on {plan.num_devices} devices ({plan.cluster_name}), {_batch(plan)}:",
        f"  {describe_config(plan)}",
        (f"  step {seconds(e.step_time_s)} s, {throughput_text(plan)}, MFU {e.mfu:.1%}, "
         f"{e.peak_mem_bytes / _GIB:.3g} of {e.mem_capacity_bytes / _GIB:.0f} GiB per device"
         + ("" if e.fits else " (DOES NOT FIT)")),
        "  time: " + ", ".join(f"{_CAUSES.get(k, k)} {v:.3g} s" for k, v in e.breakdown.items() if v > 0),
        "  memory: " + ", ".join(f"{k} {v / _GIB:.3g} GiB" for k, v in e.memory.to_dict().items() if v > 0),
    ]
    if plan.folded:
        lines.append(f"  also stands for {len(plan.folded)} layout(s) predicted the same: " + listing(plan.folded))
    if plan.notes:
        lines.append("Why:")
        lines += [f"  - {note}" for note in plan.notes]
    return "\n".join(lines)
