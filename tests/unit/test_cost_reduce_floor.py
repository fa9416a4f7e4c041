"""The asynchronous reduction stream's lower bound (cost.pipeline.reduce_stream_floor_s): every-microbatch
gradient reductions that the backward does not wait for (Engine.grad_reduce_async) exist only after a
rank's first backward, and one communicator runs them back to back, so a rank's stream ends no earlier than
(microbatch 0's forward through every stage) + (its gradient's way back to the rank) + m x (the rank's
reductions per microbatch). Checked against hand computations."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan.cost import comm, estimate_config, estimate_layer
from autoplan.cost.dataparallel import dp_groups
from autoplan.cost.pipeline import reduce_stream_floor_s
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig


def test_floor_by_hand() -> None:
    """Two ranks, forward 1 and 2, backward 3 and 4, reductions 0.5 and 0.1 per microbatch, m = 4. 1F1B:
    rank 0 starts its first backward after 1 + 2 (microbatch 0's forward) + 4 (rank 1's backward): 7, then
    4 x 0.5: 9; rank 1 at 3, + 0.4: 3.4. Two chunks per rank: the way back is one chunk, 4 / 2: 3 + 2 + 2 =
    7. No reductions: no bound. Rows of candidates with their own m and chunks: the same figures."""
    assert reduce_stream_floor_s([1.0, 2.0], [3.0, 4.0], [0.5, 0.1], 4, 1) == pytest.approx(9.0, rel=1e-12)
    assert reduce_stream_floor_s([1.0, 2.0], [3.0, 4.0], [0.5, 0.1], 4, 2) == pytest.approx(7.0, rel=1e-12)
    assert reduce_stream_floor_s([1.0, 2.0], [3.0, 4.0], [0.0, 0.0], 4, 1) == 0.0
    rows = reduce_stream_floor_s(np.array([[1.0, 2.0], [1.0, 2.0]]), np.array([[3.0, 4.0], [3.0, 4.0]]),
                                 np.array([[0.5, 0.1], [0.0, 1.0]]), np.array([4.0, 2.0]), np.array([1.0, 2.0]))
    assert rows == pytest.approx([9.0, 3.0 + 0.0 + 2.0], rel=1e-12)


def _setup(nic_bw: float):
    """A Llama-3-like pipeline at small scale: pp 8 x dp 2, interleaved with 8 chunks per rank (embedding +
    64 blocks of h 8192 + head over 64 stages, one block per chunk as the published runs), one GPU per
    node (the data-parallel reduce-scatters cross the NIC), ZeRO-2 under megatron-core (every microbatch,
    fp32 on the wire) with Llama 3's grad_reduce_async, one reduce-scatter per layer, ideal links, 16
    microbatches of one sequence."""
    graph = gpt_graph(h=8192, a=64, layers=64, seq=2048, vocab=8192, unfused=False)
    cluster = a100_cluster(16, per_node=1, nic_bw=nic_bw, ideal=True)
    config = ParallelConfig(pp=8, dp=2, zero=2, schedule="interleaved", virtual_stages=8)
    engine = dataclasses.replace(Engine.load("megatron-core"), grad_reduce_async=True, dp_bucket_numel=0)
    return graph, cluster, config, engine


def _by_hand(graph, cluster, config, engine, m: int) -> tuple[float, float]:
    """(the bound, rank 0's reductions per microbatch): stage i on rank i % pp (Megatron's looped placement)
    with the default split's layers; microbatch 0's forward through every layer, the way back to rank r
    (a chunk, 1 / virtual_stages of a rank's backward, per later rank), m x rank r's fp32 reduce-scatters,
    each microbatch's stream also giving way on the shared NIC to the rank's pipeline hops for its busy share
    (cost.pipeline.nic_shared_reduce_s: one GPU per node, so every hop crosses nodes): u x hops, u =
    min(1, reductions / (layers + hops)), a rank's hops its cuts (15 on the end ranks, 16 inside) x one p2p."""
    from autoplan.cost.hetero import default_split

    costs = {layer.name: estimate_layer(layer, cluster, config, "none", seq_len=graph.seq_len, engine=engine)
             for layer in graph.layers}
    group = dp_groups(config, cluster).dense
    per_rank = [[] for _ in range(config.pp)]
    for i, names in enumerate(default_split(graph, cluster, config, config.dp * m)):
        per_rank[i % config.pp] += [costs[n] for n in names]
    fwd = [sum(c.fwd_s + c.fwd_comm_s for c in r) for r in per_rank]
    bwd = [sum(c.time_s for c in r) - f for r, f in zip(per_rank, fwd)]
    red = [sum(comm.reduce_scatter_s(c.grad_param_count * 4.0, group, cluster) for c in r) for r in per_rank]
    stages = config.pp * config.virtual_stages
    cuts = [sum((i % config.pp == k) + ((i + 1) % config.pp == k) for i in range(stages - 1))
            for k in range(config.pp)]
    hops = [n * comm.p2p_s(graph.blocks[0].output_bytes, True, cluster) for n in cuts]
    busy = [min(1.0, red[k] / (fwd[k] + bwd[k] + hops[k])) for k in range(config.pp)]
    ends = [sum(fwd) + sum(bwd[k + 1:]) / config.virtual_stages + m * (red[k] + busy[k] * hops[k])
            for k in range(config.pp)]
    return max(ends), red[0]


def _without_floor(monkeypatch, *args, **kwargs):
    import autoplan.cost.estimate as est

    with monkeypatch.context() as patch:
        patch.setattr(est, "reduce_stream_floor_s", lambda *a, **k: 0.0)
        return estimate_config(*args, **kwargs)


@pytest.mark.parametrize("nic_bw", [4e10, 5e10])
def test_a_link_bound_pipeline_ends_with_its_reduction_stream(nic_bw: float, monkeypatch) -> None:
    """With a microbatch's reductions about as long as its compute, the step is the bound by hand + the
    optimizer, above the per-microbatch pricing (m slots of max(compute, reductions) + the interleaved
    bubble), which leaves out the warm-up forwards that come before any gradient; dp_comm carries the
    difference."""
    graph, cluster, config, engine = _setup(nic_bw)
    floor, _ = _by_hand(graph, cluster, config, engine, 16)
    est = estimate_config(graph, cluster, config, global_batch=32, engine=engine)
    before = _without_floor(monkeypatch, graph, cluster, config, global_batch=32, engine=engine)
    opt = est.breakdown.optimizer
    assert floor > before.step_time_s - opt  # the warm-up is longer than the bubble: the bound binds
    assert est.step_time_s == pytest.approx(floor + opt, rel=1e-9)
    assert est.breakdown.dp_comm - before.breakdown.dp_comm == pytest.approx(est.step_time_s - before.step_time_s,
                                                                             rel=1e-9)


def test_a_compute_bound_pipeline_is_unchanged_by_the_floor(monkeypatch) -> None:
    """With a fast link the reductions hide behind the compute: the bound by hand stays below the step,
    which is the one priced without it."""
    graph, cluster, config, engine = _setup(1e13)
    floor, _ = _by_hand(graph, cluster, config, engine, 16)
    est = estimate_config(graph, cluster, config, global_batch=32, engine=engine)
    before = _without_floor(monkeypatch, graph, cluster, config, global_batch=32, engine=engine)
    assert floor < est.step_time_s - est.breakdown.optimizer
    assert est.step_time_s == before.step_time_s


@pytest.mark.parametrize("nic_bw", [4e10, 5e10])
def test_the_quick_estimate_applies_the_same_floor(nic_bw: float, monkeypatch) -> None:
    """The quick estimate (search/schedules.by_schedule) prices the same bound from the same per-rank terms:
    the candidate of the exact check above gets the exact model's step, which the bound set."""
    from autoplan import cost
    from autoplan.search.space import SearchOptions, enumerate_space
    from autoplan.search.surrogate import quick_estimate

    graph, cluster, config, engine = _setup(nic_bw)
    space = enumerate_space(graph, cluster, SearchOptions(global_batch=32, zero=(2,)))
    row = next(r for r in range(len(space)) if space.config(r) == config)
    eng = cost.with_engine(engine)
    exact = eng.estimate_config(graph, cluster, config, global_batch=32).step_time_s
    before = _without_floor(monkeypatch, graph, cluster, config, global_batch=32, engine=engine).step_time_s
    assert exact > before
    assert quick_estimate(graph, cluster, space, 32, eng).step_time_s[row] == pytest.approx(exact, rel=1e-9)
