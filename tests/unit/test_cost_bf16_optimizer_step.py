"""DeepSpeed's BF16_Optimizer.step (Engine.hp_grads; deepspeed/runtime/bf16_optimizer.py, v0.6.2 and BLOOM's
olruwase/bf16-updates branch): its Adam, the fp32 -> bf16 copy of the updated shard and the rest of the step run
over the data-parallel shard, but the global gradient norm reads the fp32 gradient of every local parameter
(get_grads_for_norm: fp32_groups_gradients, 4 bytes) and clear_hp_grads zeroes the whole local fp32 buffer
(4 bytes), so those 8 bytes are paid on the unsharded local model instead of the norm + scale's 12 on the shard.
Checked against a hand count of the bytes, its dtype gate, and the quick estimate against the exact model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, every_zero_stage, gpt_graph, quick_and_exact_change

from autoplan.cost import estimate_config
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig

BASE = a100_cluster()
BF16 = dataclasses.replace(BASE, dtype="bf16")
ON = every_zero_stage(dataclasses.replace(Engine.load("megatron-deepspeed"), block_forward_syncs=0))
OFF = dataclasses.replace(ON, bf16_optimizer_grads=False)
GRAPH = gpt_graph(h=512, a=8, layers=4, seq=512, vocab=4096)
CONFIG = ParallelConfig(dp=8, zero=1, microbatch=1)
RATE = BASE.device.mem_bw_bytes_per_s * BASE.device.mem_bw_efficiency


def _optimizer_s(cluster, engine) -> float:
    return estimate_config(GRAPH, cluster, CONFIG, global_batch=32, engine=engine).breakdown["optimizer"]


def test_the_bf16_optimizer_norms_and_clears_every_local_fp32_gradient() -> None:
    """dp 8, ZeRO 1, one rank holds every parameter (untied graph, pp 1) and updates an eighth. Without the
    BF16_Optimizer fields a bf16 step streams fused Adam 28 + norm and scale 12 + master -> bf16 copy 6 bytes
    per shard parameter (the gradients are fp32 already); with them 28 + 6 on the shard and 4 + 4 (norm,
    clear_hp_grads) on every local parameter."""
    local = sum(layer.num_params for layer in GRAPH.layers)
    shard = local / 8
    assert ON.hp_grads("bf16") and not OFF.hp_grads("bf16")
    assert _optimizer_s(BF16, OFF) == pytest.approx((28 + 12 + 6) * shard / RATE, rel=1e-9)
    assert _optimizer_s(BF16, ON) == pytest.approx(((28 + 6) * shard + (4 + 4) * local) / RATE, rel=1e-9)


def test_an_fp16_plan_keeps_the_sharded_norm() -> None:
    """BF16_Optimizer is built only for a bf16 model (Engine.bf16_optimizer_runs): the same engine's fp16 plan
    pays Adam 28, norm and scale 12, master copy 6, fp16 -> fp32 gradient copy 6, unscale 8 on the shard."""
    fp16 = dataclasses.replace(BASE, dtype="fp16")
    shard = sum(layer.num_params for layer in GRAPH.layers) / 8
    assert _optimizer_s(fp16, ON) == pytest.approx((28 + 12 + 6 + 6 + 8) * shard / RATE, rel=1e-9)
    assert _optimizer_s(fp16, ON) == _optimizer_s(fp16, OFF)


def test_the_quick_estimate_prices_the_step_as_the_exact_model_does() -> None:
    quick, exact = quick_and_exact_change(GRAPH, BF16, ON, OFF, lambda c: c.zero == 1 and c.dp == 8,
                                          global_batch=32)
    assert np.all(exact != 0)
    np.testing.assert_allclose(quick, exact, rtol=1e-6)
