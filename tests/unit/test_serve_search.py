"""The serving search: a tighter TPOT SLO moves the pick to a higher tp, disaggregation pays its KV
transfer (by hand, inside a node and across nodes), goodput ranking and the smallest device count."""

from __future__ import annotations

import pytest
from serve_helpers import LLAMA3_8B

from autoplan.cluster.load import Cluster
from autoplan.serve.api import serve_estimate, serve_plan
from autoplan.serve.memory import kv_bytes_per_token_per_gpu

H100 = Cluster.load("dgx-h100-80gb")
FAST = {"pp": 1, "max_batch": (64, 256), "disaggregated": False}  # a small space keeps the test fast


def test_a_tighter_tpot_slo_moves_the_pick_to_a_higher_tp() -> None:
    free = serve_plan(LLAMA3_8B, H100, input_len=512, output_len=256, concurrency=16, **FAST).best
    assert free.config.tp == 1  # the most tokens per GPU: no tensor parallelism
    # the SLO: 80 % of what one GPU can do at all (batch 1): no tp = 1 plan, however many replicas, meets it
    floor = serve_estimate(LLAMA3_8B, H100, {"tp": 1}, input_len=512, output_len=256, concurrency=1).tpot_s
    plans = serve_plan(LLAMA3_8B, H100, input_len=512, output_len=256, concurrency=16, tpot_slo_s=0.8 * floor, **FAST)
    tight = plans.best
    assert tight.meets_slo and tight.config.tp > 1 and tight.estimate.tpot_s <= 0.8 * floor
    assert all(not s.meets for s in plans.scored if s.config.tp == 1)
    # goodput: among the plans that meet the SLO, none has more tokens/s per GPU
    assert tight.estimate.tokens_per_s_per_gpu == max(s.estimate.tokens_per_s_per_gpu for s in plans.scored if s.meets)


def _transfer_by_hand(cluster, tokens: int, crosses: bool) -> float:
    link = cluster.inter_node if crosses else cluster.intra_node
    per_device = kv_bytes_per_token_per_gpu(LLAMA3_8B, 2, 1) * tokens  # both sides tp = 2: 8 kv heads / 2
    base = max(cluster.intra_node.base_latency_s, link.base_latency_s)  # cost.comm.p2p_s: an NCCL kernel's fixed cost
    return base + link.latency_s + per_device / (link.bw_bytes_per_s * link.p2p_bw_fraction)


def test_disaggregation_pays_its_kv_transfer() -> None:
    config = {"tp": 2, "disaggregated": True, "prefill_tp": 2, "prefill_replicas": 1, "replicas": 1}
    est = serve_estimate(LLAMA3_8B, H100, config, input_len=4096, output_len=64, concurrency=1)
    inside = _transfer_by_hand(H100, 4096, crosses=False)  # 4 devices in one 8-GPU node: NVLink
    assert est.kv_transfer_s == pytest.approx(inside, rel=1e-9)
    agg = serve_estimate(LLAMA3_8B, H100, {"tp": 2}, input_len=4096, output_len=64, concurrency=1, engine="vllm")
    # one client: TTFT = the prefill + the hand-off (the aggregated TTFT is the same prefill, no hand-off)
    assert est.ttft_s == pytest.approx(agg.ttft_s + inside, rel=0.02)
    two_nodes = Cluster.load("dgx-h100-80gb", num_nodes=2, devices_per_node=2)
    across = serve_estimate(LLAMA3_8B, two_nodes, config, input_len=4096, output_len=64, concurrency=1)
    assert across.kv_transfer_s == pytest.approx(_transfer_by_hand(two_nodes, 4096, crosses=True), rel=1e-9)
    assert across.kv_transfer_s > 5 * est.kv_transfer_s  # 50 GB/s NIC against 450 GB/s NVLink


def test_smallest_device_count_holds_the_concurrency() -> None:
    plans = serve_plan(LLAMA3_8B, H100, input_len=2048, output_len=2048, concurrency=400, **FAST)
    # by hand: an 80 GB H100 holds 0.9 x 85.5 GB - 16 GB of weights = ~60 GB of KV at 128 KiB per token,
    # ~ 460k tokens = ~112 requests of 4096 tokens: 400 clients need 4 such GPUs
    assert plans.min_devices == 4
    assert all(p.config.num_devices >= 1 for p in plans)


def test_the_plan_exports_vllm_and_sglang_launch_arguments() -> None:
    plan = serve_plan(LLAMA3_8B, H100, input_len=512, output_len=128, concurrency=64, tp=2, replicas=2,
                      max_batch=64, pp=1, disaggregated=False).best
    vllm = " ".join(plan.vllm_args()["serve"])
    assert vllm.startswith("vllm serve meta-llama/Meta-Llama-3-8B-Instruct")
    assert "--tensor-parallel-size 2" in vllm and "--data-parallel-size 2" in vllm and "--max-num-seqs 64" in vllm
    sglang = " ".join(plan.sglang_args()["serve"])
    assert "--tp-size 2" in sglang and "--dp-size 2" in sglang and "--max-running-requests 64" in sglang
    data = plan.to_dict()
    assert {"tp", "pp", "ep", "replicas", "max_batch", "disaggregated", "prefill_devices", "decode_devices"} <= set(data["config"])
    assert {"ttft_s", "tpot_s", "tokens_per_s", "tokens_per_s_per_gpu", "kv_cache_bytes_per_gpu", "max_concurrency",
            "peak_mem_bytes", "fits"} <= set(data["estimate"])
