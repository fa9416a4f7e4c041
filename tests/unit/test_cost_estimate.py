"""estimate_config: the step as a whole (known trends, breakdown, MFU, errors), each against an
independent computation."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cost_graph_helper import a100_cluster, gpt_graph, narayanan_flops

from autoplan.cost import balanced_stages, estimate_config
from autoplan.graph.types import Layer, LayerGraph, LayerRole
from autoplan.plan.types import ParallelConfig

SMALL = gpt_graph(h=2048, a=16, layers=8, seq=1024)
GPT3 = gpt_graph(h=12288, a=96, layers=96, seq=2048, unfused=False)


def test_one_device_has_no_communication() -> None:
    c = a100_cluster(1, per_node=1)
    est = estimate_config(SMALL, c, ParallelConfig(microbatch=2), global_batch=8)
    for cause in ("tp_comm", "dp_comm", "pp_comm", "pp_bubble", "ep_comm", "cp_comm"):
        assert est.breakdown[cause] == 0.0
    assert math.isclose(est.breakdown.total_s, est.step_time_s, rel_tol=1e-12)


def test_mfu_is_one_on_an_ideal_device() -> None:
    """Only matmul FLOPs, efficiencies 1, no parameters: step = 3 F / peak exactly."""
    layers = tuple(Layer(name=f"l{i}", kind="l", role=LayerRole.BLOCK, index=i, fwd_matmul_flops=3.12e12,
                         fwd_attention_flops=0.0, fwd_elementwise_flops=0.0, num_params=0, param_bytes=0,
                         activation_bytes=10) for i in range(2))
    graph = LayerGraph(model_name="mm", layers=layers, seq_len=16, microbatch=1)
    est = estimate_config(graph, a100_cluster(1, per_node=1, ideal=True), ParallelConfig(), global_batch=4)
    assert math.isclose(est.step_time_s, 4 * 3 * 2 * 3.12e12 / 312e12, rel_tol=1e-12)
    assert math.isclose(est.mfu, 1.0, rel_tol=1e-12)


def test_model_flops_follow_narayanan() -> None:
    c = a100_cluster(1)
    est = estimate_config(SMALL, c, ParallelConfig(dp=8, recompute="full"), global_batch=16)
    assert math.isclose(est.model_flops, narayanan_flops(B=16, s=1024, l=8, h=2048, V=51200), rel_tol=1e-12)
    layers_only = narayanan_flops(B=16, s=1024, l=8, h=2048, V=0)
    assert math.isclose(est.hardware_flops - est.model_flops, layers_only / 3, rel_tol=1e-12)


@settings(max_examples=30, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 4]), mb=st.sampled_from([1, 2]),
       zero=st.integers(0, 3), recompute=st.sampled_from(["none", "selective", "full"]),
       schedule=st.sampled_from(["1f1b", "gpipe", "interleaved", "zb"]), sp=st.booleans())
def test_breakdown_adds_up_to_the_step(tp, pp, mb, zero, recompute, schedule, sp) -> None:
    v = 2 if schedule in ("interleaved", "zb") and pp > 1 else 1
    cfg = ParallelConfig(tp=tp, pp=pp, dp=16 // (tp * pp), microbatch=mb, zero=zero, recompute=recompute,
                         schedule=schedule, virtual_stages=v, sp=sp)
    est = estimate_config(SMALL, a100_cluster(2), cfg, global_batch=64)
    assert math.isclose(est.breakdown.total_s, est.step_time_s, rel_tol=1e-9)
    assert all(value >= 0 for value in est.breakdown.to_dict().values())
    assert est.fits == (est.peak_mem_bytes <= est.mem_capacity_bytes)
    assert math.isclose(est.tokens_per_s, 64 * 1024 / est.step_time_s)


def test_more_microbatches_shrink_the_bubble_share() -> None:
    c = a100_cluster(1)
    share = []
    for batch in (8, 16, 64):
        est = estimate_config(SMALL, c, ParallelConfig(pp=4, dp=2), global_batch=batch)
        share.append(est.breakdown.pp_bubble / est.step_time_s)
    assert share[0] > share[1] > share[2] > 0


def test_more_replicas_at_fixed_batch_lower_per_gpu_throughput() -> None:
    per_gpu = []
    for nodes in (1, 2, 8):
        c = a100_cluster(nodes)
        est = estimate_config(SMALL, c, ParallelConfig(dp=8 * nodes), global_batch=64)
        per_gpu.append(est.tokens_per_s / c.num_devices)
    assert per_gpu[0] > per_gpu[1] > per_gpu[2]


def test_selective_beats_full_recompute_when_both_fit() -> None:
    c = a100_cluster(8)
    base = {"tp": 8, "pp": 8, "dp": 1, "sp": True, "microbatch": 1}
    sel = estimate_config(GPT3, c, ParallelConfig(recompute="selective", **base), global_batch=64)
    full = estimate_config(GPT3, c, ParallelConfig(recompute="full", **base), global_batch=64)
    assert sel.fits and full.fits
    assert sel.step_time_s < full.step_time_s
    assert full.peak_mem_bytes < sel.peak_mem_bytes


def test_zero3_alone_on_hundreds_of_gpus_is_slower_than_tp_pp() -> None:
    """gpt3-175b on 512 A100s: ZeRO-3 alone only fits with full recompute, so it loses to tp8 x pp8 with
    selective recompute; where the nodes have a single 200 Gb/s NIC its weight gathers (3 x 350 GB per
    microbatch through the node) can no longer hide behind compute and it is much slower."""
    for nic_bw, factor in ((25e9, 1.03), (25e9 / 8, 1.5)):
        c = a100_cluster(64, nic_bw=nic_bw)
        zero3 = estimate_config(GPT3, c, ParallelConfig(dp=512, zero=3, recompute="full"), global_batch=1536)
        zero3_sel = estimate_config(GPT3, c, ParallelConfig(dp=512, zero=3, recompute="selective"),
                                    global_batch=1536)
        mega = estimate_config(GPT3, c, ParallelConfig(tp=8, pp=8, dp=8, sp=True, recompute="selective"),
                               global_batch=1536)
        assert zero3.fits and mega.fits and not zero3_sel.fits
        assert zero3.step_time_s > factor * mega.step_time_s


def test_balanced_stages_puts_embedding_first_and_head_last() -> None:
    stages = balanced_stages(gpt_graph(h=64, a=4, layers=10, seq=16), 4)
    assert stages[0][0] == "embed" and stages[-1][-1] == "head"
    assert [sum(n.startswith("layers.") for n in s) for s in stages] == [2, 3, 3, 2]


@pytest.mark.parametrize("cfg, batch, match", [
    (ParallelConfig(dp=4), 8, "devices"),
    (ParallelConfig(dp=8), 12, "global batch 12"),
    (ParallelConfig(tp=8, dp=1, microbatch=1), 8, "tp=8 does not divide the attention heads"),
    (ParallelConfig(dp=4, ep=2), 8, "without routed experts"),
    (ParallelConfig(dp=2, cp=4), 8, r"cp=4 needs seq_len divisible by 2\*cp=8"),
    (ParallelConfig(pp=8, dp=1), 8, "blocks"),
])
def test_configs_that_cannot_run(cfg, batch, match) -> None:
    graph = gpt_graph(h=96, a=12, layers=4, seq=18)
    with pytest.raises(ValueError, match=match):
        estimate_config(graph, a100_cluster(1), cfg, global_batch=batch)


def test_experts_must_divide_over_ep() -> None:
    moe = gpt_graph(h=64, a=4, layers=2, seq=16, experts=6, top_k=2)
    with pytest.raises(ValueError, match="ep=4 does not divide the 6 experts"):
        estimate_config(moe, a100_cluster(1), ParallelConfig(dp=2, ep=4), global_batch=8)
    est = estimate_config(moe, a100_cluster(1), ParallelConfig(dp=4, ep=2), global_batch=8)
    assert est.breakdown.ep_comm > 0


def test_given_stages_are_checked() -> None:
    c = a100_cluster(1)
    with pytest.raises(ValueError, match="stages has 1 entries"):
        estimate_config(SMALL, c, ParallelConfig(pp=2, dp=4), global_batch=8,
                        stages=(tuple(x.name for x in SMALL.layers),))


def test_expert_parallel_layer_by_hand() -> None:
    """MoE block (4h GELU experts, top-2 of 8, no shared expert): ep=2 halves the expert weights a device
    holds and pays 4 all-to-alls of tokens * top_k * h 16-bit values; activations per token are
    10h + 8h (Q, K, V, projection input) + top_k (2h + 16h) bytes (Korthikanti et al.'s terms)."""
    from autoplan.cost import all_to_all_s, estimate_layer, group_placement

    h, s = 256, 128
    block = gpt_graph(h=h, a=4, layers=1, seq=s, experts=8, top_k=2, unfused=False).blocks[0]
    c = a100_cluster(1)
    one = estimate_layer(block, c, ParallelConfig(dp=8), "none", seq_len=s)
    two = estimate_layer(block, c, ParallelConfig(dp=4, ep=2), "none", seq_len=s)
    assert two.expert_param_count * 2 == one.expert_param_count == block.expert_params
    assert one.ep_comm_s == 0.0
    group = group_placement(ParallelConfig(dp=4, ep=2), ("ep",), 8)
    assert math.isclose(two.ep_comm_s, 4 * all_to_all_s(s * 2 * h * 2, group, c), rel_tol=1e-12)
    assert math.isclose(one.act_mem_bytes, s * (10 * h + 8 * h + 2 * (2 * h + 16 * h)), rel_tol=1e-9)


def test_context_parallel_splits_activations_and_exchanges_kv() -> None:
    """cp = 2 halves a block's activations where the attention re-exchanges K / V in its backward
    (Megatron-Core's ring); autoplan's all-gather core keeps the gathered K / V of the whole sequence on
    cp rank 0: 2 (K, V) x h x 2 bytes for each of the 4096 keys it did not hold (bf16)."""
    from autoplan.cost import estimate_layer
    from autoplan.plan.engine import Engine

    h, s = 4096, 8192
    block = gpt_graph(h=h, a=32, layers=1, seq=s, unfused=False).blocks[0]
    c = a100_cluster(1)
    ring = Engine.load("megatron-core")
    one = estimate_layer(block, c, ParallelConfig(dp=8), "none", seq_len=s, engine=ring)
    two = estimate_layer(block, c, ParallelConfig(dp=4, cp=2), "none", seq_len=s, engine=ring)
    assert math.isclose(two.act_mem_bytes * 2, one.act_mem_bytes, rel_tol=1e-9)
    own = estimate_layer(block, c, ParallelConfig(dp=4, cp=2), "none", seq_len=s)
    assert math.isclose(own.act_mem_bytes - two.act_mem_bytes, 2 * h * 2 * (s - s // 2), rel_tol=1e-9)
    one = estimate_layer(block, c, ParallelConfig(dp=8), "none", seq_len=s)
    two = estimate_layer(block, c, ParallelConfig(dp=4, cp=2), "none", seq_len=s)
    assert one.cp_comm_s == 0.0 and two.cp_comm_s >= 0.0
    assert two.fwd_s < one.fwd_s
    slow = a100_cluster(2, nic_bw=1e9)  # cp across nodes on a slow NIC: the exchange shows
    across = estimate_layer(block, slow, ParallelConfig(cp=16), "none", seq_len=8192)
    assert across.cp_comm_s > 0.0


def test_bf16_reduces_gradients_in_fp32_fp16_in_fp16() -> None:
    """Megatron local DDP (overlap_dp=False), pp = 1: the exposed gradient sync is one ring all-reduce of
    every parameter over dp, 4 bytes each under bf16 (fp32 reduce) and 2 under fp16, by hand on an ideal
    cluster: 2 (n - 1)/n * S / BW with n = 16 ranks on 2 nodes (8 per node: min(NVLink, 8 NICs))."""
    params = sum(layer.num_params for layer in SMALL.layers)
    bw = min(300e9, 8 * 25e9)
    for dtype, wire in (("bf16", 4), ("fp16", 2)):
        cluster = dataclasses.replace(a100_cluster(2, ideal=True), dtype=dtype)
        est = estimate_config(SMALL, cluster, ParallelConfig(dp=16), global_batch=16, overlap_dp=False)
        optimizer = est.breakdown.optimizer
        hand = 2 * 15 / 16 * params * wire / bw
        assert math.isclose(est.step_time_s - est.breakdown.compute - optimizer, hand, rel_tol=1e-9)
