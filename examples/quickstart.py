"""Plan GPT-3 175B on 128 DGX A100 nodes, print the ranked plans and why the best one wins, check one
hand-picked configuration, and save the best plan for `autoplan run`."""

from __future__ import annotations

import autoplan
from autoplan.plan import save_plan

cluster = autoplan.Cluster.load("dgx-a100-80gb", num_nodes=128)
plans = autoplan.autoplan("gpt3-175b", cluster, global_batch=1536, seq_len=2048, top_k=5, progress=True)
print(plans)
print(plans[0].explain())

# Megatron-LM's published layout for this job (Narayanan et al. 2021): tp 8, pp 8, dp 16
mine = autoplan.estimate("gpt3-175b", cluster, {"tp": 8, "pp": 8, "microbatch": 1, "sp": True},
                         global_batch=1536, seq_len=2048)
print(f"tp8 pp8: {mine.step_time_s:.2f} s/step, MFU {mine.mfu:.1%}, fits: {mine.fits}")
save_plan(plans[0], "gpt3-175b.plan.json")
