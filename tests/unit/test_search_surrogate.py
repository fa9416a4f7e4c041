"""The quick (vectorised) estimates track the exact cost model they stand in for: memory to 1 %, time
within the margin the shortlist allows for; and the best quick candidates contain the exact best."""

from __future__ import annotations

import numpy as np
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan import cost
from autoplan.search.space import SearchOptions, enumerate_space
from autoplan.search.surrogate import quick_estimate

GRAPH = gpt_graph(h=1024, a=16, layers=8, seq=1024, vocab=8192)
CLUSTER = a100_cluster(2, per_node=4)


def test_quick_estimates_track_the_exact_ones() -> None:
    space = enumerate_space(GRAPH, CLUSTER, SearchOptions(global_batch=16))
    quick = quick_estimate(GRAPH, CLUSTER, space, 16, cost)
    rows = np.random.default_rng(0).choice(len(space), 120, replace=False)
    exact = [cost.estimate_config(GRAPH, CLUSTER, space.config(r), global_batch=16) for r in rows.tolist()]
    mem = np.array([e.peak_mem_bytes for e in exact]) / quick.peak_mem_bytes[rows]
    time = np.array([e.step_time_s for e in exact]) / quick.step_time_s[rows]
    assert np.abs(mem - 1).max() < 0.01
    assert np.median(np.abs(time - 1)) < 0.1 and time.min() > 0.6 and time.max() < 1.7


def test_exact_best_is_among_the_quick_shortlist() -> None:
    space = enumerate_space(GRAPH, CLUSTER, SearchOptions(global_batch=16, schedules=("1f1b",), zero=(0, 1)))
    quick = quick_estimate(GRAPH, CLUSTER, space, 16, cost)
    exact = np.array([cost.estimate_config(GRAPH, CLUSTER, space.config(r), global_batch=16).step_time_s
                      for r in range(len(space))])
    best = int(np.argmin(exact))
    assert best in np.argsort(quick.step_time_s)[:32].tolist()


def test_vectorised_placement_matches_the_cost_model() -> None:
    from autoplan.plan.types import ParallelConfig
    from autoplan.search.surrogate import _placement

    for pp, dp, ep, cp, tp, node in [(2, 4, 1, 2, 8, 8), (4, 8, 2, 1, 2, 8), (1, 16, 1, 4, 1, 4), (8, 2, 1, 1, 4, 6)]:
        config = ParallelConfig(pp=pp, dp=dp, ep=ep, cp=cp, tp=tp)
        for axes in (("dp", "ep", "cp"), ("dp", "cp"), ("pp",), ("tp",)):
            assert _placement((pp, dp, ep, cp, tp), axes, node, cost) == cost.group_placement(config, axes, node)
