"""`autoplan timeline`: a plan's pipeline schedule per rank (forward, backward, weight gradient, sends,
bubbles) as the cost model predicts it (a simulation of the schedule, autoplan.cost.timeline) and, given
a run report made with `autoplan run --trace`, as the executor measured it.

    autoplan plan --model tiny-gpt --cluster local-cpu --global-batch 16 --seq-len 32 --json plan.json
    autoplan run --plan plan.json --model tiny-gpt --steps 5 --trace --report run.json
    autoplan timeline plan.json --report run.json -o timeline.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("timeline", help="draw a plan's pipeline schedule, predicted and measured")
    p.add_argument("plan", help="plan JSON (`autoplan plan --json`)")
    p.add_argument("--report", metavar="RUN.json", help="run report of `autoplan run --trace` for this plan")
    p.add_argument("-o", "--out", required=True, metavar="FILE.png", help="PNG to write")
    p.add_argument("--model", default=None, help="model to re-estimate with (default: the plan's)")
    p.add_argument("--cluster", default=None, help="profile to re-estimate with (default: the plan's)")
    p.set_defaults(func=cmd_timeline)


def _cluster(name: str, num_devices: int) -> Any:
    from autoplan.cluster.load import Cluster

    spec = Cluster.load(name)
    if num_devices <= spec.devices_per_node:
        return Cluster.load(name, devices_per_node=num_devices)
    nodes, rest = divmod(num_devices, spec.devices_per_node)
    if rest:
        raise ValueError(f"the plan's {num_devices} devices are not whole nodes of {spec.devices_per_node}")
    return Cluster.load(name, num_nodes=nodes)


def _measured(report: dict[str, Any], plan: Any) -> dict[int, list]:
    """{pipeline rank: boxes} from the report's timeline: for each pipeline rank, the lowest global
    rank that ran its stages (the first replica)."""
    from autoplan.plan.layout import stage_ranks

    if "timeline" not in report:
        raise ValueError("the run report has no timeline: run the plan with `autoplan run --trace`")
    if report.get("plan") != plan.config.to_dict():
        raise ValueError(f"the run report is of config {report.get('plan')}, not the plan's {plan.config.to_dict()}")
    placement = stage_ranks(plan.config)
    rows: dict[int, list] = {}
    for rank in sorted(report["timeline"]["ranks"], key=int):
        actions = report["timeline"]["ranks"][rank]
        pp_rank = placement[actions[0][1]] if actions else None
        if pp_rank is not None and pp_rank not in rows:
            rows[pp_rank] = [(k, a, b, f"{k}{j}") for k, _, j, a, b in actions]
    # the last step's time (rank 0, from just before its schedule started) past the schedule's last action:
    # the optimizer step and the loss all-reduce
    end = report["step_times_s"][-1]
    for boxes in rows.values():
        last = max(b for _, _, b, _ in boxes)
        if end > last:
            boxes.append(("T", last, end, ""))
    return rows


def cmd_timeline(args: argparse.Namespace) -> int:
    from autoplan.cost.timeline import makespan, timeline_of
    from autoplan.plan.io import load_plan
    from autoplan.search.api import model_graph
    from autoplan.validate.plots import timeline

    if not args.out.endswith(".png"):
        raise ValueError(f"-o writes a PNG: give a file name ending in .png, got {args.out!r}")
    plan = load_plan(args.plan)
    if args.report and plan.config.pp == 1:
        raise ValueError("the plan has no pipeline (pp=1), so its run records no per-stage actions: drop --report")
    report = json.loads(Path(args.report).read_text()) if args.report else None
    cluster = _cluster(args.cluster or plan.cluster_name, plan.num_devices)
    graph = model_graph(args.model or plan.model_name, plan.seq_len)
    actions, tail = timeline_of(graph, cluster, plan)
    span = makespan(actions)
    rows: dict[int, list] = {r: [] for r in range(plan.config.pp)}
    for a in actions:
        rows[a.rank].append((a.kind, a.start_s, a.end_s, "" if a.kind == "C" else f"{a.kind}{a.microbatch}"))
    for boxes in rows.values():
        boxes.append(("T", span, span + tail, ""))
    c = plan.config
    panels = [((f"predicted: {c.schedule.value} pp={c.pp} v={c.virtual_stages}, "
               f"{c.num_microbatches(plan.global_batch)} microbatches, step {plan.estimate.step_time_s * 1e3:.1f} ms "
               f"(pipeline {span * 1e3:.1f} ms)"), rows)]
    if report is not None:
        panels.append((f"measured: last step of the run (median step {report['step_time_s'] * 1e3:.1f} ms)",
                       _measured(report, plan)))
    timeline(panels, args.out)
    print(f"wrote {args.out}")
    return 0
