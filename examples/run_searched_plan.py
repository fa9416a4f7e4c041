"""Search a plan for tiny-gpt on 4 local CPU ranks, train it with torchrun, and hold its losses against
the single-process reference (same seed: same weights and data). Run: python examples/run_searched_plan.py"""

from __future__ import annotations

import os

import autoplan
from autoplan import Cluster, ParallelConfig

GLOBAL_BATCH, SEQ_LEN, STEPS = 8, 32, 5


def main() -> None:
    plans = autoplan.autoplan("tiny-gpt", Cluster.load("local-cpu", devices_per_node=4),
                              global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, top_k=1)
    best = plans[0]
    with open(os.devnull, "w") as quiet:
        run = autoplan.execute(best, "tiny-gpt", steps=STEPS, out=quiet)
        ref = autoplan.execute(ParallelConfig(), "tiny-gpt", steps=STEPS, global_batch=GLOBAL_BATCH,
                               seq_len=SEQ_LEN, out=quiet)
    print(f"plan: {best.config.to_dict()}")
    for step, (a, b) in enumerate(zip(run["losses"], ref["losses"])):
        print(f"step {step}: plan {a:.6f}  reference {b:.6f}  diff {abs(a - b):.1e}")
    print(f"step time: measured {run['step_time_s']:.4f} s, predicted {run['predicted_step_time_s']:.4f} s")


if __name__ == "__main__":
    main()
