"""The layer table (one estimate per kind of layer and distinct key) equals estimate_layer called for every
layer with each candidate's own configuration, on a dense and a MoE graph: so skipping recompute for
non-block layers and ep for layers without experts loses nothing."""

from __future__ import annotations

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan import cost
from autoplan.search.space import SearchOptions, enumerate_space
from autoplan.search.surrogate import _fields, layer_table


@pytest.mark.parametrize("graph", [gpt_graph(h=512, a=8, layers=3, seq=512, vocab=4096),
                                   gpt_graph(h=256, a=4, layers=3, seq=256, vocab=4096, experts=8, top_k=2)],
                         ids=["dense", "moe"])
def test_layer_table_equals_estimate_layer_for_every_candidate(graph) -> None:
    cluster = a100_cluster(2, per_node=8)
    space = enumerate_space(graph, cluster, SearchOptions(global_batch=32))
    key_of, table = layer_table(graph, cluster, space, cost)
    assert len(np.unique(space.columns["ep"])) > 1 or not graph.blocks[0].num_experts
    for row in np.random.default_rng(1).choice(len(space), 60, replace=False).tolist():
        c = space.config(row)  # the candidate's whole configuration (pp, dp, zero, schedule too)
        want = [_fields(cost.estimate_layer(layer, cluster, c, c.recompute, seq_len=graph.seq_len))
                for layer in graph.layers]
        assert np.array_equal(table[key_of[row]], np.array(want)), c
