"""Engine.grad_buffer_passes (Megatron-Core's contiguous fp32 gradient buffer: zero_grad_buffer's fill every step
and Bucket.start_grad_sync's 1 / dp scale before each bucket's collective; engines/megatron-core.yaml) against hand
computations: the step grows by 12 bytes per local parameter (a 4-byte write, a 4-byte read + write) at the
device's streaming rate with more than one data-parallel rank, by the fill's 4 bytes alone with one; nothing for a
layout that reduces every microbatch; the quick estimate moves by the same seconds."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from test_cost_graph_helper import gpt_graph

from autoplan import cost
from autoplan.cluster.load import Cluster
from autoplan.cost import estimate_config
from autoplan.cost.gradpasses import grad_buffer_passes_s
from autoplan.plan.engine import Engine
from autoplan.plan.layout import zero_layout
from autoplan.plan.types import ParallelConfig
from autoplan.search.space import SearchOptions, enumerate_space
from autoplan.search.surrogate import quick_estimate

GRAPH = gpt_graph(h=2048, a=16, layers=8, seq=2048, vocab=32768)
CLUSTER = Cluster.load("dgx-h100-80gb", num_nodes=2)  # bf16: fp32 main grads (grad_reduce_fp32)
MCORE = Engine.load("megatron-core")
OFF = dataclasses.replace(MCORE, grad_buffer_passes=False)
RATE = 3.35e12 * 0.85  # dgx-h100-80gb: mem_bw_bytes_per_s x mem_bw_efficiency


def _step(config: ParallelConfig, engine: Engine, cluster=CLUSTER) -> float:
    return estimate_config(GRAPH, cluster, config, global_batch=32, engine=engine).step_time_s


def _local_params(config: ParallelConfig, cluster=CLUSTER) -> float:
    """The parameters one rank holds: its bf16 weights (2 bytes each, unsharded under ZeRO-0/1) as the estimate
    counts them, checked against the hand count of the graph's 541,282,304 parameters over tp 8 (norms and
    row-parallel biases stay whole, so a little more)."""
    held = estimate_config(GRAPH, cluster, config, global_batch=32, engine=MCORE).memory.weights / 2
    assert 541_282_304 / 8 <= held <= 1.01 * 541_282_304 / 8
    return held


def test_hand_figures_of_the_passes() -> None:
    config = ParallelConfig(dp=2, tp=8, zero=1, microbatch=1)
    layout = zero_layout(config, 16)
    assert math.isclose(grad_buffer_passes_s(1e9, CLUSTER, config, layout, MCORE), 12e9 / RATE, rel_tol=1e-12)
    single = ParallelConfig(dp=1, tp=8, pp=2, zero=1, microbatch=1)
    assert math.isclose(grad_buffer_passes_s(1e9, CLUSTER, single, zero_layout(single, 32), MCORE), 4e9 / RATE,
                        rel_tol=1e-12)  # gradient_scaling_factor 1.0: the fill only
    assert grad_buffer_passes_s(1e9, CLUSTER, config, layout, OFF) == 0.0
    fsdp = ParallelConfig(dp=2, tp=8, zero=3, microbatch=1)
    assert grad_buffer_passes_s(1e9, CLUSTER, fsdp, zero_layout(fsdp, 16), MCORE) == 0.0  # reduces every microbatch


def test_the_step_grows_by_the_passes_over_the_local_gradients() -> None:
    node = Cluster.load("dgx-h100-80gb", num_nodes=1)
    for config, per, cluster in ((ParallelConfig(dp=2, tp=8, zero=1, microbatch=1), 12.0, CLUSTER),
                                 (ParallelConfig(dp=2, tp=8, zero=0, microbatch=1), 12.0, CLUSTER),  # all-reduce alike
                                 (ParallelConfig(dp=1, tp=8, zero=0, microbatch=1), 4.0, node)):
        grown = _step(config, MCORE, cluster) - _step(config, OFF, cluster)
        assert math.isclose(grown, per * _local_params(config, cluster) / RATE, rel_tol=1e-6), config


def test_the_quick_estimate_moves_by_the_exact_seconds() -> None:
    space = enumerate_space(GRAPH, CLUSTER, SearchOptions(global_batch=32, zero=(0, 1, 3)))
    flat = np.flatnonzero(space.columns["pp"] == 1)
    rows = np.random.default_rng(5).choice(flat, min(16, len(flat)), replace=False).tolist()
    on = quick_estimate(GRAPH, CLUSTER, space, 32, cost.with_engine(MCORE)).step_time_s
    off = quick_estimate(GRAPH, CLUSTER, space, 32, cost.with_engine(OFF)).step_time_s
    moved = 0
    for r in rows:
        config = space.config(r)
        want = _step(config, MCORE) - _step(config, OFF)
        assert math.isclose(on[r] - off[r], want, rel_tol=1e-6, abs_tol=1e-12), config
        moved += want > 0
    assert moved > 0
