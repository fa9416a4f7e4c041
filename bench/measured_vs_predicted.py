"""Predicted against measured step time on this machine: the single-process reference, the planner's
pick on 8 ranks, and a few fixed plans of a small model, trained for real with `autoplan.execute` (gloo,
one process per rank) next to the cost model's estimate on a profile.

    python bench/measured_vs_predicted.py                       # shipped local-cpu profile
    python bench/measured_vs_predicted.py --cluster my.yaml     # a profile `autoplan profile` wrote here

Prints each plan's predicted and measured step time (median of the steps after the first), their
ratio, and the machine's load. The ranks share this machine's cores, so measured times move with other
work: run it on a quiet machine (1-minute load below about 1.5). `autoplan validate` does the same for
a spread of searched plans and scores the ranking. Nothing here is asserted in tests.
"""

from __future__ import annotations

import argparse
import statistics

CONFIGS = (
    {"dp": 1},
    {"dp": 2},
    {"dp": 2, "zero": 3},
    {"tp": 2, "sp": True, "microbatch": 8},
    {"pp": 2, "schedule": "1f1b", "microbatch": 2},
    {"dp": 4, "microbatch": 4},
    {"pp": 2, "dp": 2, "schedule": "1f1b", "microbatch": 2},
    {"dp": 8, "microbatch": 2},
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="local-cpu")
    parser.add_argument("--model", default="tiny-gpt")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    import autoplan
    from autoplan.cluster.load import Cluster
    from autoplan.plan.types import ParallelConfig
    from autoplan.search.api import plan_for
    from autoplan.validate.machine import load_1min
    from autoplan.validate.measure import describe, run_plan

    pick = autoplan.autoplan(args.model, Cluster.load(args.cluster, devices_per_node=8), global_batch=args.global_batch,
                             seq_len=args.seq_len, top_k=1)[0]
    plans = [plan_for(args.model, Cluster.load(args.cluster, devices_per_node=c.num_devices), c,
                      global_batch=args.global_batch, seq_len=args.seq_len)
             for c in (ParallelConfig(**v) for v in CONFIGS)] + [pick]
    print(f"{args.model}, global batch {args.global_batch} x {args.seq_len} tokens, profile {args.cluster}; "
          f"1-minute load {load_1min():.2f}")
    print(f"{'plan':40} {'ranks':>5} {'predicted':>10} {'measured':>10} {'measured/pred':>14}")
    ratios = []
    for plan in plans:
        entry = run_plan(plan, args.model, steps=args.steps, timeout_s=300)
        if entry.get("error"):
            print(f"{describe(plan.config):40} FAILED: {entry['error']}")
            continue
        ratios.append(entry["measured_step_time_s"] / entry["predicted_step_time_s"])
        tag = " (planner's pick)" if plan is pick else ""
        print(f"{describe(plan.config):40} {plan.config.num_devices:5} {entry['predicted_step_time_s']:10.4f} "
              f"{entry['measured_step_time_s']:10.4f} {ratios[-1]:14.2f}   other processes used "
              f"{entry['other_cpu_cores']:.2f} cores{tag}", flush=True)
    print(f"measured/predicted: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}; "
          f"1-minute load now {load_1min():.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
