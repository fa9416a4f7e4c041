"""DeepSpeed stage 3's sub-module timeline (cost/deepspeed.py) against hand computations: the trace that
lines up or not (prefetch, keep-for-later), the copy-out launches beside the gather, and where a
gradient bucket's reduction runs."""

from __future__ import annotations

import dataclasses

import pytest

from autoplan import cost
from autoplan.plan.engine import Engine

DS = cost.deepspeed
NUMELS = [4e6, 1e6, 6e6, 6e6]  # one layer's weight matrices (elements)
FWD, BWD = 1.0, 2.0  # one layer's forward and backward seconds, split by parameter share


def _layers(count: int = 2, recompute: bool = False):
    return [DS.block_modules(NUMELS, FWD, BWD, FWD, 0.0, recompute) for _ in range(count)]


def _engine(**changes) -> Engine:
    base = dataclasses.replace(Engine.load("deepspeed"), zero3_sync_per_module=False)
    return dataclasses.replace(base, **changes)


def _share(n: float) -> float:
    return n / sum(NUMELS)


def test_the_2021_trace_is_off_by_one_so_nothing_is_prefetched_or_kept() -> None:
    """The shipped engine (v0.3.15-v0.4.x): every trace lookup misses, so the forward waits for each of its
    8 gathers (2 layers x 4) and the recomputed forward's parameters are all released before the
    backward gathers them again: 2 x (4 + 4 + 4) gathers. The same engine with v0.3.13's aligned trace
    prefetches one sub-module ahead, so only the first gather shows (every module computes longer than a
    gather) and, with a 10 M reuse distance, the last module of each layer is kept for its backward:
    2 x (4 + 4 + 3)."""
    g = 1e-3
    gathers: list[float] = []

    def gather(numel: float) -> float:
        gathers.append(numel)
        return g

    misaligned = _engine(zero3_max_reuse_numel=10**7)  # 2 x 6 M between the third module's two uses
    assert not misaligned.zero3_trace_aligned and not misaligned.param_gather_overlap
    fwd, _, _ = DS.microbatch_s(_layers(recompute=True), misaligned, recompute=True, gather_s=gather,
                                reduce_s=lambda n: 0.0)
    assert len(gathers) == 2 * (4 + 4 + 4)
    assert fwd == pytest.approx(2 * FWD + 8 * g)
    gathers.clear()
    aligned = _engine(zero3_max_reuse_numel=10**7, zero3_trace_aligned=True, param_gather_overlap=True)
    fwd, _, _ = DS.microbatch_s(_layers(recompute=True), aligned, recompute=True, gather_s=gather,
                                reduce_s=lambda n: 0.0)
    assert len(gathers) == 2 * (4 + 4 + 3)
    assert fwd == pytest.approx(2 * FWD + g)


@pytest.mark.parametrize("after", [2e-4, 3e-3])
def test_the_copy_out_launches_run_while_the_gather_moves_data(after: float) -> None:
    """ProcessGroupNCCL enqueues the all-gather, then launches the n copy-outs: a waited-for gather takes
    views + max(gather, launches), whichever of the two is longer, then the module computes. Forward of
    one layer, by hand: 4 x (before + max(g, after)) + FWD."""
    g, before = 1e-3, 5e-4
    fwd, _, _ = DS.microbatch_s(_layers(1), _engine(), recompute=False, gather_s=lambda n: g,
                                reduce_s=lambda n: 0.0, issue_s=before, launch_s=after)
    assert fwd == pytest.approx(4 * (before + max(g, after)) + FWD)


@pytest.mark.parametrize("ranks", [800, 1536, 2240])
def test_copy_out_launches_past_the_stream_queue_wait_for_the_gather(ranks: int) -> None:
    """Past PENDING_LAUNCHES queued copies the host blocks until the gather ends, then launches the rest at
    its own pace: one gather costs max(n c, g + (n - Q) c) after the views (c = CXX_COPY_OP x op). With
    g = 8 ms and c = 6.7 us, by hand: 800 ranks 8 ms, 1536 ranks 8 + 3.6 ms, 2240 ranks 8 + 8.3 ms."""
    g, c = 8e-3, DS.CXX_COPY_OP * 1e-5
    blocked = max(ranks - DS.PENDING_LAUNCHES, 0) * c
    fwd, _, _ = DS.microbatch_s(_layers(1), _engine(), recompute=False, gather_s=lambda n: g,
                                reduce_s=lambda n: 0.0, launch_s=ranks * c, blocked_s=blocked)
    assert fwd == pytest.approx(4 * max(ranks * c, g + blocked) + FWD)
    assert fwd == pytest.approx(4 * {800: 8e-3, 1536: 8e-3 + 536 * c, 2240: 8e-3 + 1240 * c}[ranks] + FWD)


def test_a_bucket_is_flushed_by_the_gradient_that_would_overflow_it() -> None:
    """stage3.py reduce_independent_p_g_buckets_and_remove_grads: `elements_in_ipg_bucket + param.ds_numel
    > reduce_bucket_size` reduces the bucket so far, then the gradient starts the next one; the last
    bucket is reduced after the backward. Backward order 6, 6, 1, 4 (M elements) twice with 10 M
    buckets, by hand: [6] | [6, 1] | [4, 6] | [6, 1] | [4] = 6, 7, 10, 7, 4 M."""
    reduced: list[float] = []

    def reduce(numel: float) -> float:
        reduced.append(numel)
        return 0.0

    DS.microbatch_s(_layers(), _engine(zero3_reduce_bucket_numel=10**7), recompute=False,
                    gather_s=lambda n: 0.0, reduce_s=reduce)
    assert reduced == [6e6, 7e6, 10e6, 7e6, 4e6]


@pytest.mark.parametrize("r", [0.05, 0.9])
def test_a_bucket_reduces_beside_the_next_backward_module(r: float) -> None:
    """Each gradient its own bucket (1 M-element buckets): the hook of module k's gradient reduces module
    k+1's bucket on the reduction stream while k computes, and the next gather's device synchronize waits
    for both; the last bucket follows the backward. Backward of one layer (order 6, 6, 1, 4 M; module
    seconds BWD x share), by hand: 4 g + c(6) + sum over the next three of max(c, r) + r. Without
    dp_comm_overlap the reductions run on the compute stream instead: 4 g + BWD + 4 r."""
    g = 1e-3
    c = [BWD * _share(n) for n in reversed(NUMELS)]
    _, bwd, hidden = DS.microbatch_s(_layers(1), _engine(zero3_reduce_bucket_numel=10**6), recompute=False,
                                     gather_s=lambda n: g, reduce_s=lambda n: r)
    assert bwd == pytest.approx(4 * g + c[0] + sum(max(x, r) for x in c[1:]) + r)
    assert hidden == pytest.approx(sum(min(x, r) for x in c[1:]))
    _, serial, _ = DS.microbatch_s(_layers(1), _engine(zero3_reduce_bucket_numel=10**6, dp_comm_overlap=False),
                                   recompute=False, gather_s=lambda n: g, reduce_s=lambda n: r)
    assert serial == pytest.approx(4 * g + BWD + 4 * r)


def test_the_2021_step_checks_every_gradient_partition_on_the_host() -> None:
    """stage3.py step (v0.3.13-v0.5.x): has_overflow_partitioned_grads_serial and get_grad_norm_direct read
    one scalar per gradient partition (cast, reduce, read: 2 x 3 ops), then all-reduce one element twice.
    A 2-block GPT holds 2 x (4 weights + 8 small) + embedding + head = 26 tensors on each rank, so on an
    ideal device the step grows by exactly (6 x 26 + 2) ops and two one-element all-reduces."""
    from test_cost_graph_helper import a100_cluster, gpt_graph

    from autoplan.cost import comm, estimate_config
    from autoplan.cost.types import GroupPlacement
    from autoplan.plan.types import ParallelConfig

    graph = gpt_graph(h=2048, a=16, layers=2, seq=512, unfused=False)
    cluster = a100_cluster(2, nic_bw=1e15, ideal=True)
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, op_overhead_s=1e-5), dtype="fp16")
    base = dataclasses.replace(Engine.load("deepspeed"), attention="flash")
    assert base.zero3_serial_grad_checks and not Engine.load("deepspeed-2024").zero3_serial_grad_checks
    off, on = (estimate_config(graph, cluster, ParallelConfig(dp=16, zero=3), global_batch=16,
                               engine=dataclasses.replace(base, zero3_serial_grad_checks=flag)) for flag in (False, True))
    group = GroupPlacement(size=16, num_nodes=2, per_node=8)
    scalars = comm.all_reduce_s(1.0, group, cluster) + comm.all_reduce_s(4.0, group, cluster)
    assert on.step_time_s - off.step_time_s == pytest.approx((6 * 26 + 2) * 1e-5 + scalars, rel=1e-9)
    assert DS.serial_grad_checks(0) == (0.0, ())
