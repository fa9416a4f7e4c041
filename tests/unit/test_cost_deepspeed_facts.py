"""The DeepSpeed ZeRO-3 facts the exact model (cost/deepspeed.py, cost/deepspeedrank.py) and the quick estimate
(search/deepspeed_terms.py) share, each from one function that takes floats and numpy arrays alike: the host
split over forward, recompute and backward, the copy-out's host time per gather, the weight tensors of a
layer and the largest of them, checked against hand computations and against each other."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, every_zero_stage, gpt_graph

from autoplan import cost
from autoplan.cost import deepspeed as ds
from autoplan.cost.deepspeedrank import (
    fetch_norm_bytes,
    gather_host_s,
    gather_pass_bytes,
    layer_numels,
    weight_count,
    weight_numels,
)
from autoplan.graph.types import LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig

H, F = 512, 2048


def _swiglu_graph():
    """gpt_graph with a third MLP matmul per block (h x f more parameters, 2 h f more FLOPs per token):
    what block_shape reads as SwiGLU (n_mlp 3)."""
    graph = gpt_graph(h=H, a=8, layers=2, seq=256, vocab=4096)
    tok = float(graph.microbatch * graph.seq_len)
    layers = [dataclasses.replace(x, fwd_matmul_flops=x.fwd_matmul_flops + 2.0 * tok * H * F,
                                  num_params=x.num_params + H * F) if x.role is LayerRole.BLOCK else x
              for x in graph.layers]
    return dataclasses.replace(graph, layers=layers)


@pytest.mark.parametrize("recompute, want", [(False, (4.0, 0.0, 8.0)), (True, (3.0, 3.0, 6.0))])
def test_host_shares_are_one_one_two_for_floats_and_arrays(recompute: bool, want: tuple) -> None:
    """12 s of host time: 4 forward + 8 backward, or 3 + 3 recomputed + 6; an array of candidates gets the
    same per row, and block_modules hands its modules exactly those shares."""
    assert ds.host_shares(12.0, recompute) == pytest.approx(want)
    got = ds.host_shares(np.array([12.0, 24.0]), np.array([recompute, recompute]))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, [w, 2.0 * w])
    mods, recs = ds.block_modules([1.0, 3.0], 1.0, 2.0, 0.5, 12.0, recompute)
    assert sum(m.host_fwd_s for m in mods) == pytest.approx(want[0])
    assert sum(m.host_bwd_s for m in mods) == pytest.approx(want[2])
    assert sum(m.host_fwd_s for m in recs) == pytest.approx(want[0])  # used only with recompute


def test_gather_host_seconds_by_hand_for_floats_and_arrays() -> None:
    """n = 1200 ranks at 10 us an op: 1200 narrows at a third of an op before the gather, 1200 C++ copies at
    two thirds while it runs, 200 of them past the 1000-deep stream queue; none without the copy-out."""
    engine = Engine.load("deepspeed")
    want = (1200 / 3 * 1e-5, 1200 * 2 / 3 * 1e-5, 200 * 2 / 3 * 1e-5)
    assert gather_host_s(engine, 1200, 1e-5) == pytest.approx(want)
    arrays = gather_host_s(engine, np.array([[1200.0, 8.0]]), 1e-5)
    for a, w, w8 in zip(arrays, want, (8 / 3 * 1e-5, 16 / 3 * 1e-5, 0.0)):
        np.testing.assert_allclose(a[0], [w, w8])
    off = dataclasses.replace(engine, zero3_gather_copy_out=False)
    assert gather_host_s(off, 1200, 1e-5) == (0.0, 0.0, 0.0)


def test_weight_tensors_by_hand_gpt_and_swiglu() -> None:
    """A GPT block gathers QKV (3 h^2), projection + the rest, two MLP matmuls (h f): 4 tensors; a SwiGLU
    block 5; embedding and head one each. At tp 2 each matmul halves; an array of parameter counts gives
    what each count alone gives."""
    gpt, swiglu = gpt_graph(h=H, a=8, layers=2, seq=256, vocab=4096), _swiglu_graph()
    block = next(x for x in gpt.layers if x.role is LayerRole.BLOCK)
    params = float(3 * H * H + H * H + 2 * H * F + 100)
    assert weight_numels(block, gpt, 2, params) == [3 * H * H / 2, H * H / 2 + params - (4 * H * H + 2 * H * F) / 2,
                                                    H * F / 2, H * F / 2]
    counts = np.array([params, 2 * params])
    got = weight_numels(block, gpt, np.array([2, 2]), counts)
    for i, p in enumerate(counts.tolist()):
        assert [float(np.broadcast_to(x, 2)[i]) for x in got] == weight_numels(block, gpt, 2, p)
    assert [weight_count(x, gpt) for x in gpt.layers] == [1, 4, 4, 1]
    assert [weight_count(x, swiglu) for x in swiglu.layers] == [1, 5, 5, 1]


def test_quick_largest_weight_and_block_tensors_are_the_exact_models() -> None:
    """search/deepspeed_terms.max_param_numel (from the layer table) is, per candidate, the largest of
    layer_numels over the graph's layers as the exact model computes them (estimate_layer at the candidate's
    tp); block_weights is the exact model's tensor count per block."""
    from autoplan.search.deepspeed_terms import block_weights, max_param_numel
    from autoplan.search.space import SearchOptions, enumerate_space
    from autoplan.search.surrogate import FIELDS, layer_table

    graph, cluster = _swiglu_graph(), a100_cluster()
    space = enumerate_space(graph, cluster, SearchOptions(global_batch=8))
    key_of, table = layer_table(graph, cluster, space, cost)
    got = max_param_numel(graph, table, key_of, space.columns["tp"],
                          (FIELDS.index("dense_params"), FIELDS.index("expert_params")))
    for tp in sorted(set(space.columns["tp"].tolist())):
        config = ParallelConfig(tp=tp)
        want = max(max(layer_numels(x, cost.estimate_layer(x, cluster, config, "none", seq_len=graph.seq_len),
                                    graph, config)) for x in graph.layers)
        np.testing.assert_allclose(got[space.columns["tp"] == tp], want, rtol=1e-12)
    assert block_weights(graph) == 5.0



def test_gather_passes_and_fetch_norm_bytes_by_hand() -> None:
    """1e6 elements at 2 bytes: a 2 MB zero fill before the gather, a 4 MB copy-out (read + write) after, a
    2 MB norm read per fetch; none with the fields off; arrays of parameters alike."""
    engine = Engine.load("deepspeed")
    assert gather_pass_bytes(engine, 1e6, 2.0) == (2e6, 4e6)
    assert fetch_norm_bytes(engine, 1e6, 2.0) == 2e6
    fill, copy = gather_pass_bytes(engine, np.array([1e6, 3e6]), 2.0)
    np.testing.assert_array_equal(fill, [2e6, 6e6])
    np.testing.assert_array_equal(copy, [4e6, 12e6])
    off = dataclasses.replace(engine, zero3_gather_copy_out=False, zero3_fetch_norm=False)
    assert gather_pass_bytes(off, 1e6, 2.0) == (0.0, 0.0)
    assert fetch_norm_bytes(off, 1e6, 2.0) == 0.0


@pytest.mark.parametrize("engine, mean, worst", [("deepspeed", 0.04, 0.08), ("deepspeed-2024", 0.075, 0.3)])
def test_quick_tracks_the_exact_model_on_a_swiglu_graph(engine: str, mean: float, worst: float) -> None:
    """ZeRO-3 candidates of a SwiGLU model: the quick estimate (equal sub-modules, as many as the exact
    model's: 5 a block, embedding and head one each; the 2021 engine's zero fills, copy-outs and fetch norms
    priced as the exact model's) within `mean` on average and `worst` at worst of the exact step time. Before
    the quick estimate took those from the exact model's functions (4 sub-modules a layer, no fills, copy-outs
    or norms) it was off by 5.3 % / 8.2 % on average, 10.8 % / 51 % at worst."""
    from autoplan.search.space import SearchOptions, enumerate_space
    from autoplan.search.surrogate import quick_estimate

    graph, cluster = _swiglu_graph(), dataclasses.replace(a100_cluster(2, per_node=4), dtype="bf16")
    eng = cost.with_engine(every_zero_stage(Engine.load(engine)))
    space = enumerate_space(graph, cluster, SearchOptions(global_batch=16))
    rows = [r for r in range(len(space)) if space.config(r).zero == 3][::7][:40]
    quick = quick_estimate(graph, cluster, space, 16, eng).step_time_s[rows]
    exact = np.array([eng.estimate_config(graph, cluster, space.config(r), global_batch=16).step_time_s for r in rows])
    err = np.abs(quick / exact - 1.0)
    assert err.mean() < mean and err.max() < worst, (err.mean(), err.max())
