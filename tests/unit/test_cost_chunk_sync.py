"""Engine.grad_sync_per_chunk (engines/megatron-core.yaml, cost/chunksync.py): under a pipeline Megatron-Core
launches each model chunk's whole gradient reduction after its last backward (pipeline-rank backwards later),
on the one data-parallel communicator. Checked against hand timelines of the cool-down's backward slots, the
quick estimate's closed form against the queue, and the other engines left as they were."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan import cost
from autoplan.cost import comm
from autoplan.cost.chunksync import chunk_windows_s, later_gathers_s, queued_tail_s, rank_chunk_tail_s
from autoplan.cost.dataparallel import Rank, add_layers, dp_groups, rank_dp_times
from autoplan.cost.overlap import contention_fraction
from autoplan.cost.types import LayerCost
from autoplan.plan.engine import Engine
from autoplan.plan.layout import zero_layout
from autoplan.plan.types import ParallelConfig
from autoplan.search.chunks import chunk_sync_tail

CLUSTER = dataclasses.replace(a100_cluster(2), dtype="bf16")
MCORE = dataclasses.replace(Engine.load("megatron-core"), grad_buffer_passes=False, dp_bucket_numel=10**12)
OFF = dataclasses.replace(MCORE, grad_sync_per_chunk=False)
BLOCK = gpt_graph(h=512, a=8, layers=2, seq=256, vocab=4096).blocks[0]  # a block: its own FSDP2 unit (fsdpunits)


def test_windows_are_the_cool_downs_backward_slots_by_hand() -> None:
    """p = 4, rank 1, chunks' backwards 1, 2, 3: the last group runs chunk 2 x4, chunk 1 x4, chunk 0 x4; chunk
    1's reduction goes out 1 slot after its last backward (3 of chunk 0 left), chunk 2's 1 slot after its own
    (3 of chunk 1 and 4 of chunk 0 left), chunk 0's at the end."""
    assert chunk_windows_s([1.0, 2.0, 3.0], 4, 1) == [0.0, 3.0, 3 * 2.0 + 4 * 1.0]
    assert chunk_windows_s([5.0], 2, 1) == [0.0]
    ranks = np.array([0, 1])  # ranks 0 and 1 at once (the quick estimate's arrays): rank 0's W_1 = 4 x 1
    assert [np.broadcast_to(w, 2).tolist() for w in chunk_windows_s([1.0, 2.0, 3.0], 4, ranks)] == [
        [0.0, 0.0], [4.0, 3.0], [4 * 2.0 + 4 * 1.0, 3 * 2.0 + 4 * 1.0]]


def test_the_queue_by_hand() -> None:
    # chunk 2 at -10 ends -6; chunk 1 at -3 ends 2; chunk 0 at 0 waits for it: 2 + 2 = 4
    assert queued_tail_s([0.0, 3.0, 10.0], [2.0, 5.0, 4.0]) == 4.0
    # v = 3 equal chunks, reduce r, slot b = 1, p = 2, rank 0 (windows 0, 2, 4): r = 1.5 leaves the last
    # chunk's own reduction exposed; r = 3 backs the queue up: 3 r - 4 = 5
    assert queued_tail_s([0.0, 2.0, 4.0], [1.5] * 3) == 1.5
    assert queued_tail_s([0.0, 2.0, 4.0], [3.0] * 3) == 5.0
    assert queued_tail_s([0.0, 2.0, 4.0], [0.0] * 3) == 0.0


def test_the_quick_estimates_vectorised_queue_is_the_exact_one() -> None:
    """search.chunks.chunk_sync_tail calls rank_chunk_tail_s on the chunks' [n, p] arrays (one home): over
    random unequal chunks [n, v, p] its result is the scalar call's rank by rank (the array path's
    broadcasting of the ranks), and the ranks it applies to are applies()'s."""
    rng = np.random.default_rng(3)
    for _ in range(60):
        p, v, n = int(rng.integers(2, 9)), int(rng.integers(1, 9)), 3
        red, bwd = rng.exponential(size=(n, v, p)), rng.exponential(size=(n, v, p))
        frac = 0.1
        ranks, tail = chunk_sync_tail(red, bwd, frac, p)
        for k in range(n):
            for r in range(p):
                exposed, hidden = rank_chunk_tail_s(list(bwd[k, :, r]), list(red[k, :, r]), p, r)
                assert bool(ranks[k, r]) == (v > 1 or r > 0)
                assert math.isclose(float(tail[k, r]), exposed + frac * hidden, rel_tol=1e-12, abs_tol=1e-15)


def _rank(index: int, chunk_bwd: list[float], chunk_params: list[int]) -> Rank:
    rank = Rank(index=index)
    for b, n in zip(chunk_bwd, chunk_params):
        c = LayerCost(fwd_s=1e-3, bwd_s=b, bwd_weight_s=0.0, recompute_s=0.0, tp_comm_s=0.0, cp_comm_s=0.0,
                      ep_comm_s=0.0, act_mem_bytes=0, param_count=n, grad_param_count=n, expert_param_count=0,
                      output_bytes=0)
        add_layers(rank, [c], [BLOCK])
    return rank


def _tail(rank: Rank, config: ParallelConfig, engine: Engine) -> float:
    layout = zero_layout(config, 8, zero3=engine.zero3, pipelined_fsdp_defers_sync=engine.pipelined_fsdp_defers_sync)
    rank_dp_times(rank, CLUSTER, config, layout, engine, dp_groups(config, CLUSTER))
    return rank.dp_tail


def test_an_interleaved_ranks_tail_by_hand() -> None:
    """Rank 1 of p = 4, three one-layer chunks (backward 1, 2, 3 ms; 30, 60, 90 M parameters, one bucket each):
    each chunk's reduce-scatter of its fp32 gradients at its launch, queued in order, the SM share of the
    hidden part on top."""
    config = ParallelConfig(pp=4, dp=4, zero=1, virtual_stages=3, schedule="interleaved")
    b, n = [1e-3, 2e-3, 3e-3], [30_000_000, 60_000_000, 90_000_000]
    group = dp_groups(config, CLUSTER).dense
    red = [comm.reduce_scatter_s(x * 4.0, group, CLUSTER) for x in n]
    end = -(3 * b[1] + 4 * b[0]) + red[2]  # chunk 2 first
    end = max(end, -3 * b[0]) + red[1]
    end = max(end, 0.0) + red[0]
    want = max(end, 0.0) + contention_fraction(CLUSTER, group) * (sum(red) - max(end, 0.0))
    assert math.isclose(_tail(_rank(1, b, n), config, MCORE), want, rel_tol=1e-12)
    assert _tail(_rank(1, b, n), config, OFF) != pytest.approx(want)


def test_the_first_chunk_keeps_its_buckets_the_later_ones_reduce_in_one() -> None:
    """Megatron-Core's get_model: DDP(..., disable_bucketing=(model_chunk_idx > 0)). Rank 0 of p = 2, two
    chunks of two 50 M-parameter layers (backward 1 ms each), 40 M buckets: chunk 0 reduces in two 50 M
    collectives, chunk 1 in one of 100 M, launched 2 backwards of chunk 0 (4 ms) before the end."""
    config = ParallelConfig(pp=2, dp=4, zero=1, virtual_stages=2, schedule="interleaved")
    engine = dataclasses.replace(MCORE, dp_bucket_numel=40_000_000)
    rank = Rank(index=0)
    for _ in range(2):
        layer = LayerCost(fwd_s=1e-3, bwd_s=1e-3, bwd_weight_s=0.0, recompute_s=0.0, tp_comm_s=0.0, cp_comm_s=0.0,
                          ep_comm_s=0.0, act_mem_bytes=0, param_count=50_000_000, grad_param_count=50_000_000,
                          expert_param_count=0, output_bytes=0)
        add_layers(rank, [layer, layer], [BLOCK, BLOCK])
    group = dp_groups(config, CLUSTER).dense
    r0, r1 = 2 * comm.reduce_scatter_s(50e6 * 4.0, group, CLUSTER), comm.reduce_scatter_s(100e6 * 4.0, group, CLUSTER)
    end = max(-4e-3 + r1, 0.0) + r0
    want = end + contention_fraction(CLUSTER, group) * (r0 + r1 - end)
    assert math.isclose(_tail(rank, config, engine), want, rel_tol=1e-12)


def test_1f1b_the_first_stage_keeps_its_hooks_the_others_reduce_after_the_cool_down() -> None:
    config = ParallelConfig(pp=2, dp=4, zero=1)
    b, n = [4e-3], [120_000_000]
    assert _tail(_rank(0, b, n), config, MCORE) == _tail(_rank(0, b, n), config, OFF)
    whole = comm.reduce_scatter_s(n[0] * 4.0, dp_groups(config, CLUSTER).dense, CLUSTER)
    assert math.isclose(_tail(_rank(1, b, n), config, MCORE), whole, rel_tol=1e-12)
    flat = ParallelConfig(pp=1, dp=8, zero=1)  # no pipeline: the bucket hooks (forward_backward_no_pipelining)
    assert _tail(_rank(0, b, n), flat, MCORE) == _tail(_rank(0, b, n), flat, OFF)


def test_only_megatron_core_launches_per_chunk() -> None:
    assert not Engine().grad_sync_per_chunk and not Engine().param_gather_per_chunk
    for name in Engine.names():
        engine = Engine.load(name)
        assert engine.grad_sync_per_chunk == engine.param_gather_per_chunk == (name == "megatron-core"), name


def test_later_chunks_gathers_by_hand() -> None:
    """p = 4, chunks' forwards 1, 2, 3: chunk 1's gather (5) beside 3 forwards of chunk 0 (3): 2 exposed;
    chunk 2's (3) beside 4 of chunk 1 (8): hidden."""
    assert later_gathers_s([1.0, 2.0, 3.0], [5.0, 3.0], 4) == (2.0, 6.0)
    assert later_gathers_s([1.0], [], 4) == (0.0, 0.0)
    # the same on arrays (search/chunks.py chunk_gather_s): a second column with chunk 1's gather 1 (hidden)
    shown, hidden = later_gathers_s([np.array([1.0, 1.0]), np.array([2.0, 2.0]), np.array([3.0, 3.0])],
                                    [np.array([5.0, 1.0]), np.array([3.0, 3.0])], 4)
    assert shown.tolist() == [2.0, 0.0] and hidden.tolist() == [6.0, 4.0]


def _gather(rank: Rank, config: ParallelConfig, engine: Engine) -> float:
    layout = zero_layout(config, 8, zero3=engine.zero3, pipelined_fsdp_defers_sync=engine.pipelined_fsdp_defers_sync)
    rank_dp_times(rank, CLUSTER, config, layout, engine, dp_groups(config, CLUSTER))
    return rank.param_gather


def test_the_distributed_optimizers_gathers_chunk_by_chunk_by_hand() -> None:
    """Rank 1 of p = 4, ZeRO-1, three one-layer chunks (forward 1 ms each; 300, 600, 900 M bf16 weights): the
    first chunk's gather before its forward, exposed; chunk 1's beside 3 forwards of chunk 0, chunk 2's beside
    4 of chunk 1, the SM share of the hidden parts on top. ZeRO-2 (not the distributed optimizer) as before."""
    config = ParallelConfig(pp=4, dp=4, zero=1, virtual_stages=3, schedule="interleaved")
    n = [300_000_000, 600_000_000, 900_000_000]
    group = dp_groups(config, CLUSTER).dense
    g = [comm.all_gather_s(x * 2.0, group, CLUSTER) for x in n]
    shown = [max(g[1] - 3e-3, 0.0), max(g[2] - 4e-3, 0.0)]
    want = g[0] + sum(shown) + contention_fraction(CLUSTER, group) * (g[1] + g[2] - sum(shown))
    assert math.isclose(_gather(_rank(1, [2e-3] * 3, n), config, MCORE), want, rel_tol=1e-12)
    plain = dataclasses.replace(MCORE, param_gather_per_chunk=False)
    assert _gather(_rank(1, [2e-3] * 3, n), config, plain) != pytest.approx(want)
    zero2 = dataclasses.replace(config, zero=2)
    assert _gather(_rank(1, [2e-3] * 3, n), zero2, MCORE) == _gather(_rank(1, [2e-3] * 3, n), zero2, plain)


@pytest.mark.parametrize("fields", [{}, {"dp_bucket_numel": 0}, {"grad_freed_after_reduce": True}])
def test_the_quick_estimate_tracks_the_exact_one(fields: dict) -> None:
    """Interleaved candidates under megatron-core (also without buckets, and with fresh gradients): the quick step is the exact one's to 1 % (the quick prices
    each rank's chunks from its own stages' fields; its buckets are equal ones of the chunk's gradients), and
    switching the field changes some exact step."""
    from autoplan.search.space import SearchOptions, enumerate_space
    from autoplan.search.surrogate import quick_estimate

    graph = gpt_graph(h=2048, a=16, layers=16, seq=2048, vocab=32768)
    cluster = dataclasses.replace(a100_cluster(4), dtype="bf16")
    space = enumerate_space(graph, cluster, SearchOptions(global_batch=64, zero=(0, 1), schedules=("interleaved",)))
    flat = np.flatnonzero((space.columns["pp"] > 1) & (space.columns["virtual_stages"] > 1))
    rows = np.random.default_rng(2).choice(flat, 24, replace=False).tolist()
    mcore = dataclasses.replace(Engine.load("megatron-core"), **fields)
    quick = quick_estimate(graph, cluster, space, 64, cost.with_engine(mcore)).step_time_s[rows]
    e_on, e_off = (np.array([cost.estimate_config(graph, cluster, space.config(r), global_batch=64,
                                                  engine=e).step_time_s for r in rows])
                   for e in (mcore, dataclasses.replace(mcore, grad_sync_per_chunk=False)))
    assert np.abs(quick / e_on - 1).max() < 0.01
    assert np.abs(e_on - e_off).max() > 1e-4
