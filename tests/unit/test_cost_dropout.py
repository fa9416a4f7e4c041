"""Attention dropout inside a fused kernel (Engine.attention_dropout, kernels.FUSED_DROPOUT_SLOWDOWN) against
hand computations on an ideal device (efficiencies 1, no SMs), and the field's validation."""

from __future__ import annotations

import dataclasses
import math

import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph, unfused_attention_by_hand

from autoplan.cluster.engines import parse_engine
from autoplan.cost import estimate_layer
from autoplan.cost.kernels import FUSED_DROPOUT_SLOWDOWN
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig, Recompute

IDEAL = a100_cluster(ideal=True)
H, A, SEQ, B = 1024, 16, 2048, 2


def _flash_fwd_by_hand() -> float:
    """FlashAttention-2's causal forward on the ideal A100 (kernels.flash_efficiency without SMs): half the
    4 b s^2 h square at kv / (kv + 1), kv = s / 128 / 2 key blocks, and the d = 64 head-dim factor
    (1 + r c / (14 * 128)) / (1 + r c / (14 * 64)), r = 16, c = 9."""
    share = 16 * 9 / 14
    kv = SEQ / 128 / 2
    eff = kv / (kv + 1) * (1 + share / 128) / (1 + share / (H // A))
    return 4.0 * B * SEQ * SEQ * H * 0.5 / (312e12 * eff)


def _pair(block, recompute: Recompute, **kw):
    config = ParallelConfig(microbatch=B)
    return [estimate_layer(block, IDEAL, config, recompute, seq_len=SEQ, engine=Engine(attention_dropout=p, **kw))
            for p in (0.0, 0.1)]


@pytest.mark.parametrize("recompute", list(Recompute))
def test_fused_dropout_slows_the_attention_kernel_by_its_measured_factor(recompute: Recompute) -> None:
    """A GPT block (dropout) under a fused kernel with p = 0.1: the forward grows by (x - 1) times the
    hand-computed kernel time, the backward by 2.5 times that (Dao 2023's backward count), a recompute that
    re-runs the attention core by the forward's growth; activation memory unchanged (no mask stored)."""
    block = gpt_graph(h=H, a=A, layers=1, seq=SEQ, unfused=False).blocks[0]
    off, on = _pair(block, recompute)
    extra = (FUSED_DROPOUT_SLOWDOWN - 1.0) * _flash_fwd_by_hand()
    assert extra > 0
    assert math.isclose(on.fwd_s - off.fwd_s, extra, rel_tol=1e-9)
    assert math.isclose(on.bwd_s - off.bwd_s, 2.5 * extra, rel_tol=1e-9)
    redo = 0.0 if recompute is Recompute.NONE else extra
    assert math.isclose(on.recompute_s - off.recompute_s, redo, rel_tol=1e-9, abs_tol=1e-15)
    assert on.act_mem_bytes == off.act_mem_bytes


def test_no_dropout_factor_without_dropout_or_with_unfused_scores() -> None:
    """A Llama-style (SwiGLU) block trains without dropout (BlockShape.dropout), so the field moves
    nothing; neither does it under unfused attention, whose dropout is score traffic and a stored mask
    (elementwise.block_elementwise_bytes, memory.py) already there at p = 0."""
    gpt = gpt_graph(h=H, a=A, layers=1, seq=SEQ, unfused=False).blocks[0]
    swiglu = dataclasses.replace(gpt, fwd_matmul_flops=gpt.fwd_matmul_flops + 2.0 * B * SEQ * H * 4 * H)
    off, on = _pair(swiglu, Recompute.NONE)
    assert (on.fwd_s, on.bwd_s) == (off.fwd_s, off.bwd_s)
    off, on = _pair(gpt, Recompute.NONE, attention="unfused")
    assert (on.fwd_s, on.bwd_s, on.act_mem_bytes) == (off.fwd_s, off.bwd_s, off.act_mem_bytes)


def test_attention_dropout_must_be_a_probability() -> None:
    with pytest.raises(ValueError, match="attention_dropout"):
        Engine(attention_dropout=1.0)
    with pytest.raises(ValueError, match="attention_dropout"):
        parse_engine({"schema_version": 1, "name": "x", "attention_dropout": "high"}, "x.yaml")
    assert parse_engine({"schema_version": 1, "name": "x", "attention_dropout": 0.1}, "x.yaml").attention_dropout == 0.1


def test_shipped_engines_dropout_as_their_code_defaults() -> None:
    """Megatron's --attention-dropout default 0.1 (every era's arguments.py); autoplan's executor and
    torchtitan's Llama train without."""
    for name in ("megatron-core", "megatron-lm", "megatron-deepspeed"):
        assert Engine.load(name).attention_dropout == 0.1
    for name in ("autoplan", "torchtitan"):
        assert Engine.load(name).attention_dropout == 0.0


@pytest.mark.parametrize("seq", [1024, 2048])
def test_unfused_score_backward_reads_the_mask_not_a_saved_input(seq: int) -> None:
    """Megatron's unfused core backward by hand on the ideal A100 (HBM 2 TB/s, 312 TFLOP/s): four batched
    GEMMs (dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q), each max(FLOPs / peak, bytes / bw) like the
    forward's, plus the dropout backward (read the gradient 2 and the mask 1, write 2) and the fused
    softmax backward (read the gradient and the probabilities, write in place: 6): 11 bytes per score in
    bf16, against FlashAttention's backward of 2.5 x its forward."""
    block = gpt_graph(h=1024, a=16, layers=1, seq=seq, unfused=False).blocks[0]
    config = ParallelConfig(microbatch=2)
    flash, unfused = (estimate_layer(block, IDEAL, config, "none", seq_len=seq, engine=Engine(attention=kind))
                      for kind in ("flash", "unfused"))
    scores, gemm, flash_fwd = unfused_attention_by_hand(seq)
    expected = 4 * gemm + scores * (2 + 1 + 2 + 3 * 2) / 2.0e12 - 2.5 * flash_fwd
    assert math.isclose(unfused.bwd_s - flash.bwd_s, expected, rel_tol=1e-9)
