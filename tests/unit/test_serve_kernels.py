"""The decode-kernel figures of the engine profiles against hand computations: weights stream at the
engine's measured small-M GEMM bandwidth for their width, 8-bit weights add activation-quant kernels,
the LM head stays 16-bit under fp8, large fp8 GEMMs run at FP8_MATMUL_EFFICIENCY of the fp8 peak, the
custom all-reduce past its table pays the ring's bandwidth term, and CUDA-core decode attention is
bound by the fp32 peak."""

from __future__ import annotations

import dataclasses

import pytest
from serve_helpers import LLAMA3_8B, LLAMA3_70B, bare_engine

from autoplan.cluster.load import Cluster
from autoplan.cost.comm import all_reduce_s
from autoplan.serve.memory import weight_bytes_per_gpu
from autoplan.serve.physics import (
    FP8_MATMUL_EFFICIENCY,
    Hardware,
    Iteration,
    allreduce_s,
    lane_step_s,
    tp_group,
)

H100 = Cluster.load("dgx-h100-80gb")
FP8_8B = dataclasses.replace(LLAMA3_8B, weight_bytes=1.0, ends_bytes=2.0)


def _hw(engine, *, fp8: bool = False) -> Hardware:
    return Hardware(cluster=H100, engine=engine, peak_flops=1979e12 if fp8 else H100.device.peak("bf16"),
                    attention_peak_flops=H100.device.peak("bf16"), gemm_efficiency=FP8_MATMUL_EFFICIENCY if fp8 else 0.0)


def test_decode_gemms_stream_weights_at_the_engines_bandwidth_for_their_width() -> None:
    engine = bare_engine(gemm_bw_efficiency=0.86, gemm_bw_efficiency_8bit=0.77)
    one = Iteration(decode=1, decode_context=1, sampled=1)
    w = 32 * LLAMA3_8B.blocks[0].dense_params
    bf16 = lane_step_s(LLAMA3_8B, one, tp=1, pp=1, ep=1, hw=_hw(engine))[1]
    fp8 = lane_step_s(FP8_8B, one, tp=1, pp=1, ep=1, hw=_hw(engine, fp8=True))[1]
    assert bf16["gemm"] == pytest.approx(w * 2 / (3.35e12 * 0.86), rel=0.01)  # activations add < 1 %
    assert fp8["gemm"] == pytest.approx(w * 1 / (3.35e12 * 0.77), rel=0.01)
    # the LM head stays bf16 under fp8 weights: the same bytes in both
    head = LLAMA3_8B.head_params * 2 / (3.35e12 * 0.86)
    assert fp8["lm_head"] == pytest.approx(head, rel=0.01) and bf16["lm_head"] == pytest.approx(head, rel=0.01)


def test_fp8_weights_add_the_quant_kernels_and_keep_16_bit_ends_in_memory() -> None:
    engine = bare_engine(kernels_per_block=10, quant_kernels_per_block=4, kernel_launch_s=3e-6)
    one = Iteration(decode=1, decode_context=1, sampled=1)
    assert lane_step_s(LLAMA3_8B, one, tp=1, pp=1, ep=1, hw=_hw(engine))[1]["launch"] == pytest.approx(32 * 10 * 3e-6)
    assert lane_step_s(FP8_8B, one, tp=1, pp=1, ep=1, hw=_hw(engine, fp8=True))[1]["launch"] == \
        pytest.approx(32 * 14 * 3e-6)
    blocks = 32 * LLAMA3_8B.blocks[0].dense_params
    ends = LLAMA3_8B.embed_params + LLAMA3_8B.head_params
    assert weight_bytes_per_gpu(FP8_8B, 2, 1) == pytest.approx((blocks * 1 + ends * 2) / 2)


def test_large_fp8_gemms_run_at_the_fp8_efficiency() -> None:
    prefill = Iteration(prefill=8192, prefill_context=1, sampled=1)
    parts = lane_step_s(FP8_8B, prefill, tp=1, pp=1, ep=1, hw=_hw(bare_engine(), fp8=True))[1]
    flops = 2 * 8192 * 32 * LLAMA3_8B.blocks[0].dense_params
    assert parts["gemm"] == pytest.approx(flops / (1979e12 * 0.57))


def test_custom_allreduce_past_its_table_pays_the_ring_bandwidth_not_the_one_shot_slope() -> None:
    table = ((8, ((0.0, 10e-6), (1e6, 45e-6))),)  # one-shot: 35 us per MB
    engine = bare_engine(custom_allreduce_max_bytes=8e6, allreduce_table=table)
    hw = _hw(engine)
    ring = all_reduce_s(6e6, tp_group(8, H100), H100)  # 2 (n-1)/n S / busbw + 2 (n-1) alpha
    assert allreduce_s(6e6, 8, hw) == pytest.approx(max(45e-6, ring))
    assert allreduce_s(6e6, 8, hw) < 45e-6 + 5 * 35e-6  # the extrapolated one-shot line
    assert allreduce_s(0.5e6, 8, hw) == pytest.approx(27.5e-6)  # inside the table: interpolated


def test_cuda_core_decode_attention_is_bound_by_the_fp32_peak_for_big_gqa_groups() -> None:
    # llama3-70b with an fp8 cache: 64 q heads on 8 kv heads, so each 1-byte K or V element feeds
    # 8 heads x 2 FLOPs = 16 FLOP/byte, past the CUDA cores' 67e12 x 0.5 / (3.35e12 x 0.85) = 11.8
    model = dataclasses.replace(LLAMA3_70B, kv_bytes=1.0)
    it = Iteration(decode=64, decode_context=4096, sampled=64)
    flops = 4 * 64 * 4096 * 64 * 128 * 80  # 4 B ctx a d per layer, 80 layers
    kv = 64 * 4096 * 2 * 80 * 8 * 128 * 1
    cores = lane_step_s(model, it, tp=1, pp=1, ep=1, hw=_hw(bare_engine(decode_attention_tensor_cores=False)))[1]
    tensor = lane_step_s(model, it, tp=1, pp=1, ep=1, hw=_hw(bare_engine()))[1]
    assert cores["kv_read"] == pytest.approx(flops / (67e12 * 0.5))
    assert tensor["kv_read"] == pytest.approx(kv / (3.35e12 * 0.85))  # memory-bound on tensor cores
    assert cores["kv_read"] > 1.3 * tensor["kv_read"]


def test_pipeline_pays_the_stage_sends_and_the_token_back() -> None:
    from autoplan.cost.comm import p2p_s

    it = Iteration(decode=4, decode_context=100, sampled=4)
    hw = _hw(bare_engine())
    one = lane_step_s(LLAMA3_8B, it, tp=1, pp=1, ep=1, hw=hw)[0]
    three, parts = lane_step_s(LLAMA3_8B, it, tp=1, pp=3, ep=1, hw=hw)
    sends = 2 * p2p_s(4 * 4096 * 2, False, H100) + p2p_s(4 * 8, False, H100)  # 2 hidden hand-offs + tokens
    assert parts["pipeline"] == pytest.approx(sends)
    assert three == pytest.approx(one + sends)
