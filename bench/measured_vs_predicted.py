"""Predicted against measured step time on this machine: a few plans of a tiny model trained for real
with `autoplan.execute` (gloo, one process per rank) next to the cost model's estimate on a profile.

    python bench/measured_vs_predicted.py                       # shipped local-cpu profile
    python bench/measured_vs_predicted.py --cluster my.yaml     # a profile `autoplan profile` wrote here

Prints each plan's predicted and measured step time (median of the steps after the first) and their
ratio. On a 2-core box the ranks share two cores, so measured times move with the load: run it on a
quiet machine. Nothing here is asserted in tests.
"""

from __future__ import annotations

import argparse
import statistics
import time

CONFIGS = (
    {"dp": 1},
    {"dp": 2},
    {"dp": 2, "zero": 3},
    {"tp": 2, "sp": True},
    {"pp": 2, "schedule": "1f1b", "microbatch": 2},
    {"dp": 4},
    {"pp": 2, "dp": 2, "schedule": "1f1b", "microbatch": 2},
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="local-cpu")
    parser.add_argument("--model", default="tiny-gpt")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()

    import autoplan
    from autoplan.cluster.load import Cluster
    from autoplan.plan.types import ParallelConfig
    from autoplan.search.api import plan_for

    ratios = []
    print(f"{args.model}, global batch {args.global_batch} x {args.seq_len} tokens, profile {args.cluster}")
    print(f"{'config':48} {'predicted':>10} {'measured':>10} {'measured/pred':>14}")
    for values in CONFIGS:
        config = ParallelConfig.from_dict(values, num_devices=None) if "dp" in values else ParallelConfig(**values)
        cluster = Cluster.load(args.cluster, devices_per_node=config.num_devices)
        plan = plan_for(args.model, cluster, config, global_batch=args.global_batch, seq_len=args.seq_len)
        est = plan.estimate
        t0 = time.perf_counter()
        report = autoplan.execute(plan, args.model, steps=args.steps, timeout_s=120)
        measured = report["step_time_s"]
        ratios.append(measured / est.step_time_s)
        label = ", ".join(f"{k}={v}" for k, v in values.items())
        print(f"{label:48} {est.step_time_s:10.4f} {measured:10.4f} {ratios[-1]:14.2f}"
              f"   ({time.perf_counter() - t0:.0f} s run)", flush=True)
    print(f"measured/predicted: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
