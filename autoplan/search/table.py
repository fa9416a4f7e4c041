"""Ranked plans as a rich table: rank, degrees, sp, zero, microbatch, schedule(v), recompute, step time,
tokens/s, MFU, memory per device and the top time causes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from autoplan.plan.types import Plan

GIB = 2**30
_SHORT = {"compute": "compute", "recompute": "recomp", "tp_comm": "tp", "dp_comm": "dp", "pp_bubble": "bubble",
          "pp_comm": "pp", "ep_comm": "ep", "cp_comm": "cp", "optimizer": "optim"}


def recompute_label(plan: Plan) -> str:
    if not plan.layer_recompute:
        return plan.config.recompute.value
    counts = Counter(r.value for _, r in plan.layer_recompute)
    return plan.config.recompute.value + ", " + ", ".join(f"{n} {r}" for r, n in counts.items())


def causes_label(plan: Plan, n: int = 3) -> str:
    b = plan.estimate.breakdown
    total = b.total_s or 1.0
    top = sorted(((k, v) for k, v in b.items() if v > 0), key=lambda kv: -kv[1])[:n]
    return " ".join(f"{_SHORT[k]} {v / total:.0%}" for k, v in top)


def plans_table(plans: Sequence[Plan]) -> Any:
    from rich.table import Table

    title = ""
    if plans:
        p = plans[0]
        title = (f"{p.model_name} on {p.num_devices} x {p.cluster_name}, global batch {p.global_batch}, "
                 f"seq {p.seq_len}")
        if p.unit == "samples":  # no tokens: say what one sample was assumed to be
            title += ", input " + ", ".join(f"{n} {list(s)}" for n, s in p.input_shapes) + " per sample"
    samples = bool(plans) and plans[0].unit == "samples"
    table = Table(title=title)
    for name in ("#", "tp", "pp", "dp", "cp", "ep", "sp", "zero", "mb", "schedule", "recompute", "step s",
                 "samples/s" if samples else "tokens/s", "MFU", "mem GiB", "top causes"):
        table.add_column(name, justify="left" if name in ("schedule", "recompute", "top causes") else "right")
    for p in plans:
        c, e = p.config, p.estimate
        sched = c.schedule.value + (f"(v{c.virtual_stages})" if c.virtual_stages > 1 else "") if c.pp > 1 else "-"
        table.add_row(str(p.rank), str(c.tp), str(c.pp), str(c.dp), str(c.cp), str(c.ep), "on" if c.sp else "off",
                      str(c.zero), str(c.microbatch), sched, recompute_label(p), f"{e.step_time_s:.3f}",
                      f"{p.samples_per_s if samples else e.tokens_per_s:,.0f}", f"{e.mfu:.1%}", f"{e.peak_mem_bytes / GIB:.1f}", causes_label(p))
    return table


def render(renderable: Any, width: int = 160) -> str:
    from rich.console import Console

    console = Console(width=width, record=True, file=_Null(), color_system=None)
    console.print(renderable)
    return console.export_text().rstrip("\n")


class _Null:
    def write(self, _: str) -> int:
        return 0

    def flush(self) -> None:
        pass
