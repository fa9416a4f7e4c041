"""The serving physics and queueing against hand computations: decode reads weights and KV at the
achievable bandwidth, MoE decode reads only the touched experts, all-reduce latency from the engine's
table, chunked-prefill interference, Little's law and the M/D/1 prefill queue."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
from serve_helpers import LLAMA3_8B, bare_engine, llama

from autoplan.cluster.load import Cluster
from autoplan.serve.engine import load_engine
from autoplan.serve.physics import Hardware, Iteration, allreduce_s, lane_step_s, touched_experts
from autoplan.serve.queueing import LaneSpec, closed_loop, md1_wait_s, open_loop

SERVE_DIR = Path(__file__).resolve().parents[2] / "autoplan" / "serve"


def _hw(engine=None, cluster="dgx-h100-80gb") -> Hardware:
    spec = Cluster.load(cluster)
    return Hardware(cluster=spec, engine=engine or bare_engine(), peak_flops=spec.device.peak("bf16"),
                    attention_peak_flops=spec.device.peak("bf16"))


def test_serve_package_imports_no_torch() -> None:
    for path in SERVE_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "torch" or n.startswith("torch.") for n in names), path.name


def test_decode_step_reads_weights_and_kv_at_achievable_bandwidth() -> None:
    hw = _hw()
    bw = hw.cluster.device.mem_bw_bytes_per_s * hw.cluster.device.mem_bw_efficiency  # 3.35 TB/s x 0.85
    b, ctx = 4, 1000
    t, parts = lane_step_s(LLAMA3_8B, Iteration(decode=b, decode_context=ctx, sampled=b), tp=1, pp=1, ep=1, hw=hw)
    blocks = 32 * LLAMA3_8B.blocks[0].dense_params * 2
    assert parts["gemm"] == pytest.approx(blocks / bw, rel=0.01)  # activations add < 1 %
    kv = b * ctx * 2 * 32 * 8 * 128 * 2  # tokens x 2 x layers x kv_heads x head_dim x bytes
    assert parts["kv_read"] == pytest.approx(kv / bw, rel=1e-6)
    assert t == pytest.approx((blocks + kv + LLAMA3_8B.head_params * 2) / bw, rel=0.02)


def test_moe_decode_reads_only_the_touched_experts() -> None:
    hw = _hw()
    bw = hw.cluster.device.mem_bw_bytes_per_s * hw.cluster.device.mem_bw_efficiency
    moe = llama("moe", layers=4, h=4096, a=32, g=8, f=14336, vocab=32000, experts=8, top_k=2)
    per_expert = moe.blocks[0].params_per_expert * 2
    # one token picks 2 of 8 experts: 8 (1 - (6/8)^1) = 2 are read
    assert touched_experts(8, 2, 1) == pytest.approx(2.0)
    one = lane_step_s(moe, Iteration(decode=1, decode_context=1, sampled=1), tp=1, pp=1, ep=1, hw=hw)[1]
    assert one["experts"] == pytest.approx(4 * 2 * per_expert / bw, rel=0.01)
    # a big batch touches all 8
    many = lane_step_s(moe, Iteration(decode=64, decode_context=1, sampled=64), tp=1, pp=1, ep=1, hw=hw)[1]
    assert many["experts"] == pytest.approx(4 * 8 * per_expert / bw, rel=0.01)


def test_allreduce_uses_the_engines_measured_table_then_nccl() -> None:
    hw = _hw(load_engine("vllm"))
    assert allreduce_s(512, 2, hw) == pytest.approx(9.5e-6)
    assert allreduce_s((262144 + 524288) / 2, 8, hw) == pytest.approx((24.1e-6 + 30.4e-6) / 2)
    # above custom_allreduce_max_bytes (8 MiB) NCCL's ring (cost.comm): the cheaper of its LL and Simple
    # protocols, base + 2 (n - 1) alpha + 2 (n - 1)/n S / busbw (LL: half the bus bandwidth, capped)
    link = hw.cluster.intra_node
    big = 64 * 2**20
    busbw = link.bw_bytes_per_s * link.allreduce_busbw_fraction
    ll_bw = min(0.5 * busbw, link.ll_max_bw_bytes_per_s or float("inf"))
    ring = min(link.base_latency_s + 2 * 7 * link.latency_s + 2 * 7 / 8 * big / ll_bw,
               link.base_latency_s + 2 * 7 * link.simple_latency_s + 2 * 7 / 8 * big / busbw)
    assert allreduce_s(big, 8, hw) == pytest.approx(ring, rel=1e-6)
    assert allreduce_s(big, 1, hw) == 0.0


def test_tp_decode_pays_two_allreduces_per_block_and_the_kernel_launches() -> None:
    engine = bare_engine(kernels_per_block=10, kernel_launch_s=2e-6, custom_allreduce_max_bytes=1e6,
                         allreduce_table=((2, ((0.0, 5e-6), (1e6, 5e-6))),))  # 5 us per all-reduce
    parts = lane_step_s(LLAMA3_8B, Iteration(decode=1, decode_context=1, sampled=1), tp=2, pp=1, ep=1, hw=_hw(engine))[1]
    assert parts["allreduce"] == pytest.approx((2 * 32 + 1) * 5e-6)  # + the vocab-parallel embedding's
    assert parts["launch"] == pytest.approx(32 * 10 * 2e-6)


def test_closed_loop_of_one_client_is_prefill_then_decode_steps() -> None:
    # one client: TTFT = its prefill alone (no queue, no one to interfere), TPOT = a batch-1 decode step
    def step(it: Iteration) -> float:
        return 0.01 + 1e-5 * it.prefill  # 10 ms per iteration + 10 us per prompt token

    state = closed_loop(step, LaneSpec(input_len=1000, output_len=101, cap=64, budget=8192), 1)
    assert state.ttft_s == pytest.approx(0.02) and state.tpot_s == pytest.approx(0.01)
    assert state.rate == pytest.approx(1 / (0.02 + 100 * 0.01))  # Little's law: N = rate x time in system


def test_chunked_prefill_interference_by_hand() -> None:
    # many clients: a decoding request sees the others' prefill iterations (tau_p) at rate lambda k:
    # TPOT = 1 / (lambda k + (1 - lambda k tau_p) / tau_d)
    def step(it: Iteration) -> float:
        return 0.02 if it.prefill else 0.01

    state = closed_loop(step, LaneSpec(input_len=1000, output_len=101, cap=1000, budget=8192), 1000)
    rate = state.rate * 999 / 1000
    assert state.tpot_s == pytest.approx(1 / (rate + (1 - rate * 0.02) / 0.01), rel=1e-4)
    assert 0.01 < state.tpot_s < 0.02


def test_open_loop_prefill_queue_is_md1_and_overload_is_unstable() -> None:
    assert md1_wait_s(10.0, 0.05) == pytest.approx(0.5 * 0.05 / (2 * 0.5))
    assert math.isinf(md1_wait_s(20.0, 0.05))

    def step(it: Iteration) -> float:
        return 0.05 if it.prefill else 0.01

    spec = LaneSpec(input_len=1000, output_len=11, cap=1000, budget=8192)
    ok = open_loop(step, spec, 5.0)
    assert ok.stable and ok.ttft_s > 0.05
    over = open_loop(step, spec, 25.0)  # prefill alone needs 25 x 0.05 = 1.25 s per second
    assert not over.stable and math.isinf(over.ttft_s)
