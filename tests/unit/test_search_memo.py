"""One search's exact estimates are each made once (search/memo.py): the same arguments give the very object
the cost model returned, other arguments another estimate, and a search finds the same plans with it."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan import cost
from autoplan.plan.types import ParallelConfig, Recompute
from autoplan.search.memo import MemoCost
from autoplan.search.search import search
from autoplan.search.space import SearchOptions

GRAPH = gpt_graph(h=512, a=8, layers=4, seq=512, vocab=4096)
CLUSTER = a100_cluster(1, per_node=8)


class Counting:
    """The cost module, counting estimate_config calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __getattr__(self, name: str):
        return getattr(cost, name)

    def estimate_config(self, *args, **kwargs):
        self.calls += 1
        return cost.estimate_config(*args, **kwargs)


def test_the_same_arguments_are_estimated_once() -> None:
    counting = Counting()
    memo = MemoCost(counting)
    config = ParallelConfig(tp=2, dp=4)
    first = memo.estimate_config(GRAPH, CLUSTER, config, global_batch=16)
    assert memo.estimate_config(GRAPH, CLUSTER, config, global_batch=16) is first and counting.calls == 1
    assert first == cost.estimate_config(GRAPH, CLUSTER, config, global_batch=16)
    other = memo.estimate_config(GRAPH, CLUSTER, config, global_batch=32)
    assert other != first and counting.calls == 2
    split = (tuple(layer.name for layer in GRAPH.layers),)
    recompute = {GRAPH.layers[1].name: Recompute.FULL}
    with_split = memo.estimate_config(GRAPH, CLUSTER, config, global_batch=16, stages=split,
                                      layer_recompute=recompute)
    assert with_split.step_time_s > first.step_time_s and counting.calls == 3  # a recomputed layer costs time
    assert memo.estimate_config(GRAPH, CLUSTER, config, global_batch=16, stages=split,
                                layer_recompute=dict(recompute)) is with_split and counting.calls == 3
    bigger = dataclasses.replace(CLUSTER, num_nodes=2)
    memo.estimate_config(GRAPH, bigger, ParallelConfig(tp=2, dp=8), global_batch=16)
    assert counting.calls == 4


def test_remembered_estimates_are_handed_back_and_other_names_pass_through() -> None:
    counting = Counting()
    memo = MemoCost(counting)
    config = ParallelConfig(dp=8)
    made = cost.estimate_config(GRAPH, CLUSTER, config, global_batch=16)
    memo.remember(GRAPH, CLUSTER, config, made, global_batch=16)
    assert memo.estimate_config(GRAPH, CLUSTER, config, global_batch=16) is made and counting.calls == 0
    assert memo.balanced_stages is cost.balanced_stages


def test_a_search_finds_the_same_plans_as_with_every_estimate_made_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    options = SearchOptions(global_batch=16, top_k=3)
    plans = search(GRAPH, CLUSTER, options)

    class Afresh(MemoCost):  # no memo: every call goes to the cost model
        def estimate_config(self, graph, cluster, config, **kwargs):
            return cost.estimate_config(graph, cluster, config, **kwargs)

    monkeypatch.setattr(importlib.import_module("autoplan.search.search"), "MemoCost", Afresh)
    assert search(GRAPH, CLUSTER, options) == plans
