"""Work spread over cores gives the same answer as one piece: run_parts keeps order and raises a worker's
error; the quick estimates in pieces of whole layer-table keys equal the quick estimate of the whole space."""

from __future__ import annotations

import dataclasses
import importlib
import os

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan.search import parallel
from autoplan.search.space import SearchOptions, enumerate_space
from autoplan.search.surrogate import quick_estimate, split_by_layer_key

search_module = importlib.import_module("autoplan.search.search")
cost = importlib.import_module("autoplan.cost")


def test_run_parts_keeps_order_and_uses_other_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "usable_cores", lambda: 2)
    out = parallel.run_parts(lambda x: (x * x, os.getpid()), [1, 2, 3, 4, 5])
    assert [v for v, _ in out] == [1, 4, 9, 16, 25]
    assert out[0][1] == os.getpid() and out[1][1] != os.getpid()  # the parent takes the first of each round


def test_run_parts_raises_the_workers_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "usable_cores", lambda: 2)

    def fail_on_two(x: int) -> int:
        if x == 2:
            raise ValueError("part 2 failed")
        return x

    with pytest.raises(ValueError, match="part 2 failed"):
        parallel.run_parts(fail_on_two, [1, 2])


def test_quick_estimates_in_pieces_equal_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = gpt_graph(h=1024, a=16, layers=8, seq=2048, vocab=8192)
    cluster = a100_cluster(8, per_node=8)
    space = enumerate_space(graph, cluster, SearchOptions(global_batch=64))
    pieces = split_by_layer_key(space, 2)
    assert sorted(np.concatenate(pieces).tolist()) == list(range(len(space)))
    assert abs(len(pieces[0]) - len(pieces[1])) < 0.2 * len(space)  # balanced
    whole = quick_estimate(graph, cluster, space, 64, cost)
    monkeypatch.setattr(search_module, "QUICK_SPLIT_MIN", 0)
    monkeypatch.setattr(parallel, "usable_cores", lambda: 2)
    split = search_module._quick_estimates(graph, cluster, space, 64, cost)
    for f in dataclasses.fields(whole):
        assert np.array_equal(getattr(split, f.name), getattr(whole, f.name)), f.name
