"""ZeRO-2's every-microbatch gradient reduce-scatters when the engine does not wait for them at the end of each
backward (Engine.grad_reduce_async: Llama 3's FSDP, Dubey et al. 2024, section 3.3.2, "asynchronously ...
reducing gradients"): they run beside the next microbatch's compute, only the last microbatch waits. Each
check against a hand computation (two-stream timelines worked out here, ideal links)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, every_zero_stage, gpt_graph, quick_and_exact

from autoplan.cost import comm, estimate_config, estimate_layer
from autoplan.cost.dataparallel import async_reduce_s, dp_groups
from autoplan.graph.types import LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig

IDEAL = a100_cluster(ideal=True)
# 20 of 100 SMs to NCCL: compute beside a hidden collective runs 20 % slower (overlap.contention_fraction)
CONTENDED = dataclasses.replace(IDEAL, device=dataclasses.replace(IDEAL.device, num_sms=100, nccl_sms=20))
F = 0.2


@pytest.mark.parametrize(("fwd", "bwd", "post", "per_mb", "tail"), [
    # link-bound: C = 6 < R = 10. Per microbatch R - C = 4 exposed, C = 6 hidden (+ 0.2 x 6). The last
    # backward alone: compute 0-2, RS 2-7, compute 2-4, RS 7-12: 8 exposed, 2 hidden (+ 0.2 x 2) = 8.4
    ([1.0, 1.0], [2.0, 2.0], [5.0, 5.0], 4.0 + 6 * F, 8.0 + 2 * F - (4.0 + 6 * F)),
    # compute-bound: C = 14 > R = 2, all hidden (0.2 x 2). The last backward: compute 0-4, RS 4-5, compute
    # 4-8, RS 8-9: 1 exposed, 1 hidden
    ([3.0, 3.0], [4.0, 4.0], [1.0, 1.0], 2 * F, 1.0 + F - 2 * F),
])
def test_async_reductions_cost_max_of_compute_and_link_and_the_last_waits(fwd, bwd, post, per_mb, tail) -> None:
    got_mb, got_tail = async_reduce_s(fwd, bwd, post, CONTENDED)
    assert got_mb == pytest.approx(per_mb, rel=1e-12)
    assert got_tail == pytest.approx(tail, rel=1e-12)


def _waited_backward(bwd: list[float], post: list[float]) -> float:
    """A backward that waits for its reductions, two streams: each layer's reduce-scatter is queued when its
    backward ends; exposed = makespan - compute, hidden ones slow the compute by F."""
    t = comm_free = 0.0
    for b, q in zip(bwd, post):
        t += b
        comm_free = max(comm_free, t) + q
    exposed = max(comm_free, t) - t
    return exposed + F * (sum(post) - exposed)


@pytest.mark.parametrize("global_batch", [4, 16])
def test_the_step_saves_all_but_the_last_microbatchs_wait(global_batch: int) -> None:
    """pp 1, dp 4 over the 25 GB/s NIC (one GPU per node), ZeRO-2, m = global_batch / 4 microbatches: with
    grad_reduce_async the step is shorter by (m - 1) x (the waiting backward's dp time - max(R - C, 0) -
    F min(R, C)), R the blocks' and the root group's fp32 reduce-scatters and C the microbatch's compute;
    with m = 1 the same."""
    graph = gpt_graph(h=1024, a=16, layers=4, seq=1024, vocab=8192, unfused=False)
    cluster = dataclasses.replace(a100_cluster(4, per_node=1, ideal=True), device=CONTENDED.device)
    config = ParallelConfig(dp=4, zero=2)
    waiting = dataclasses.replace(Engine(), reduce_scatter_copy_in=False, gather_copy_out=False)
    asynchronous = dataclasses.replace(waiting, grad_reduce_async=True)
    costs = [estimate_layer(layer, cluster, config, "none", seq_len=graph.seq_len, engine=waiting)
             for layer in graph.layers]
    group = dp_groups(config, cluster).dense
    # each block reduces its own; FSDP2's root group (embedding, final norm, head: cost/fsdpunits.py) once,
    # after the last backward (the embedding's, last in backward order)
    blocks = [layer.role is LayerRole.BLOCK for layer in reversed(graph.layers)]
    root = sum(c.grad_param_count for c, layer in zip(costs, graph.layers) if layer.role is not LayerRole.BLOCK)
    post = [comm.reduce_scatter_s(c.grad_param_count * 4.0, group, cluster) if block else 0.0
            for c, block in zip(reversed(costs), blocks)]
    post[-1] = comm.reduce_scatter_s(root * 4.0, group, cluster)
    # ZeRO-2 reduces every microbatch, so every backward's weight gradients land in freed .grads
    # (Engine.grad_freed_after_reduce: estimate.with_fresh_grads takes fresh_grad_saving_s off each backward;
    # it shows once the reductions start after a block's backward rather than the head's)
    bwd = [c.time_s - c.fwd_s - c.fwd_comm_s - c.fresh_grad_saving_s for c in reversed(costs)]
    compute, total = sum(c.time_s - c.fresh_grad_saving_s for c in costs), sum(post)
    per_mb = max(total - compute, 0.0) + F * min(total, compute)
    m = global_batch // 4
    saved = (m - 1) * (_waited_backward(bwd, post) - per_mb)
    sync = estimate_config(graph, cluster, config, global_batch=global_batch, engine=waiting)
    overlapped = estimate_config(graph, cluster, config, global_batch=global_batch, engine=asynchronous)
    assert sync.step_time_s - overlapped.step_time_s == pytest.approx(saved, rel=1e-9, abs=1e-12)
    assert overlapped.peak_mem_bytes == sync.peak_mem_bytes
    if m > 1:
        assert saved > 0


def test_only_zero2_with_dp_overlap_is_asynchronous() -> None:
    """ZeRO-1 (reduced once per step), ZeRO-3 (weights gathered per microbatch) and an engine without
    dp_comm_overlap price the same with and without grad_reduce_async."""
    graph = gpt_graph(h=512, a=8, layers=2, seq=256, unfused=False)
    cluster = a100_cluster(4, per_node=1, ideal=True)
    base = Engine()
    for zero, engine in [(1, base), (3, base), (2, dataclasses.replace(base, dp_comm_overlap=False))]:
        config = ParallelConfig(dp=4, zero=zero)
        a = estimate_config(graph, cluster, config, global_batch=16, engine=engine)
        b = estimate_config(graph, cluster, config, global_batch=16,
                            engine=dataclasses.replace(engine, grad_reduce_async=True))
        assert a.step_time_s == b.step_time_s, zero


def test_the_quick_estimate_prices_async_reductions_as_the_exact_model() -> None:
    """ZeRO-2 candidates with dp > 1 (pp 1 and pp > 1) under megatron-core with grad_reduce_async (Llama
    3's override), one bucket per layer (the quick estimate's closed form is for equal layers, buckets
    spanning layers are its approximation): the quick saving over the waiting engine follows the exact
    one's to 10 % of the step, never the other way, and the quick step times rank the candidates as the
    exact ones (Spearman >= 0.95)."""
    import scipy.stats

    from autoplan.search.space import SearchOptions, enumerate_space

    graph = gpt_graph(h=512, a=8, layers=4, seq=256, vocab=4096, unfused=False)
    cluster = a100_cluster(2, per_node=4)
    space = enumerate_space(graph, cluster, SearchOptions(global_batch=16, zero=(2,)))
    rows = [r for r in range(len(space)) if space.config(r).dp > 1][:40]
    assert any(space.config(r).pp > 1 for r in rows)
    assert rows
    times = {}
    for flag in (False, True):
        engine = every_zero_stage(dataclasses.replace(Engine.load("megatron-core"), grad_reduce_async=flag, dp_bucket_numel=0))
        times[flag] = quick_and_exact(graph, cluster, space, rows, 16, engine)
    (q_sync, e_sync), (q_async, e_async) = times[False], times[True]
    assert scipy.stats.spearmanr(e_async, q_async).statistic >= 0.95
    assert (np.abs((q_sync - q_async) - (e_sync - e_async)) <= 0.1 * e_async).all()
    assert (e_async <= e_sync * (1 + 1e-12)).all() and (q_async <= q_sync * (1 + 1e-12)).all()
    assert (e_sync - e_async).max() > 0.05 * e_async.max()
