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
