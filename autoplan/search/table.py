"""Ranked plans as a rich table with a legend, and as CSV: rank, degrees, sp, ZeRO stage, microbatch
size, pipeline schedule, recompute, step time, throughput (tokens/s, or samples/s for models without
tokens), MFU, memory per device and where the step's time goes; rows that stand for tied layouts say so.
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from collections.abc import Sequence
from typing import Any

from autoplan.plan.explain import listing, seconds, throughput_text
from autoplan.plan.types import Plan
from autoplan.search.ties import MEM_TOLERANCE, TIME_TOLERANCE

GIB = 2**30
_SHORT = {"compute": "compute", "recompute": "recomp", "tp_comm": "tp", "dp_comm": "dp", "pp_bubble": "bubble",
          "pp_comm": "pp", "ep_comm": "ep", "cp_comm": "cp", "optimizer": "optim"}
HEADERS = ("#", "tp", "pp", "dp", "cp", "ep", "sp", "ZeRO", "micro-batch", "schedule", "recompute", "step s",
           "tokens/s", "MFU", "GiB/device", "time goes to")
LEGEND = (
    "tp pp dp cp ep: tensor, pipeline, data, context and expert parallel degrees (their product is the device "
    "count); ep 'N (E x T)': MoE folding, the experts on E ranks split over T, over the same devices. sp: sequence parallelism over the tp group. ZeRO: 0 replicated, 1 optimizer states sharded over "
    "the data-parallel group, 2 also gradients, 3 also weights. micro-batch: samples (sequences) per "
    "microbatch per replica. schedule: pipeline schedule, (vN) N model chunks per pipeline rank; - without a pipeline. "
    "recompute: activation recomputation of every block (selective: the attention core only; full: the whole "
    "block), or 'K full, rest none' when the search chose per block. step s: predicted seconds per optimizer "
    "step. MFU: model FLOPs utilisation. GiB/device: predicted peak memory. time goes to: the largest "
    "shares of the step (bubble: pipeline bubble; recomp: recomputation; tp/dp/pp/ep/cp: exposed "
    "communication of that axis).")
TIES = f"step time within {TIME_TOLERANCE:.1%}, memory within {MEM_TOLERANCE:.0%}"


def recompute_label(plan: Plan) -> str:
    """'none' / 'selective' / 'full', or with per-layer choices 'K full, J selective, rest none'."""
    if not plan.layer_recompute:
        return plan.config.recompute.value
    counts = Counter(r.value for _, r in plan.layer_recompute)
    return ", ".join(f"{n} {r}" for r, n in counts.items()) + f", rest {plan.config.recompute.value}"


def causes_label(plan: Plan, n: int = 3) -> str:
    b = plan.estimate.breakdown
    total = b.total_s or 1.0
    top = sorted(((k, v) for k, v in b.items() if v > 0), key=lambda kv: -kv[1])[:n]
    return " ".join(f"{_SHORT[k]} {v / total:.0%}" for k, v in top)


def schedule_label(plan: Plan) -> str:
    c = plan.config
    if c.pp == 1:
        return "-"
    return c.schedule.value + (f"(v{c.virtual_stages})" if c.virtual_stages > 1 else "")


def _title(plans: Sequence[Plan]) -> str:
    if not plans:
        return ""
    p = plans[0]
    sample = (f", one sample = input {tuple(p.sample_shape)}" if p.sample_shape else f", seq {p.seq_len}")
    return f"{p.model_name} on {p.num_devices} x {p.cluster_name}, global batch {p.global_batch}{sample}"


def plans_table(plans: Sequence[Plan]) -> Any:
    from rich.table import Table

    folded = [f"#{p.rank} also stands for {len(p.folded)} layout(s) predicted the same ({TIES}): "
              + listing(p.folded) + "." for p in plans if p.folded]
    table = Table(title=_title(plans), caption="\n".join([*folded, LEGEND]), caption_justify="left")
    headers = list(HEADERS)
    if plans and plans[0].sample_shape:
        headers[headers.index("tokens/s")] = "samples/s"
    for name in headers:
        table.add_column(name, justify="left" if name in ("schedule", "recompute", "time goes to") else "right")
    for p in plans:
        c, e = p.config, p.estimate
        rank = f"{p.rank}" + (f" (+{len(p.folded)})" if p.folded else "")
        ep = f"{c.ep} ({c.expert_ep}x{c.expert_tp})" if c.folded else str(c.ep)
        table.add_row(rank, str(c.tp), str(c.pp), str(c.dp), str(c.cp), ep, "on" if c.sp else "off",
                      str(c.zero), str(c.microbatch), schedule_label(p), recompute_label(p), seconds(e.step_time_s),
                      throughput_text(p, units=False), f"{e.mfu:.1%}", f"{e.peak_mem_bytes / GIB:.1f}", causes_label(p))
    return table


CSV_FIELDS = ("rank", "tp", "pp", "dp", "cp", "ep", "sp", "zero", "microbatch", "schedule", "virtual_stages",
              "recompute", "layer_recompute", "step_time_s", "tokens_per_s", "samples_per_s", "mfu", "peak_mem_gib",
              "mem_capacity_gib", "fits", "sample_shape", "folded", "etp", "eep")


def plans_csv(plans: Sequence[Plan]) -> str:
    """One row per ranked plan (CSV_FIELDS, then each breakdown cause as `<cause>_s`)."""
    out = io.StringIO()
    causes = list(plans[0].estimate.breakdown.keys()) if plans else []
    writer = csv.DictWriter(out, fieldnames=[*CSV_FIELDS, *(f"{k}_s" for k in causes)], lineterminator="\n")
    writer.writeheader()
    for p in plans:
        e = p.estimate
        row = {**p.config.to_dict(), "rank": p.rank, "layer_recompute": recompute_label(p) if p.layer_recompute else "",
               "step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s, "samples_per_s": p.samples_per_s,
               "mfu": e.mfu, "peak_mem_gib": e.peak_mem_bytes / GIB, "mem_capacity_gib": e.mem_capacity_bytes / GIB,
               "fits": e.fits, "sample_shape": "x".join(map(str, p.sample_shape)), "folded": "; ".join(p.folded),
               "etp": p.config.expert_tp, "eep": p.config.expert_ep}  # the experts' degrees, folded or not
        row.update({f"{k}_s": v for k, v in e.breakdown.items()})
        writer.writerow(row)
    return out.getvalue()


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
