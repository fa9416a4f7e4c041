"""Ranked component plans as a rich table: rank, each group's devices and strategy, hand-off microbatches,
step time, samples/s, tokens/s, MFU, memory, and the pace-setting group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autoplan.plan.components import ComponentGroup, ComponentPlan

GIB = 2**30


def group_label(group: ComponentGroup) -> str:
    """'model.vision_tower+...: 2 dev dp2 z0' (short component names: the last path part)."""
    c = group.plan.config
    names = "+".join(n.rpartition(".")[2] or n for n in group.components)
    degrees = " ".join(f"{axis}{getattr(c, axis)}" for axis in ("tp", "pp", "dp", "cp", "ep") if getattr(c, axis) > 1)
    return f"{names}: {group.num_devices} dev {degrees or 'single'} z{c.zero}" + (
        f" {c.recompute.value}" if c.recompute.value != "none" else "")


def component_plans_table(plans: Sequence[ComponentPlan]) -> Any:
    from rich.table import Table

    title = ""
    if plans:
        p = plans[0]
        shapes = ", ".join(f"{n} {list(s)}" for n, s in p.input_shapes)
        title = (f"{p.model_name} on {p.num_devices} x {p.cluster_name}, global batch {p.global_batch}"
                 + (f", input per sample {shapes}" if shapes else ""))
    table = Table(title=title)
    for name in ("#", "groups", "mb", "step s", "samples/s", "tokens/s", "MFU", "mem GiB", "pace"):
        table.add_column(name, justify="left" if name in ("groups", "pace") else "right")
    for p in plans:
        e = p.estimate
        pace = max(range(len(p.groups)), key=lambda i: p.groups[i].slot_time_s)
        table.add_row(str(p.rank), " | ".join(group_label(g) for g in p.groups), str(p.num_microbatches),
                      f"{e.step_time_s:.3f}", f"{p.samples_per_s:,.1f}", f"{e.tokens_per_s:,.0f}", f"{e.mfu:.1%}",
                      f"{e.peak_mem_bytes / GIB:.1f}", f"group {pace}")
    return table
