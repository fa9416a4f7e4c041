"""Megatron's pipeline scatter/gather re-assembly (Engine.pp_recv_all_gather, pp_recv_gather_copy) against a hand
computation: every receive (the activation before the receiver's forward, the gradient before the sender's
backward) all-gathers the whole activation, tp x the 1/tp chunk sent, over the tp group, and with the copy
reads and writes the whole once more; nothing without tp, with sequence parallelism or without a pipeline;
the quick estimate moves by the same seconds."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from test_cost_graph_helper import a100_cluster, every_zero_stage, gpt_graph

from autoplan import cost
from autoplan.cost import comm, estimate_config
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig
from autoplan.search.space import SearchOptions, enumerate_space
from autoplan.search.surrogate import quick_estimate

H, S, MB, B = 1024, 1024, 2, 16
GRAPH = gpt_graph(h=H, a=16, layers=4, seq=S, vocab=8192)
CLUSTER = dataclasses.replace(a100_cluster(1), dtype="fp16")
OFF = every_zero_stage(dataclasses.replace(Engine.load("megatron-lm"), pp_recv_all_gather=False,
                                            pp_recv_gather_copy=False))


def _est(engine: Engine, config: ParallelConfig):
    return estimate_config(GRAPH, CLUSTER, config, global_batch=B, engine=engine)


def test_each_receive_gathers_the_whole_activation_over_tp_and_copies_it_once() -> None:
    config = ParallelConfig(tp=4, pp=2, microbatch=MB)  # 8 microbatches, 1F1B, one cut between the two ranks
    m = B // MB
    whole = MB * S * H * 2  # the activation [s, b, h] in fp16: each tp rank is sent a quarter of it
    group = comm.group_placement(config, ("tp",), CLUSTER.devices_per_node)
    gather = comm.all_gather_s(whole, group, CLUSTER)
    copy = 2 * whole / (CLUSTER.device.mem_bw_bytes_per_s * CLUSTER.device.mem_bw_efficiency)
    base = _est(OFF, config)
    for engine, per_receive in ((dataclasses.replace(OFF, pp_recv_all_gather=True), gather),
                                (dataclasses.replace(OFF, pp_recv_all_gather=True, pp_recv_gather_copy=True),
                                 gather + copy)):
        est = _est(engine, config)
        # each rank receives once per microbatch (rank 1 the activation, rank 0 the gradient): pp_comm grows by
        # m receives; 1F1B's (m + p - 1) slots each grow by one receive
        assert math.isclose(est.breakdown.pp_comm - base.breakdown.pp_comm, m * per_receive, rel_tol=1e-9)
        assert math.isclose(est.step_time_s - base.step_time_s, (m + 1) * per_receive, rel_tol=1e-9)


def test_nothing_without_tp_with_sp_or_without_a_pipeline_or_with_the_field_off() -> None:
    on = dataclasses.replace(OFF, pp_recv_all_gather=True, pp_recv_gather_copy=True)
    for config in (ParallelConfig(tp=1, pp=2, dp=4, microbatch=MB), ParallelConfig(tp=4, pp=2, sp=True, microbatch=MB),
                   ParallelConfig(tp=8, pp=1, microbatch=MB)):
        assert _est(on, config).step_time_s == _est(OFF, config).step_time_s, config
    copy_only = dataclasses.replace(OFF, pp_recv_gather_copy=True)  # the copy belongs to the gather
    config = ParallelConfig(tp=4, pp=2, microbatch=MB)
    assert _est(copy_only, config).step_time_s == _est(OFF, config).step_time_s


def test_the_quick_estimate_moves_by_the_exact_seconds() -> None:
    on = dataclasses.replace(OFF, pp_recv_all_gather=True, pp_recv_gather_copy=True)
    space = enumerate_space(GRAPH, CLUSTER, SearchOptions(global_batch=B))
    before = quick_estimate(GRAPH, CLUSTER, space, B, cost.with_engine(OFF)).step_time_s
    after = quick_estimate(GRAPH, CLUSTER, space, B, cost.with_engine(on)).step_time_s
    cols = space.columns
    piped = np.flatnonzero((cols["pp"] > 1) & (cols["tp"] > 1))
    assert len(piped) > 0
    rng = np.random.default_rng(0)
    rows = np.concatenate([rng.choice(piped, min(25, len(piped)), replace=False),
                           rng.choice(len(space), 15, replace=False)]).tolist()
    for r in rows:
        config = space.config(r)
        want = _est(on, config).step_time_s - _est(OFF, config).step_time_s
        assert math.isclose(after[r] - before[r], want, rel_tol=1e-6, abs_tol=1e-12), config


def test_megatron_lm_ships_both() -> None:
    e = Engine.load("megatron-lm")
    assert e.pp_recv_all_gather and e.pp_recv_gather_copy
    for name in Engine.names():
        if name != "megatron-lm":
            assert not Engine.load(name).pp_recv_all_gather, name
