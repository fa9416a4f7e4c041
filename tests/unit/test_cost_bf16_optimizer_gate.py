"""The dtype gate of DeepSpeed's BF16_Optimizer fields (Engine.bf16_optimizer_runs, hp_grads, zero1_all_reduces):
megatron-deepspeed.yaml sets bf16_optimizer_grads and zero1_all_reduce true (what DeepSpeed's pipeline engine
does for every bf16 run), and only a bf16 plan pays them: an fp16 plan under the shipped engine is priced
exactly as with both fields off, a bf16 plan by the hand terms (the cast + add pass and fresh gradients every
microbatch; an all-reduce of the 4-byte gradients instead of a reduce-scatter, plus its three passes), and the
quick estimate moves as the exact model does in both dtypes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph, quick_and_exact_change

from autoplan.cost import estimate_config, estimate_layer
from autoplan.cost.comm import all_reduce_s, group_placement, reduce_scatter_s
from autoplan.cost.estimate import fresh_grad_share
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig

SHIPPED = dataclasses.replace(Engine.load("megatron-deepspeed"), block_forward_syncs=0)
OFF = dataclasses.replace(SHIPPED, bf16_optimizer_grads=False, zero1_all_reduce=False)
BASE = a100_cluster()
# an Ampere device whose GEMMs write their output after the mainloop (a fresh gradient saves time) and no host
# cost, so the small blocks stay device-bound (test_cost_fresh_grads.py's device)
DEVICE = dataclasses.replace(BASE.device, num_sms=108, gemm_epilogue_overlap=False, op_overhead_s=0.0)
GRAPH = gpt_graph(h=512, a=8, layers=4, seq=512, vocab=4096, unfused=True)
CONFIG, M = ParallelConfig(dp=8, zero=1, microbatch=1), 4


def _cluster(dtype: str):
    return dataclasses.replace(BASE, dtype=dtype, device=DEVICE)


def _zero1_dp8(config: ParallelConfig) -> bool:
    return config.zero == 1 and config.dp == 8


def test_the_gate_is_the_dtype_and_the_engine_fields() -> None:
    """bf16 only (DeepSpeed builds BF16_Optimizer for a bf16 model alone), and only where the engine sets the
    fields: megatron-deepspeed both, the ZeRO-3 engines neither (stage 3 runs DeepSpeedZeroOptimizer_Stage3)."""
    assert SHIPPED.bf16_optimizer_grads and SHIPPED.zero1_all_reduce
    assert [SHIPPED.hp_grads(d) for d in ("bf16", "fp16", "fp32", "fp8")] == [True, False, False, False]
    assert [SHIPPED.zero1_all_reduces(d) for d in ("bf16", "fp16", "fp32", "fp8")] == [True, False, False, False]
    for name in ("deepspeed", "deepspeed-2024", "megatron-lm", "autoplan"):
        engine = Engine.load(name)
        assert not engine.hp_grads("bf16") and not engine.zero1_all_reduces("bf16"), name
    # megatron-deepspeed frees no .grad of its own: fresh gradients come from BF16_Optimizer alone
    assert fresh_grad_share(False, M, SHIPPED, "bf16") == 1.0 and fresh_grad_share(False, M, SHIPPED, "fp16") == 0.0


def test_an_fp16_plan_is_priced_as_with_the_fields_off() -> None:
    """fp16 (the vTrain rows): the shipped engine's estimate equals the fields-off engine's exactly, layer by
    layer, step by step, and in the quick estimate."""
    cluster = _cluster("fp16")
    for layer in GRAPH.layers:
        on, off = (estimate_layer(layer, cluster, CONFIG, "none", seq_len=512, engine=e) for e in (SHIPPED, OFF))
        assert on == off
    on, off = (estimate_config(GRAPH, cluster, CONFIG, global_batch=8 * M, engine=e) for e in (SHIPPED, OFF))
    assert on.step_time_s == off.step_time_s and on.breakdown == off.breakdown
    quick, exact = quick_and_exact_change(GRAPH, cluster, SHIPPED, OFF, _zero1_dp8)
    np.testing.assert_array_equal(quick, 0.0)
    np.testing.assert_array_equal(exact, 0.0)


def test_a_bf16_plan_pays_both_by_hand() -> None:
    """bf16: compute grows by M x (18 bytes per local gradient element at streaming bandwidth - the fresh
    saving) summed over the layers (cost/layer.HP_GRAD_UPDATE_BYTES); the once-per-step reduction by one
    all-reduce less one reduce-scatter of the gradients, both in bf16 on the wire (megatron-deepspeed.yaml
    bf16_grad_comm, on in both engines), plus the all-reduce's passes over the fp32 buffer (these small ranks'
    two param groups share a bucket: flatten 4 + 4, cast 4 + 2, scale 2 + 2, copy back 2 + 4, buf.copy_ 4 + 4
    = 32 bytes each); the optimizer step's gradient norm moves from the shard (norm + scale, 12 bytes per shard
    element) to the whole local fp32 gradient, norm 4 + clear_hp_grads 4 (test_cost_bf16_optimizer_step.py).
    The quick estimate moves as the exact model."""
    cluster = _cluster("bf16")
    rate = DEVICE.mem_bw_bytes_per_s * DEVICE.mem_bw_efficiency
    on, off = (estimate_config(GRAPH, cluster, CONFIG, global_batch=8 * M, engine=e) for e in (SHIPPED, OFF))
    layers = [(estimate_layer(x, cluster, CONFIG, "none", seq_len=512, engine=SHIPPED), x) for x in GRAPH.layers]
    assert sum(c.fresh_grad_saving_s for c, _ in layers) > 0
    hand = M * sum(18.0 * x.num_params / rate - c.fresh_grad_saving_s for c, x in layers)
    assert on.breakdown["compute"] - off.breakdown["compute"] == pytest.approx(hand, rel=1e-6)
    grads = sum(layer.num_params for layer in GRAPH.layers) - GRAPH.tied_embedding_params
    group = group_placement(CONFIG, ("dp",), cluster.devices_per_node)
    one_rs, one_ar = (f(2.0 * grads, group, cluster) for f in (reduce_scatter_s, all_reduce_s))
    passes = 32.0 * grads / rate
    assert on.breakdown["dp_comm"] - off.breakdown["dp_comm"] == pytest.approx(one_ar - one_rs + passes, rel=1e-6)
    step = (8.0 * grads - 12.0 * grads / CONFIG.dp) / rate
    assert on.breakdown["optimizer"] - off.breakdown["optimizer"] == pytest.approx(step, rel=1e-6)
    quick, exact = quick_and_exact_change(GRAPH, cluster, SHIPPED, OFF, _zero1_dp8)
    assert np.all(exact > 0)
    np.testing.assert_allclose(quick, exact, rtol=1e-6)
