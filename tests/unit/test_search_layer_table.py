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


@pytest.mark.parametrize("engine", [None, "torchtitan", "megatron-lm"])
@pytest.mark.parametrize("graph", [gpt_graph(h=512, a=8, layers=3, seq=512, vocab=4096),
                                   gpt_graph(h=256, a=4, layers=3, seq=256, vocab=4096, experts=8, top_k=2)],
                         ids=["dense", "moe"])
def test_layer_table_equals_estimate_layer_for_every_candidate(graph, engine) -> None:
    from autoplan.plan.engine import Engine

    model = cost if engine is None else cost.with_engine(Engine.load(engine))
    cluster = a100_cluster(2, per_node=8)
    space = enumerate_space(graph, cluster, SearchOptions(global_batch=32))
    key_of, table = layer_table(graph, cluster, space, model)
    assert len(np.unique(space.columns["ep"])) > 1 or not graph.blocks[0].num_experts
    for row in np.random.default_rng(1).choice(len(space), 60, replace=False).tolist():
        c = space.config(row)  # the candidate's whole configuration (pp, dp, zero, schedule too)
        want = [_fields(model.estimate_layer(layer, cluster, c, c.recompute, seq_len=graph.seq_len))
                for layer in graph.layers]
        assert np.array_equal(table[key_of[row]], np.array(want)), c


def test_a_second_table_on_the_same_cluster_estimates_nothing(tmp_path, monkeypatch) -> None:
    import dataclasses

    from autoplan.search import surrogate

    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path))
    graph = gpt_graph(h=512, a=8, layers=3, seq=512, vocab=4096)
    cluster = a100_cluster(1, per_node=8)
    space = enumerate_space(graph, cluster, SearchOptions(global_batch=16))
    calls = []
    real = surrogate._estimate
    monkeypatch.setattr(surrogate, "_estimate", lambda *a: calls.append(1) or real(*a))
    first = layer_table(graph, cluster, space, cost)
    n = len(calls)
    second = layer_table(graph, cluster, space, cost)
    assert n > 0 and len(calls) == n  # every per-layer cost came from the memo
    assert np.array_equal(first[1], second[1]) and np.array_equal(first[0], second[0])
    faster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, mem_bw_bytes_per_s=3e12))
    layer_table(graph, faster, enumerate_space(graph, faster, SearchOptions(global_batch=16)), cost)
    assert len(calls) == 2 * n  # another cluster is another entry
    for entry in (tmp_path / "layer-costs").iterdir():
        entry.write_bytes(b"not an npz")
    assert np.array_equal(layer_table(graph, cluster, space, cost)[1], first[1])  # unreadable: recomputed
    assert len(calls) == 3 * n


def test_pieces_writing_one_entry_at_once_keep_every_row(tmp_path, monkeypatch) -> None:
    """The search's pieces add rows to the same layer's entry side by side (in forked processes): the entry
    lock keeps both pieces' rows, so a second plan estimates nothing."""
    from autoplan.search import layercache, parallel

    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(parallel, "usable_cores", lambda: 2)
    graph = gpt_graph(h=512, a=8, layers=3, seq=512, vocab=4096)
    cluster = a100_cluster(1, per_node=8)
    layer, fields = graph.layers[1], ("a", "b")

    def write(start: int) -> int:
        keys = np.arange(start, start + 40, dtype=np.int64)[:, None]
        for i in range(0, 40, 4):  # many small merges, interleaving with the other piece's
            layercache.layer_costs(layer, cluster, graph.seq_len, fields, keys[i:i + 4],
                                   lambda missing, i=i: np.full((len(missing), 2), float(start + i)))
        return start

    assert parallel.run_parts(write, [0, 1000]) == [0, 1000]
    every = np.concatenate([np.arange(40), np.arange(1000, 1040)])[:, None]
    missing = []
    layercache.layer_costs(layer, cluster, graph.seq_len, fields, every,
                           lambda rows: missing.append(len(rows)) or np.zeros((len(rows), 2)))
    assert missing == []


def test_a_key_config_is_the_validated_config() -> None:
    """surrogate.key_config (no checks) gives the ParallelConfig the constructor gives for every layer-table
    key of a space: equal, same hash, same fields and types (sp dropped at tp 1, as __post_init__ does)."""
    import dataclasses

    from autoplan.plan.types import ParallelConfig
    from autoplan.search.space import RECOMPUTES
    from autoplan.search.surrogate import key_config

    graph = gpt_graph(h=256, a=4, layers=3, seq=256, vocab=4096, experts=8, top_k=2)
    space = enumerate_space(graph, a100_cluster(2, per_node=8), SearchOptions(global_batch=32))
    c = space.columns
    for i in np.random.default_rng(3).choice(len(space), 200, replace=False).tolist():
        tp, cp, ep, sp, mb, rec, etp, eep, dp = (int(c[k][i]) for k in ("tp", "cp", "ep", "sp", "microbatch",
                                                                        "recompute", "etp", "eep", "dp"))
        fields = {"tp": tp, "cp": cp, "ep": ep, "microbatch": mb, "recompute": RECOMPUTES[rec], "dp": dp, "etp": etp,
                  "eep": eep}
        want = ParallelConfig(sp=bool(sp), **fields)
        got = key_config(sp=bool(sp) and tp > 1, **fields)
        assert got == want and hash(got) == hash(want)
        assert [(type(getattr(got, f.name)), getattr(got, f.name)) for f in dataclasses.fields(ParallelConfig)] == \
               [(type(getattr(want, f.name)), getattr(want, f.name)) for f in dataclasses.fields(ParallelConfig)]
    assert key_config(tp=1, sp=False) == ParallelConfig(tp=1, sp=True)
