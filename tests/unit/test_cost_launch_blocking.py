"""Engine.launch_blocking (CUDA_LAUNCH_BLOCKING=1, BLOOM-176B's launch script): every kernel launch returns
only when its kernel has run, so a layer's host time (its ops at op_overhead_s) adds to its device time
instead of hiding under it, a device-synchronising copy costs only its own latency (the queue is already
empty), and an engine that would overlap anything is refused. Also the two DeepSpeed bf16 fields
(Engine.zero1_all_reduce, Engine.bf16_optimizer_grads; true in megatron-deepspeed.yaml, their dtype gate in
test_cost_bf16_optimizer_gate.py). Checked against hand counts of the ops
and bytes, and the quick estimate against the exact model."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, every_zero_stage, gpt_graph, quick_and_exact_change

from autoplan.cost import estimate_config, estimate_layer
from autoplan.cost.compute import H2D_SYNC_COPY_S, sync_copy_s
from autoplan.cost.p2p import partitioned_role_s
from autoplan.plan.engine import OVERLAP_FIELDS, Engine
from autoplan.plan.types import ParallelConfig

OP = 1.0e-5  # host seconds per op (the shipped A100 profiles' op_overhead_s)
BASE = a100_cluster()
CLUSTER = dataclasses.replace(BASE, dtype="bf16", device=dataclasses.replace(BASE.device, op_overhead_s=OP))
ASYNC = every_zero_stage(dataclasses.replace(Engine.load("megatron-deepspeed"), block_forward_syncs=0))
BLOCKING = dataclasses.replace(ASYNC, launch_blocking=True)


def _block_times(engine: Engine, recompute: str = "none", h: int = 2048, op: float = OP):
    block = gpt_graph(h=h, a=16, layers=1, seq=1024, vocab=4096, unfused=True).blocks[0]
    cluster = dataclasses.replace(CLUSTER, device=dataclasses.replace(CLUSTER.device, op_overhead_s=op))
    return estimate_layer(block, cluster, ParallelConfig(microbatch=2), recompute, seq_len=1024, engine=engine)


def test_host_time_adds_to_the_device_time_of_a_device_bound_block() -> None:
    """A block whose kernels outlast its host work: asynchronous, a phase is max(device, host) = device;
    blocking, device + host, so the phases grow by exactly the engine's op counts x op_overhead_s
    (megatron-deepspeed.yaml: 86 forward, 92 backward)."""
    fast, slow = _block_times(ASYNC), _block_times(BLOCKING)
    assert fast.fwd_s > 86 * OP and fast.bwd_s > 92 * OP  # device-bound, so asynchronous hides the host
    assert math.isclose(slow.fwd_s - fast.fwd_s, 86 * OP, rel_tol=1e-9)
    assert math.isclose(slow.bwd_s - fast.bwd_s, 92 * OP, rel_tol=1e-9)


def test_a_full_recompute_pays_its_ops_and_the_checkpoint_wrappers_in_series() -> None:
    """Full recompute: the forward issues the block's 86 ops and the checkpoint's 6, the recomputed forward
    86 again, the backward 92 and the checkpoint's 15 (megatron-deepspeed.yaml)."""
    fast, slow = _block_times(ASYNC, "full"), _block_times(BLOCKING, "full")
    assert math.isclose(slow.fwd_s - fast.fwd_s, (86 + 6) * OP, rel_tol=1e-9)
    assert math.isclose(slow.recompute_s - fast.recompute_s, 86 * OP, rel_tol=1e-9)
    assert math.isclose(slow.bwd_s - fast.bwd_s, (92 + 15) * OP, rel_tol=1e-9)


def test_a_synchronising_copy_costs_only_its_latency_when_launches_block() -> None:
    """Asynchronous: each of the 2 copies adds H2D_SYNC_COPY_S + op_overhead_s after max(device, host) (the
    drained device idles while the host issues the next op); blocking, that issue is already in the serial
    host time, so each copy adds H2D_SYNC_COPY_S."""
    syncs = {e: dataclasses.replace(e, block_forward_syncs=2) for e in (ASYNC, BLOCKING)}
    fast, slow = _block_times(syncs[ASYNC]), _block_times(syncs[BLOCKING])
    assert math.isclose(fast.fwd_s - _block_times(ASYNC).fwd_s, 2 * (H2D_SYNC_COPY_S + OP), rel_tol=1e-9)
    assert math.isclose(slow.fwd_s - _block_times(BLOCKING).fwd_s, 2 * H2D_SYNC_COPY_S, rel_tol=1e-9)


def test_a_host_bound_block_adds_the_device_time_instead() -> None:
    """A tiny block (h 64) whose 86 forward ops outlast its kernels: asynchronous, the forward is the host's
    86 x op_overhead_s; blocking, that plus the kernels' time (the forward with no host cost at all)."""
    fast, slow = _block_times(ASYNC, h=64), _block_times(BLOCKING, h=64)
    device = _block_times(ASYNC, h=64, op=0.0).fwd_s
    assert 0.0 < device < 86 * OP  # host-bound
    assert math.isclose(fast.fwd_s, 86 * OP, rel_tol=1e-9)
    assert math.isclose(slow.fwd_s, device + 86 * OP, rel_tol=1e-9)


def test_an_overlapping_engine_cannot_block_its_launches() -> None:
    """Under CUDA_LAUNCH_BLOCKING a collective's launch returns when it has run: nothing overlaps it, so
    every overlap field left true is named in the error."""
    with pytest.raises(ValueError, match="'dp_comm_overlap', 'param_gather_overlap'"):
        dataclasses.replace(Engine.load("torchtitan"), launch_blocking=True)
    assert all(not getattr(BLOCKING, f) for f in OVERLAP_FIELDS)
    assert all(not Engine.load(name).launch_blocking for name in Engine.names())  # asynchronous by default


def test_a_blocking_engine_file_with_overlapped_p2p_is_refused_in_one_line(tmp_path) -> None:
    """Megatron-Core's interleaved p2p overlap (pp_p2p_overlap) is an overlap too: a YAML asking for it under
    launch_blocking is refused before any pricing, in one line that names the file and the field."""
    path = tmp_path / "blocking.yaml"
    path.write_text("schema_version: 1\nname: blocking\nlaunch_blocking: true\npp_p2p_overlap: true\n"
                    + "".join(f"{f}: false\n" for f in OVERLAP_FIELDS if f != "pp_p2p_overlap"))
    with pytest.raises(ValueError) as err:
        Engine.load(str(path))
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(path)) and "'pp_p2p_overlap'" in message


def test_the_quick_estimate_adds_what_the_exact_model_adds() -> None:
    """search/surrogate.py reads the same per-layer costs (estimate_layer under the engine): the step-time
    change from blocking launches agrees row by row."""
    graph = gpt_graph(h=512, a=8, layers=4, seq=512, vocab=4096, unfused=True)
    quick, exact = quick_and_exact_change(graph, CLUSTER, BLOCKING, ASYNC,
                                          lambda config: config.dp * config.tp * config.pp == 8, count=6)
    assert np.all(exact > 0)
    np.testing.assert_allclose(quick, exact, rtol=1e-6)


def test_zero1_all_reduce_doubles_the_gradient_reduction() -> None:
    """Engine.zero1_all_reduce (DeepSpeed's pipeline engine under bf16: _bf16_reduce_grads all-reduces the
    fp32 gradients, the BF16_Optimizer then all-gathers its updated shards): the exposed reduction after the
    schedule grows by one all-reduce less one reduce-scatter of the 4-byte gradients (a ring all-reduce is a
    reduce-scatter and an all-gather of the same bytes: about twice) plus the all-reduce's own passes over
    the gradients (buffered_allreduce_fallback's flatten, scale, copy back: megatron-deepspeed.yaml
    dp_grad_passes 3, a read and a write of 4 bytes each), the weight all-gather and the optimizer step
    unchanged. The quick estimate moves with it. (With the fp32 wire: bf16_grad_comm off here; the bf16 wire
    and its passes are test_cost_bf16_grad_comm.py's.)"""
    from autoplan.cost import estimate_config
    from autoplan.cost.comm import all_reduce_s, group_placement, reduce_scatter_s

    graph = gpt_graph(h=512, a=8, layers=4, seq=512, vocab=4096, unfused=True)
    config = ParallelConfig(dp=8, zero=1, microbatch=1)
    rs, ar = (dataclasses.replace(ASYNC, zero1_all_reduce=flag, bf16_grad_comm=False) for flag in (False, True))
    a, b = (estimate_config(graph, CLUSTER, config, global_batch=16, engine=e) for e in (rs, ar))
    grads = sum(layer.num_params for layer in graph.layers) - graph.tied_embedding_params
    group = group_placement(config, ("dp",), CLUSTER.devices_per_node)
    one_rs, one_ar = (f(4.0 * grads, group, CLUSTER) for f in (reduce_scatter_s, all_reduce_s))
    assert 1.8 < one_ar / one_rs <= 2.0
    passes = 3 * 2 * 4.0 * grads / (CLUSTER.device.mem_bw_bytes_per_s * CLUSTER.device.mem_bw_efficiency)
    assert b.breakdown["dp_comm"] - a.breakdown["dp_comm"] == pytest.approx(one_ar - one_rs + passes, rel=1e-6)
    assert b.breakdown["optimizer"] == a.breakdown["optimizer"]
    quick, exact = quick_and_exact_change(graph, CLUSTER, ar, rs, lambda config: config.zero == 1 and config.dp == 8)
    assert np.all(exact > 0)
    np.testing.assert_allclose(quick, exact, rtol=1e-6)


def test_bf16_optimizer_casts_every_microbatchs_gradients_into_fp32() -> None:
    """Engine.bf16_optimizer_grads (DeepSpeed's pipeline engine: clear_lp_grads before each backward,
    update_hp_grads after it): each microbatch's backward grows by the cast + add pass, 2 + 4 + 4 + 4 + 4 bytes
    per local gradient element at streaming bandwidth, and every microbatch's gradients are fresh (the
    GEMMs write them once, 2 bytes, instead of accumulating 4 + 4), so the step's compute changes by
    m x (the passes - the fresh saving) summed over the layers. The quick estimate moves with it."""
    from autoplan.cost import estimate_config

    rate = CLUSTER.device.mem_bw_bytes_per_s * CLUSTER.device.mem_bw_efficiency
    on, off = ASYNC, dataclasses.replace(ASYNC, bf16_optimizer_grads=False)
    assert on.bf16_optimizer_grads  # megatron-deepspeed.yaml: every bf16 run of DeepSpeed's pipeline engine
    block = gpt_graph(h=2048, a=16, layers=1, seq=1024, vocab=4096, unfused=True).blocks[0]
    a, b = _block_times(off), _block_times(on)
    assert math.isclose(b.bwd_s - a.bwd_s, 18.0 * block.num_params / rate, rel_tol=1e-9)

    # an Ampere device whose GEMMs write their output after the mainloop, so a fresh gradient saves time, and
    # no host cost, so these small blocks stay device-bound (test_cost_fresh_grads.py's device)
    cluster = dataclasses.replace(CLUSTER, device=dataclasses.replace(CLUSTER.device, num_sms=108,
                                                                      gemm_epilogue_overlap=False, op_overhead_s=0.0))
    graph = gpt_graph(h=512, a=8, layers=4, seq=512, vocab=4096, unfused=True)
    config, m = ParallelConfig(dp=8, microbatch=1), 4
    steps = [estimate_config(graph, cluster, config, global_batch=8 * m, engine=e) for e in (off, on)]
    layers = [(estimate_layer(x, cluster, config, "none", seq_len=512, engine=on), x) for x in graph.layers]
    assert sum(c.fresh_grad_saving_s for c, _ in layers) > 0
    hand = m * sum(18.0 * x.num_params / rate - c.fresh_grad_saving_s for c, x in layers)  # every microbatch fresh
    assert steps[1].breakdown["compute"] - steps[0].breakdown["compute"] == pytest.approx(hand, rel=1e-6)
    quick, exact = quick_and_exact_change(graph, cluster, on, off, lambda config: config.pp == 1 and config.dp == 8)
    np.testing.assert_allclose(quick, exact, rtol=1e-6)


def test_a_score_bias_input_writes_and_reads_the_scores_once_more_per_forward() -> None:
    """Engine.score_bias_input (BLOOM's ALiBi as baddbmm's input, beta != 0): the expanded bias is copied into
    the scores and cuBLAS reads it back, 2 x 2 bytes per score of the b x heads x s x s matrix at streaming
    bandwidth, in the forward (inside the attention core, so a full recompute pays it again) and not in the
    backward."""
    rate = CLUSTER.device.mem_bw_bytes_per_s * CLUSTER.device.mem_bw_efficiency
    on = dataclasses.replace(ASYNC, score_bias_input=True)
    scores = 2 * 16 * 1024 * 1024  # microbatch 2, 16 heads, 1024 x 1024
    for recompute in ("none", "full"):
        a, b = _block_times(ASYNC, recompute), _block_times(on, recompute)
        assert math.isclose(b.fwd_s - a.fwd_s, 4.0 * scores / rate, rel_tol=1e-9)
        assert math.isclose(b.bwd_s, a.bwd_s, rel_tol=1e-12)
    a, b = _block_times(ASYNC, "full"), _block_times(on, "full")
    assert math.isclose(b.recompute_s - a.recompute_s, 4.0 * scores / rate, rel_tol=1e-9)


def test_deepspeed_stage3_counts_the_host_once_when_launches_block() -> None:
    """DeepSpeed ZeRO-3 with zero3_sync_per_module adds each sub-module's host time to its kernels (the sync
    empties the queue); under launch_blocking the layer costs already hold device + host, so the sub-module
    adds nothing more (cost/deepspeed.sync_adds_host): a device-bound step is unchanged by blocking, and the
    quick estimate (search/assemble.py) moves exactly as the exact model does."""
    from autoplan.cost import deepspeed as ds

    base = dataclasses.replace(Engine.load("deepspeed"), dp_comm_overlap=False, param_gather_overlap=False,
                               zero3_sync_per_module=True)
    on = dataclasses.replace(base, launch_blocking=True)
    assert ds.sync_adds_host(base) and not ds.sync_adds_host(on)
    graph = gpt_graph(h=512, a=8, layers=4, seq=512, vocab=4096, unfused=True)
    quick, exact = quick_and_exact_change(graph, CLUSTER, on, base,
                                          lambda config: config.zero == 3 and config.dp == 8 and config.pp == 1)
    np.testing.assert_allclose(quick, exact, rtol=1e-6, atol=1e-12)


def test_one_rule_prices_a_synchronising_copy_by_whether_the_next_issue_is_already_counted() -> None:
    """compute.sync_copy_s, by hand: 6 us of copy latency, plus the next op's 10 us issue on the drained device
    unless the caller counts it in series already (a layer's ops under launch_blocking). DeepSpeed's
    PartitionedTensor work counts no host time for its own ops, so its copies pay that issue under either
    launch mode: a cut's extra seconds are the same with CUDA_LAUNCH_BLOCKING=1 as without."""
    assert math.isclose(sync_copy_s(CLUSTER.device, issue_counted=False), 6.0e-6 + OP, rel_tol=1e-12)
    assert math.isclose(sync_copy_s(CLUSTER.device, issue_counted=True), 6.0e-6, rel_tol=1e-12)
    assert math.isclose(partitioned_role_s((0, 0, 0, 3), 0.0, 4, 0.0, CLUSTER.device, False), 3 * (6.0e-6 + OP),
                        rel_tol=1e-12)
    graph = gpt_graph(h=1024, a=16, layers=8, seq=1024, vocab=32768)
    config = ParallelConfig(pp=2, tp=4, microbatch=1)
    extra = []
    for engine in (ASYNC, BLOCKING):
        on = dataclasses.replace(engine, pp_p2p_batched=True, pp_partitioned_tensors=True)
        off = dataclasses.replace(on, pp_partitioned_tensors=False)
        step = [estimate_config(graph, CLUSTER, config, global_batch=16, engine=e).step_time_s for e in (on, off)]
        extra.append(step[0] - step[1])
    assert extra[0] > 0 and math.isclose(extra[0], extra[1], rel_tol=1e-9)
