"""The quick estimate's once-per-step gradient reduction without dp_comm_overlap (search/assemble.py
_step_tail) reduces the experts' gradients as the exact model's whole() does (cost/dataparallel.py
rank_dp_times): with the layout's collective, a reduce-scatter where ZeRO shards the optimizer (the executor
wraps the experts in fully_shard over the expert mesh: execute/fsdp.py apply_data_parallel), not an
all-reduce whatever the layout."""

from __future__ import annotations

import dataclasses

import numpy as np
from test_cost_graph_helper import a100_cluster, every_zero_stage, gpt_graph, quick_and_exact

from autoplan.cost.experts import expert_dp_placement
from autoplan.plan.engine import Engine
from autoplan.plan.layout import zero_layout
from autoplan.search.space import SearchOptions, enumerate_space

MOE = gpt_graph(h=512, a=8, layers=4, seq=256, vocab=1024, experts=8, top_k=2, unfused=False)
CLUSTER = a100_cluster(2, per_node=4)  # dp crosses the two nodes: the reduction is a visible part of the step
ENGINE = dataclasses.replace(every_zero_stage(Engine.load("autoplan")), dp_comm_overlap=False)


def _rows(zero: int) -> tuple[object, list[int]]:
    """pp = 2 (torch.distributed.pipelining defers the sync to the last backward: one reduction per step)."""
    space = enumerate_space(MOE, CLUSTER, SearchOptions(global_batch=8, zero=(zero,), pp=(2,), schedules=("1f1b",),
                                                        recompute=("none",), fold_experts=False))
    rows = [i for ep in (1, 2) for i in [i for i in range(len(space)) if space.config(i).ep == ep][:3]]
    assert len(rows) == 6
    return space, rows


def test_the_layout_reduce_scatters_the_experts_once_per_step() -> None:
    """The configs below are the ones the un-overlapped tail prices: reduced once per step, by reduce-scatter,
    and their experts' group holds more than one replica."""
    space, rows = _rows(2)
    for i in rows:
        config = space.config(i)
        layout = zero_layout(config, 4)  # the executor's: pipelined_fsdp_defers_sync
        assert layout.grad_reduction == "reduce_scatter" and not layout.reduce_every_microbatch
        assert expert_dp_placement(config, CLUSTER.devices_per_node).size > 1


def test_quick_zero1_and_zero2_tails_are_the_exact_ones() -> None:
    """ZeRO 1 and 2 (no per-microbatch gathers): the quick step is the exact one to 1e-6 (it was 3-9 % above
    it while it all-reduced the experts' gradients)."""
    for zero in (1, 2):
        space, rows = _rows(zero)
        quick, exact = quick_and_exact(MOE, CLUSTER, space, rows, 8, ENGINE)
        np.testing.assert_allclose(quick, exact, rtol=1e-6)


def test_quick_zero3_tail_tracks_the_exact_one() -> None:
    """ZeRO 3: to 1 % (test_cost_chunk_sync's quick / exact tolerance; the quick estimate approximates ZeRO-3's
    gather timeline: 0.2-0.4 % here), where it was 3-8 % above."""
    space, rows = _rows(3)
    quick, exact = quick_and_exact(MOE, CLUSTER, space, rows, 8, ENGINE)
    assert np.abs(quick / exact - 1).max() < 0.01

