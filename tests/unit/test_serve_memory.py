"""Serving memory against hand computations: weights per device, KV bytes per token (replicated past
kv_heads), the engines' budgets, and the llama3-70b-on-one-GPU case."""

from __future__ import annotations

import math

import pytest
from serve_helpers import LLAMA3_70B, bare_engine, llama

from autoplan.cluster.load import Cluster
from autoplan.serve.api import serve_estimate, serve_plan
from autoplan.serve.engine import load_engine
from autoplan.serve.memory import instance_memory, kv_bytes_per_token_per_gpu, weight_bytes_per_gpu

GIB = 2**30


def test_llama3_70b_params_match_the_released_count() -> None:
    # 70.55 B parameters (Meta's model card: 70B; the captured preset has exactly this many)
    assert LLAMA3_70B.num_params == 80 * 855_654_400 + 2 * 128256 * 8192 + 8192


def test_llama3_70b_bf16_has_no_tp1_plan_on_one_80gb_gpu() -> None:
    one = Cluster.load("dgx-h100-80gb", devices_per_node=1)
    # by hand: 70.55e9 parameters x 2 bytes = 141 GB of weights > the 85.5 GB (80 GiB) device
    assert weight_bytes_per_gpu(LLAMA3_70B, 1, 1) == pytest.approx(2 * 70.55e9, rel=1e-3)
    est = serve_estimate(LLAMA3_70B, one, {"tp": 1}, input_len=512, output_len=128, concurrency=1)
    assert not est.fits and est.max_concurrency == 0 and math.isinf(est.tpot_s)
    with pytest.raises(ValueError, match=r"no serving layout of llama3-70b fits 1 x H100"):
        serve_plan(LLAMA3_70B, one, input_len=512, output_len=128, concurrency=1)


def test_weights_per_gpu_split_over_tp_and_pp_by_hand() -> None:
    blocks, ends = 80 * 855_654_400, 128256 * 8192
    assert weight_bytes_per_gpu(LLAMA3_70B, 4, 1) == pytest.approx((blocks + 2 * ends + 8192) / 4 * 2)
    # pp 2: 40 blocks and the larger end (the head, with the final norm) on the heaviest stage
    assert weight_bytes_per_gpu(LLAMA3_70B, 4, 2) == pytest.approx((blocks / 2 + ends + 8192) / 4 * 2)


def test_kv_bytes_per_token_replicate_past_kv_heads() -> None:
    # 2 (K, V) x 80 layers x 8 kv heads x 128 head_dim x 2 bytes = 327,680 bytes per token
    assert kv_bytes_per_token_per_gpu(LLAMA3_70B, 1, 1) == 327_680
    assert kv_bytes_per_token_per_gpu(LLAMA3_70B, 8, 1) == 327_680 / 8
    model = llama("kv2", layers=4, h=1024, a=16, g=2, f=2048, vocab=256)
    per_tp = [kv_bytes_per_token_per_gpu(model, tp, 1) for tp in (1, 2, 4, 8)]
    assert per_tp == [2 * 4 * 2 * 64 * 2, 2 * 4 * 1 * 64 * 2, 2 * 4 * 1 * 64 * 2, 2 * 4 * 1 * 64 * 2]


def test_kv_capacity_stops_growing_once_tp_exceeds_kv_heads() -> None:
    # a model whose weights are negligible next to the KV cache: the pool per device is the same at
    # every tp, so the instance's token capacity is pool / per-device bytes per token: it doubles up to
    # tp = kv_heads (2) and is flat past it, where each device keeps one (replicated) head
    model = llama("kv-heavy", layers=64, h=1024, a=8, g=2, f=8, vocab=8)  # 0.3 GB of weights
    dev = Cluster.load("dgx-h100-80gb").device
    engine = bare_engine()
    tokens = {tp: instance_memory(model, dev, engine, tp=tp, pp=1, batched_tokens=1, max_seqs=1).kv_tokens
              for tp in (1, 2, 4, 8)}
    assert tokens[2] == pytest.approx(2 * tokens[1], rel=0.01)
    assert tokens[4] == pytest.approx(tokens[2], rel=0.01) and tokens[8] == pytest.approx(tokens[2], rel=0.01)
    assert tokens[1] == pytest.approx(dev.mem_bytes / (2 * 64 * 2 * 128 * 2), rel=0.01)


def test_engine_budgets_by_hand() -> None:
    dev = Cluster.load("dgx-h100-80gb").device
    w = weight_bytes_per_gpu(LLAMA3_70B, 4, 1)
    vllm = instance_memory(LLAMA3_70B, dev, load_engine("vllm"), tp=4, pp=1, batched_tokens=8192, max_seqs=1024)
    assert vllm.kv_pool == pytest.approx(0.9 * dev.mem_bytes - w - vllm.activations)
    # SGLang: mem_fraction_static = (mem - (9.5 + 4 / 2) GiB) / mem on an H100, KV pool = that share - weights
    sglang = instance_memory(LLAMA3_70B, dev, load_engine("sglang"), tp=4, pp=1, batched_tokens=8192, max_seqs=2048)
    assert sglang.kv_pool == pytest.approx(dev.mem_bytes - 11.5 * GIB - w, rel=1e-3)
    trt = instance_memory(LLAMA3_70B, dev, load_engine("tensorrt-llm"), tp=4, pp=1, batched_tokens=8192, max_seqs=2048)
    assert trt.kv_pool == pytest.approx(0.9 * (dev.mem_bytes - w - trt.activations))
    # paged blocks: vLLM rounds the pool down to whole 16-token blocks
    assert vllm.kv_tokens % 16 == 0 and vllm.kv_tokens == 16 * int(vllm.kv_pool // (vllm.kv_per_token * 16))
