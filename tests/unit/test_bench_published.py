"""bench/published.py's FLOP counts (the measured step of a record comes from them) against hand computations."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from graphs import gpt_graph
from published import megatron_core_flops, megatron_flops, padded_vocab


def _by_gemm(*, B: int, s: int, l: int, h: int, V: int, a: int, g: int, f: int, gated: bool) -> float:
    """Every matmul of one iteration, counted one by one: 2 FLOPs a multiply-add, backward twice forward."""
    d = h // a
    per_token_layer = (2 * h * (a + 2 * g) * d      # QKV projection
                       + 2 * a * d * h               # attention output projection
                       + 2 * s * a * d + 2 * s * a * d  # Q K^T and scores x V over all s keys (no causal halving)
                       + 2 * h * f * (3 if gated else 2))  # MLP: fc1 (gate + up when gated) and fc2
    forward = B * s * (l * per_token_layer + 2 * h * V)  # + the logits
    return 3.0 * forward


def test_megatron_core_flops_counts_every_gemm_gpt():
    args = {"B": 192, "s": 4096, "l": 24, "h": 2048, "V": 131072, "a": 16}
    assert megatron_core_flops(**args) == pytest.approx(_by_gemm(**args, g=16, f=4 * 2048, gated=False), rel=1e-12)


def test_megatron_core_flops_counts_every_gemm_gqa_swiglu():
    args = {"B": 8, "s": 2048, "l": 4, "h": 4096, "V": 32000, "a": 32}
    got = megatron_core_flops(**args, ffn=11008, kv_heads=8, swiglu=True)
    assert got == pytest.approx(_by_gemm(**args, g=8, f=11008, gated=True), rel=1e-12)


def test_megatron_core_flops_is_the_sc21_count_without_recompute():
    # Narayanan et al. 2021 count a full recompute of the blocks (4 passes instead of 3), the logits' 6 B s h V once
    args = {"B": 1536, "s": 2048, "l": 96, "h": 12288, "V": 51200}
    logits = 6.0 * 1536 * 2048 * 12288 * 51200
    assert megatron_core_flops(**args, a=96) == pytest.approx(0.75 * (megatron_flops(**args) - logits) + logits,
                                                              rel=1e-12)


def test_padded_vocab_rounds_up_to_128_tp():
    assert padded_vocab(131072, 8) == 131072
    assert padded_vocab(50257, 1) == 50304      # GPT-2's 50257 -> 393 x 128
    assert padded_vocab(50257, 8) == 51200      # 50 x 1024


def test_untied_gpt_has_no_tied_embedding():
    kw = {"h": 64, "a": 4, "layers": 2, "seq": 16, "vocab": 100}
    assert gpt_graph(**kw).tied_embedding_params == 100 * 64
    assert gpt_graph(**kw, tied=False).tied_embedding_params == 0


@pytest.mark.parametrize("rid", ["llama3-405b-8192-cp1", "llama3-405b-16384-cp1", "llama3-405b-16384-cp16"])
def test_llama3_measured_step_is_palm_mfu_over_the_full_attention_square(rid):
    """Dubey et al. 2024 Table 4 gives BF16 MFU after Chowdhery et al. (PaLM, appendix B): 6 N + 12 L H Q T
    FLOPs per token, N the matmul parameters (126 blocks + the output head; the embedding lookup is no
    matmul), attention over the whole T x T square, no causal halving. The record's step is those FLOPs
    over MFU x 989 TFLOP/s x GPUs: at 128K the attention term is 57 % of them (a causal count would make
    the measured step 29 % shorter)."""
    from published import predict, records

    rec = next(r for r in records() if r["id"] == rid)
    h, f, layers, vocab, s = 16384, 53248, 126, 128256, rec["model"]["seq_len"]
    qkv = h + 2 * h * 8 // 128  # GQA: 128 query heads, 8 kv heads
    n = layers * (h * qkv + h * h + 3 * h * f) + vocab * h
    per_token = 6.0 * n + 12.0 * layers * h * s
    hand = per_token * rec["global_batch"] * s / (rec["measured"]["mfu"] * 989e12 * rec["cluster"]["gpus"])
    assert predict(rec).measured_s == pytest.approx(hand, rel=1e-9)
