"""End-to-end planning time (capture included, torch import excluded) for the two reference jobs of
issue 3; prints figures and the ranked plans.

    python bench/plan_speed.py            # both jobs
    python bench/plan_speed.py --job 405b
"""

from __future__ import annotations

import argparse
import time

JOBS = {
    "175b": {"model": "gpt3-175b", "cluster": "dgx-a100-80gb", "num_nodes": 128, "global_batch": 1536,
             "seq_len": 2048},
    "405b": {"model": "llama3-405b", "cluster": "dgx-h100-80gb", "num_nodes": 2048, "global_batch": 2048,
             "seq_len": 8192},
}


def run(job: dict) -> None:
    import torch

    from autoplan.cluster.load import Cluster
    from autoplan.graph.capture import capture
    from autoplan.models import preset
    from autoplan.search.api import Plans
    from autoplan.search.search import search
    from autoplan.search.space import SearchOptions, enumerate_space

    t0, c0 = time.perf_counter(), time.process_time()
    with torch.device("meta"):
        model = preset(job["model"])
    graph = capture(model, seq_len=job["seq_len"], microbatch=1, model_name=job["model"])
    t1 = time.perf_counter()
    cluster = Cluster.load(job["cluster"], num_nodes=job["num_nodes"])
    options = SearchOptions(global_batch=job["global_batch"], top_k=5)
    plans = Plans(search(graph, cluster, options))
    t2, c2 = time.perf_counter(), time.process_time()
    n = len(enumerate_space(graph, cluster, options))
    print(f"{job['model']} on {cluster.num_devices} x {cluster.device.name}: capture {t1 - t0:.1f} s, "
          f"search {t2 - t1:.1f} s over {n:,} candidates, end to end {t2 - t0:.1f} s wall "
          f"({c2 - c0:.1f} s CPU; the machine is shared, so wall time depends on the load)")
    print(plans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", choices=sorted(JOBS), action="append")
    args = parser.parse_args()
    for name in args.job or sorted(JOBS):
        run(JOBS[name])


if __name__ == "__main__":
    main()
