"""On spaces small enough to enumerate, the search's best equals the exhaustive optimum under the same cost
model: estimate_config on every candidate of the space (every mesh, microbatch, schedule, recompute, ZeRO
stage and SP setting, with the default split), against search() with its quick-estimate funnel."""

from __future__ import annotations

import dataclasses

import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan.cost import estimate_config
from autoplan.search.search import search
from autoplan.search.space import SearchOptions, enumerate_space

GIB = 2**30


def _estimates(graph, cluster, options: SearchOptions) -> list:
    space = enumerate_space(graph, cluster, options)
    return [estimate_config(graph, cluster, space.config(i), global_batch=options.global_batch)
            for i in range(len(space))]


CASES = {  # (graph, devices per node, nodes, global batch, memory: the share of candidates that fit)
    "ample-4": (gpt_graph(h=512, a=8, layers=4, seq=512, vocab=4096), 4, 1, 8, 1.0),
    "tight-4": (gpt_graph(h=1024, a=8, layers=8, seq=1024, vocab=4096), 4, 1, 8, 0.25),
    "two-nodes": (gpt_graph(h=768, a=12, layers=6, seq=256, vocab=8192), 2, 2, 16, 0.1),
    "moe-4": (gpt_graph(h=256, a=4, layers=4, seq=256, vocab=4096, experts=4, top_k=2), 4, 1, 8, 0.5),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_search_best_equals_the_exhaustive_optimum(case: str) -> None:
    graph, per_node, nodes, batch, share = CASES[case]
    base = a100_cluster(nodes, per_node=per_node)
    options = SearchOptions(global_batch=batch, top_k=3, use_ilp=False)
    estimates = _estimates(graph, base, options)  # capacity only decides `fits`
    peaks = sorted(e.peak_mem_bytes for e in estimates)
    cap = peaks[min(int(share * len(peaks)), len(peaks) - 1)]
    cluster = dataclasses.replace(base, device=dataclasses.replace(base.device, mem_bytes=cap))
    best = min(e.step_time_s for e in estimates if e.peak_mem_bytes <= cap)
    plans = search(graph, cluster, options)
    assert plans[0].estimate.step_time_s == pytest.approx(best, rel=1e-12)
    # refining stage splits and per-layer recompute can only add faster layouts
    refined = search(graph, cluster, dataclasses.replace(options, use_ilp=True))
    assert refined[0].estimate.step_time_s <= best * (1 + 1e-12)
