"""Each parallel technique trains exactly like the single-process reference: losses of 3 AdamW steps
and the final parameters, on tiny models (h 64, 4 layers, batch 8, seq 16)."""

from __future__ import annotations

import pytest
from harness import assert_matches_reference, reference, run_plan

from autoplan.plan.types import Breakdown, Estimate, ParallelConfig, Plan, Stage

STEPS = 3


def check(model: str, config: ParallelConfig) -> None:
    assert_matches_reference(run_plan(model, config, steps=STEPS), reference(model, steps=STEPS))


def test_tp2_with_sequence_parallel_gpt() -> None:
    # gpt: vocab-parallel embedding plus replicated learned positions, then the sequence split
    check("tiny-gpt", ParallelConfig(tp=2, sp=True))


def test_tp2_with_sequence_parallel_llama_gqa_selective_recompute() -> None:
    # 8 query / 4 kv heads -> 4 / 2 per rank; RoPE; SwiGLU w1/w3 column, w2 row
    check("tiny-llama", ParallelConfig(tp=2, sp=True, recompute="selective"))


def test_tp2_moe_attention_only() -> None:
    # MoE blocks: TP on attention; router, experts and shared experts on the gathered sequence
    check("tiny-moe", ParallelConfig(tp=2, sp=True))


@pytest.mark.parametrize("zero", [0, 1, 2, 3], ids=["replicate", "zero1", "zero2", "fsdp-zero3"])
def test_dp2(zero: int) -> None:
    # microbatch 2 of 4 sequences per replica: gradients accumulate (ZeRO-0/1) or are reduced per
    # microbatch (ZeRO-2/3) as plan.layout.zero_layout says; either way the mean gradient
    check("tiny-gpt", ParallelConfig(dp=2, zero=zero, microbatch=2, recompute="full" if zero == 2 else "none"))


@pytest.mark.parametrize("schedule,virtual_stages", [
    ("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1), ("zb", 2),
], ids=["gpipe", "1f1b", "interleaved-v2", "zb-looped", "zbv"])
def test_pp2_schedules(schedule: str, virtual_stages: int) -> None:
    check("tiny-gpt", ParallelConfig(pp=2, schedule=schedule, virtual_stages=virtual_stages, microbatch=2))


def test_pp2_uneven_cut_from_a_plan() -> None:
    estimate = Estimate(step_time_s=0.1, tokens_per_s=1.0, mfu=0.1, peak_mem_bytes=1, mem_capacity_bytes=2,
                        fits=True, breakdown=Breakdown())
    stages = (Stage(index=0, layer_names=("embed", "layers.0")),
              Stage(index=1, layer_names=("layers.1", "layers.2", "layers.3", "norm", "head")))
    plan = Plan(config=ParallelConfig(pp=2, dp=2, zero=3, schedule="1f1b"), estimate=estimate,
                model_name="tiny-gpt", cluster_name="local-cpu", num_devices=4, global_batch=8, seq_len=16,
                stages=stages, layer_recompute=(("layers.2", "full"),))
    assert_matches_reference(run_plan("tiny-gpt", plan, steps=STEPS), reference("tiny-gpt", steps=STEPS))


def test_3d_pp2_dp2_tp2_on_8_ranks() -> None:
    check("tiny-gpt", ParallelConfig(pp=2, dp=2, tp=2, sp=True, zero=3, schedule="1f1b"))
