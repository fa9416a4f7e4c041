"""The DDP's own passes over the gradients around a once-per-step all-reduce (Engine.dp_grad_passes: Megatron-LM
2021's local DDP flattens, divides and copies back; Engine.dp_overlap_grad_passes: PyTorch DDP's Reducer copies
into its buckets and back) against a hand computation: each pass reads and writes every local gradient once
in the reduce dtype at streaming bandwidth, once per step, with or without data-parallel peers; none for
sharded (reduce-scatter) layouts; the quick estimate moves by the same seconds."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, every_zero_stage, gpt_graph

from autoplan import cost
from autoplan.cost import estimate_config
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig
from autoplan.search.space import SearchOptions, enumerate_space
from autoplan.search.surrogate import quick_estimate

GRAPH = gpt_graph(h=512, a=8, layers=4, seq=512, vocab=4096)
CLUSTER = dataclasses.replace(a100_cluster(2, per_node=4), dtype="fp16")
BASE = every_zero_stage(dataclasses.replace(Engine.load("megatron-lm"), dp_grad_passes=0, dp_overlap_grad_passes=0))


def _step(engine: Engine, config: ParallelConfig) -> float:
    return estimate_config(GRAPH, CLUSTER, config, global_batch=16, engine=engine).step_time_s


def _stream_s(nbytes: float) -> float:
    device = CLUSTER.device
    return nbytes / (device.mem_bw_bytes_per_s * device.mem_bw_efficiency)


@pytest.mark.parametrize("overlap", [False, True])
def test_each_pass_reads_and_writes_every_local_fp16_gradient_once_per_step(overlap: bool) -> None:
    config = ParallelConfig(dp=8, microbatch=1)  # 2 microbatches, tp 1, pp 1: every parameter is local
    base = dataclasses.replace(BASE, dp_comm_overlap=overlap)
    field = "dp_overlap_grad_passes" if overlap else "dp_grad_passes"
    on = dataclasses.replace(base, **{field: 3})
    other = dataclasses.replace(base, **{("dp_grad_passes" if overlap else "dp_overlap_grad_passes"): 3})
    hand = _stream_s(3 * (2 + 2) * GRAPH.num_params)  # 3 passes x (read 2 B + write 2 B) x parameters
    assert math.isclose(_step(on, config) - _step(base, config), hand, rel_tol=1e-9)
    assert _step(other, config) == _step(base, config)  # the other DDP's field is not read


def test_no_passes_with_sharded_gradients() -> None:
    on = dataclasses.replace(BASE, dp_grad_passes=3)
    for config in (ParallelConfig(dp=8, zero=2, microbatch=1), ParallelConfig(dp=8, zero=3, microbatch=1)):
        assert _step(on, config) == _step(BASE, config), config


def test_the_passes_run_without_data_parallel_peers_too() -> None:
    """Megatron-LM's train_step calls allreduce_gradients and DeepSpeed's allreduce_and_copy runs whatever
    the group size: with dp 1 (tp 1, pp 1) the step still grows by the passes over every gradient."""
    on = dataclasses.replace(BASE, dp_grad_passes=3)
    one = dataclasses.replace(a100_cluster(1, per_node=1), dtype="fp16")
    config = ParallelConfig(dp=1, microbatch=1)

    def step(engine: Engine) -> float:
        return estimate_config(GRAPH, one, config, global_batch=16, engine=engine).step_time_s

    hand = _stream_s(3 * (2 + 2) * GRAPH.num_params)
    assert math.isclose(step(on) - step(BASE), hand, rel_tol=1e-9)


def test_the_quick_estimate_moves_by_the_exact_seconds() -> None:
    on = dataclasses.replace(BASE, dp_grad_passes=3)
    space = enumerate_space(GRAPH, CLUSTER, SearchOptions(global_batch=16))
    before = quick_estimate(GRAPH, CLUSTER, space, 16, cost.with_engine(BASE)).step_time_s
    after = quick_estimate(GRAPH, CLUSTER, space, 16, cost.with_engine(on)).step_time_s
    rows = np.random.default_rng(0).choice(len(space), min(40, len(space)), replace=False).tolist()
    for r in rows:
        config = space.config(r)
        want = _step(on, config) - _step(BASE, config)
        assert math.isclose(after[r] - before[r], want, rel_tol=1e-6, abs_tol=1e-12), config


def test_only_the_megatron_engines_ship_the_passes() -> None:
    """megatron-lm: local DDP (3) and torch DDP (2); megatron-deepspeed: DeepSpeed's allreduce_bucket /
    allreduce_and_copy after the schedule (3, no overlap); every other engine reduces without them."""
    shipped = {"megatron-lm": (3, 2), "megatron-deepspeed": (3, 0)}
    for name in Engine.names():
        e = Engine.load(name)
        assert (e.dp_grad_passes, e.dp_overlap_grad_passes) == shipped.get(name, (0, 0)), name
