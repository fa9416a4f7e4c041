"""The shipped `deepspeed-2024` engine (DeepSpeed v0.15.4's ZeRO-3 defaults) against the 2021 `deepspeed`
engine of the SC'21 runs: what differs, a hand-computed stage-3 timeline for each, and a mid-size GPT on
64 A100s where the 2024 step is faster only through the mechanisms that changed."""

from __future__ import annotations

import dataclasses

import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan import cost
from autoplan.cost import comm, estimate_config, estimate_layer
from autoplan.cost.types import GroupPlacement
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig

DS = cost.deepspeed
# the stage-3 mechanism fields the 2024 engine changes, grouped by mechanism
MECHANISMS = (("param_gather_overlap", "zero3_trace_aligned"), ("zero3_sync_per_module",), ("zero3_gather_copy_out",),
              ("zero3_fetch_norm",), ("zero3_regather_persistent",), ("zero3_grad_reduction",))
# what describes the model code (kernels, saved tensors, host ops), not ZeRO-3
MODEL = ("attention", "fused_elementwise", "block_forward_ops", "block_backward_ops", "checkpoint_forward_ops",
         "checkpoint_backward_ops", "separate_qkv_bias_add", "separate_fc2_bias_add", "bias_grad_reduction",
         "attention_layout_copies", "attention_grad_scale", "rmsnorm", "rmsnorm_saves_normalized",
         "swiglu_saves_activation", "attention_saves_repeated_kv", "main_grads_fp32", "grad_reduce_fp32", "fused_adam",
         "separate_qkv_projections", "recompute_early_stop")


def _engines() -> tuple[Engine, Engine]:
    return Engine.load("deepspeed"), Engine.load("deepspeed-2024")


def test_the_2024_engine_loads_and_keeps_the_2021_config_defaults() -> None:
    """Shipped and listed; the config defaults DeepSpeed kept from 2021 to v0.15.4 (zero/config.py:
    prefetch 5e7, max live 1e9, reuse 1e9, persistence 1e5, reduce bucket 5e8) are the same in both, and
    the stage-3 behaviour is the modern one: aligned trace with prefetch, no device sync per module, no
    list all-gather copy-out, no fetch norm, reduce-scatter."""
    old, new = _engines()
    assert "deepspeed-2024" in Engine.names() and new.name == "deepspeed-2024" and new.zero3 == "deepspeed"
    for f in ("zero3_prefetch_numel", "zero3_max_live_numel", "zero3_max_reuse_numel", "zero3_persistence_numel",
              "zero3_reduce_bucket_numel"):
        assert getattr(new, f) == getattr(old, f)
    assert (new.param_gather_overlap, new.zero3_trace_aligned, new.zero3_grad_reduction) == (True, True, "reduce_scatter")
    assert not (new.zero3_sync_per_module or new.zero3_gather_copy_out or new.zero3_fetch_norm
                or new.zero3_regather_persistent)
    assert (old.zero3_trace_aligned, old.zero3_sync_per_module, old.zero3_grad_reduction) == (False, True, "all_reduce")


def test_prefetch_and_no_device_sync_hand_timeline() -> None:
    """Two layers of four equal sub-modules (1e6 elements each, above the persistence threshold), 1 s of
    forward and 2 s of backward per module, host share h per module (host_s = 0.8 per layer: 0.8 / 3 in the
    forward, twice that in the backward, split over four modules), every gather g = 0.5 s, no reductions.
    2021: each gather is waited for (no prefetch) and the device sync before each module exposes its host
    time: forward 8 (g + 1 + hf), backward 8 (g + 2 + 2 hf). 2024: only the first gather of each pass
    shows (the next one, issued once the current module's parameters are in, takes g < its compute), host
    time hidden under the kernels: forward g + 8, backward g + 16."""
    old, new = _engines()
    g, host = 0.5, 0.8
    hf = host / 3.0 / 4.0
    layers = [DS.block_modules([1e6] * 4, 4.0, 8.0, 0.0, host, False) for _ in range(2)]

    def run(engine: Engine) -> tuple[float, float]:
        fwd, bwd, _ = DS.microbatch_s(layers, engine, recompute=False, gather_s=lambda n: g, reduce_s=lambda n: 0.0)
        return fwd, bwd

    assert run(old) == pytest.approx((8 * (g + 1 + hf), 8 * (g + 2 + 2 * hf)), rel=1e-12)
    assert run(new) == pytest.approx((g + 8.0, g + 16.0), rel=1e-12)


def _gpt_64() -> tuple:
    """A mid-size GPT (h 4096, 8 blocks, seq 2048) under ZeRO-3 over 64 A100s (8 nodes), 10 us per host op."""
    graph = gpt_graph(h=4096, a=32, layers=8, seq=2048, unfused=False)
    base = a100_cluster(8)
    cluster = dataclasses.replace(base, device=dataclasses.replace(base.device, op_overhead_s=1e-5))
    return graph, cluster, ParallelConfig(dp=64, zero=3)


def test_on_64_a100s_the_2024_step_is_faster_only_through_the_changed_mechanisms() -> None:
    """The same ZeRO-3 config of a GPT on 64 A100s. (1) The 2024 step is not slower than the 2021 one. (2)
    With the 2021 engine given the 2024 model code, compute and optimizer are unchanged and the whole step
    difference is exposed data-parallel time. (3) Each changed mechanism, switched alone from 2021 to 2024,
    does not raise the exposed time; prefetch, the copy-out, the fetch norm and the reduce-scatter each
    lower it. (4) Prefetch saves no more than every gather of the step takes on the wire, summed by hand
    (each weight matrix gathered in the forward and again in the backward, bf16)."""
    graph, cluster, config = _gpt_64()
    old, new = _engines()
    old_model = dataclasses.replace(old, **{f: getattr(new, f) for f in MODEL})

    def est(engine: Engine):
        return estimate_config(graph, cluster, config, global_batch=64, engine=engine)

    r_old, r_same, r_new = est(old), est(old_model), est(new)
    assert r_new.step_time_s <= r_old.step_time_s
    assert r_new.breakdown.compute == pytest.approx(r_same.breakdown.compute, rel=1e-12)
    assert r_new.breakdown.optimizer == pytest.approx(r_same.breakdown.optimizer, rel=1e-12)
    saved = r_same.breakdown.dp_comm - r_new.breakdown.dp_comm
    assert saved > 0 and r_same.step_time_s - r_new.step_time_s == pytest.approx(saved, rel=1e-9)
    alone = {fields: r_same.breakdown.dp_comm - est(dataclasses.replace(
        old_model, **{f: getattr(new, f) for f in fields})).breakdown.dp_comm for fields in MECHANISMS}
    assert all(v >= 0 for v in alone.values())
    for fields in (MECHANISMS[0], MECHANISMS[2], MECHANISMS[3], MECHANISMS[5]):
        assert alone[fields] > 0, fields
    group = GroupPlacement(size=64, num_nodes=8, per_node=8)
    wire = sum(comm.all_gather_s(2 * n, group, cluster) for x in graph.layers for n in cost.deepspeedrank.layer_numels(
        x, estimate_layer(x, cluster, config, "none", seq_len=2048), graph, config))
    assert alone[MECHANISMS[0]] <= 2 * wire
