"""`autoplan validate`: run the planner's top plans and a spread of worse ones with the executor, and
show predicted against measured step time and peak memory, the Spearman rank correlation, the MAPE and
how far the plan predicted best is from the best measured.

    autoplan validate --model tiny-gpt --cluster local-cpu --nproc-per-node 8 --plans 10 --json v.json --plot v.png
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

QUIET_LOAD = 1.5  # 1-minute load average above which timings on a small shared machine are noisy


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("validate", help="run a spread of plans and compare measured with predicted")
    p.add_argument("--model", required=True, help="preset name (see `autoplan models`)")
    p.add_argument("--cluster", required=True, help="profile name or YAML path the predictions use")
    p.add_argument("--nproc-per-node", dest="nproc_per_node", type=int, required=True, help="ranks to run on")
    p.add_argument("--plans", type=int, default=8, help="plans to run (default 8)")
    p.add_argument("--top", type=int, default=3, help="of which the planner's top ones (default 3); "
                                                       "the rest spread over worse predicted times")
    p.add_argument("--steps", type=int, default=8, help="steps per plan; the median after the first counts")
    p.add_argument("--global-batch", dest="global_batch", type=int, default=16)
    p.add_argument("--seq-len", dest="seq_len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="model / data seed, and the order plans run in")
    p.add_argument("--timeout-s", dest="timeout_s", type=float, default=300.0, help="per-run timeout")
    p.add_argument("--quiet-cores", dest="quiet_cores", type=float, default=None, metavar="X",
                   help="before each run, wait until other processes use at most X cores; repeat a run "
                        "they disturbed (used over 2X cores) up to --retries times")
    p.add_argument("--max-wait-s", dest="max_wait_s", type=float, default=120.0, help="longest wait for quiet")
    p.add_argument("--retries", type=int, default=2, help="repeats of a disturbed run (with --quiet-cores)")
    p.add_argument("--json", metavar="FILE", help='write {"plans": [...], "spearman", "mape", ...}')
    p.add_argument("--plot", metavar="FILE.png", help="write the predicted-vs-measured scatter")
    p.set_defaults(func=cmd_validate)


def _check(args: argparse.Namespace) -> None:
    from autoplan.models import PRESETS

    if args.model not in PRESETS:
        raise ValueError(f"unknown model {args.model!r}: validate runs presets ({', '.join(PRESETS)})")
    for name in ("nproc_per_node", "plans", "top", "global_batch", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.steps < 2:
        raise ValueError(f"--steps must be at least 2 (the first step is warm-up), got {args.steps}")
    if args.plot and not args.plot.endswith(".png"):
        raise ValueError(f"--plot writes a PNG: give a file name ending in .png, got {args.plot!r}")
    for path in (args.json, args.plot):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"cannot write {path}: its directory does not exist")


def cmd_validate(args: argparse.Namespace) -> int:
    from autoplan.cluster.load import Cluster
    from autoplan.validate.machine import load_1min
    from autoplan.validate.measure import summarize, validate_plans
    from autoplan.validate.select import select_plans

    _check(args)
    cluster = Cluster.load(args.cluster, devices_per_node=args.nproc_per_node)
    load = load_1min()
    if load is not None and load > QUIET_LOAD:
        print(f"autoplan validate: warning: 1-minute load is {load:.2f} on {_cores()} cores; timings will be "
              f"noisy (wait for a quiet machine for figures to trust)", file=sys.stderr)
    print(f"selecting {args.plans} plans of {args.model} on {args.nproc_per_node} x {cluster.name} ...", flush=True)
    plans = list(select_plans(args.model, cluster, global_batch=args.global_batch, seq_len=args.seq_len,
                              num_plans=args.plans, num_top=args.top))
    random.Random(args.seed).shuffle(plans)  # so drifting machine load does not follow predicted order
    head = {"model": args.model, "cluster": cluster.name, "profile": args.cluster,
            "nproc_per_node": args.nproc_per_node, "global_batch": args.global_batch, "seq_len": args.seq_len,
            "steps": args.steps, "seed": args.seed, "load_1min_start": load}

    def result_of(entries: list[dict[str, Any]]) -> dict[str, Any]:
        done = sorted(entries, key=lambda e: e["predicted_step_time_s"])
        return {**head, "load_1min_end": load_1min(), "plans": done, **summarize(done)}

    def save(entries: list[dict[str, Any]]) -> None:
        if args.json:  # after every plan, so a long validation keeps what it measured
            Path(args.json).write_text(json.dumps(result_of(entries), indent=1) + "\n")

    entries = validate_plans(plans, args.model, steps=args.steps, timeout_s=args.timeout_s, seed=args.seed,
                             progress=lambda line: print(line, flush=True), quiet_cores=args.quiet_cores,
                             max_wait_s=args.max_wait_s, retries=args.retries, on_entry=save)
    result = result_of(entries)
    _print_table(result)
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        from autoplan.validate.plots import scatter

        scatter(entries, args.plot, title=_title(result))
        print(f"wrote {args.plot}")
    failed = [e for e in result["plans"] if e.get("error")]
    return 1 if failed else 0


def _cores() -> int:
    import os

    return os.cpu_count() or 1


def _title(result: dict[str, Any]) -> str:
    return (f"{result['model']} on {result['nproc_per_node']} x {result['cluster']}: Spearman "
            f"{_num(result['spearman'], '.2f')}, MAPE {_num(result['mape'], '.0%')}, "
            f"best gap {_num(result['best_gap'], '.0%')}")


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console

    from autoplan.validate.report import summary_lines, table

    console = Console(width=160)
    console.print(table(result))
    for line in summary_lines(result):
        console.print(line)
