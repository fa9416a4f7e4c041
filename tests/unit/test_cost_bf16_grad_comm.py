"""DeepSpeed's bf16 wire for BF16_Optimizer's fp32 gradients (Engine.bf16_grad_comm, gated by Engine.bf16_comm):
engine.py allreduce_bucket casts the fp32 buffer to communication_data_type (bf16 for a bf16 run), all-reduces,
scales and copies it back. Against hand computations: 2 bytes per gradient on the data-parallel wire (the
buffers and the tied head's all-reduce stay at 4), the passes' bytes per element in both bucket regimes, the
exact model's step moving by exactly (the all-reduce at 2 bytes - at 4) + (these passes - dp_grad_passes 3 at
4 bytes) / streaming bandwidth, fp16 plans untouched, and the quick estimate moving as the exact model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_cost_graph_helper import (
    a100_cluster,
    every_zero_stage,
    gpt_graph,
    quick_and_exact,
    quick_and_exact_change,
)

from autoplan.cost import estimate_config
from autoplan.cost.comm import all_reduce_s, group_placement
from autoplan.cost.estimate import tied_grad_reduce_s
from autoplan.cost.gradpasses import bf16_comm_pass_bytes, ddp_grad_pass_bytes, dp_wire_bytes, grad_wire_bytes
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig
from autoplan.search.space import SearchOptions, enumerate_space

SHIPPED = every_zero_stage(dataclasses.replace(Engine.load("megatron-deepspeed"), block_forward_syncs=0))
OFF = dataclasses.replace(SHIPPED, bf16_grad_comm=False)
BASE = a100_cluster()
DEVICE = dataclasses.replace(BASE.device, op_overhead_s=0.0)
GRAPH = gpt_graph(h=512, a=8, layers=4, seq=512, vocab=4096, unfused=True)
CONFIG, M = ParallelConfig(dp=8, zero=1, microbatch=1), 4


def _cluster(dtype: str):
    return dataclasses.replace(BASE, dtype=dtype, device=DEVICE)


def test_the_wire_is_bf16_for_bf16_plans_of_the_engine_only() -> None:
    assert SHIPPED.bf16_grad_comm and [SHIPPED.bf16_comm(d) for d in ("bf16", "fp16", "fp32", "fp8")] == [
        True, False, False, False]
    assert dp_wire_bytes("bf16", SHIPPED) == 2.0 and grad_wire_bytes("bf16", SHIPPED) == 4.0  # buffers stay fp32
    assert dp_wire_bytes("bf16", OFF) == 4.0 and dp_wire_bytes("fp16", SHIPPED) == 2.0
    for name in Engine.names():  # only this engine ships it
        assert Engine.load(name).bf16_grad_comm == (name == "megatron-deepspeed"), name


def test_the_pass_bytes_by_hand() -> None:
    """b = 4 (fp32 buffer), w = 2 (bf16): cast b + w, scale w + w, copy back w + b = 16; a bucket of several
    buffers (a rank at or under dp_bucket_numel) adds the flatten's cat b + b and a real buf.copy_ b + b = 32;
    a buffer alone in its bucket: flatten a view, buf.copy_ onto itself (torch's early exit) = 16."""
    bucket = SHIPPED.dp_bucket_numel
    assert bucket == 500_000_000
    assert bf16_comm_pass_bytes("bf16", SHIPPED, bucket) == 32.0  # `numel > numel_per_bucket` closes a bucket
    assert bf16_comm_pass_bytes("bf16", SHIPPED, bucket + 1) == 16.0
    np.testing.assert_array_equal(bf16_comm_pass_bytes("bf16", SHIPPED, np.array([1e6, 4e9])), [32.0, 16.0])
    assert ddp_grad_pass_bytes("bf16", SHIPPED, 4e9) == 16.0
    assert ddp_grad_pass_bytes("bf16", OFF, 4e9) == 3 * 2 * 4.0  # dp_grad_passes 3 at 4 bytes
    assert ddp_grad_pass_bytes("fp16", SHIPPED, 4e9) == 3 * 2 * 2.0


@pytest.mark.parametrize("bucket, per_element", [(500_000_000, 32.0), (1000, 16.0)])
def test_the_exact_step_moves_by_the_wire_and_the_passes(bucket: int, per_element: float) -> None:
    """This small model (far under 500M elements) shares one bucket; with a 1000-element bucket its buffer is
    alone: the step moves by the all-reduce at 2 bytes less at 4, plus the passes less dp_grad_passes' 24."""
    on, off = (dataclasses.replace(e, dp_bucket_numel=bucket) for e in (SHIPPED, OFF))
    cluster = _cluster("bf16")
    rate = DEVICE.mem_bw_bytes_per_s * DEVICE.mem_bw_efficiency
    a, b = (estimate_config(GRAPH, cluster, CONFIG, global_batch=8 * M, engine=e) for e in (on, off))
    grads = sum(layer.num_params for layer in GRAPH.layers) - GRAPH.tied_embedding_params
    group = group_placement(CONFIG, ("dp",), cluster.devices_per_node)
    hand = all_reduce_s(2.0 * grads, group, cluster) - all_reduce_s(4.0 * grads, group, cluster)
    hand += (per_element - 24.0) * grads / rate
    assert a.breakdown["dp_comm"] - b.breakdown["dp_comm"] == pytest.approx(hand, rel=1e-6)
    assert a.step_time_s - b.step_time_s == pytest.approx(hand, rel=1e-6)
    assert a.breakdown["compute"] == b.breakdown["compute"] and a.breakdown["optimizer"] == b.breakdown["optimizer"]


def test_the_tied_head_all_reduce_stays_fp32() -> None:
    """DeepSpeed _exec_reduce_tied_grads all-reduces weight._hp_grad (fp32) itself: 4 bytes per element."""
    cluster, config = _cluster("bf16"), ParallelConfig(dp=4, pp=2, microbatch=1)
    tied = [tied_grad_reduce_s(GRAPH, config, cluster, e, False) for e in (SHIPPED, OFF)]
    pair = group_placement(ParallelConfig(dp=2), ("dp",), cluster.devices_per_node)
    assert tied[0] == tied[1] == pytest.approx(all_reduce_s(4.0 * GRAPH.tied_embedding_params, pair, cluster))


def test_an_fp16_plan_is_untouched() -> None:
    cluster = _cluster("fp16")
    a, b = (estimate_config(GRAPH, cluster, CONFIG, global_batch=8 * M, engine=e) for e in (SHIPPED, OFF))
    assert a.step_time_s == b.step_time_s and a.breakdown == b.breakdown
    space = enumerate_space(GRAPH, cluster, SearchOptions(global_batch=16))
    rows = list(range(0, len(space), max(1, len(space) // 8)))
    (q_on, e_on), (q_off, e_off) = (quick_and_exact(GRAPH, cluster, space, rows, 16, e) for e in (SHIPPED, OFF))
    np.testing.assert_array_equal(q_on, q_off)
    np.testing.assert_array_equal(e_on, e_off)


@pytest.mark.parametrize("bucket", [500_000_000, 1000])
def test_the_quick_estimate_moves_as_the_exact_model(bucket: int) -> None:
    on, off = (dataclasses.replace(e, dp_bucket_numel=bucket) for e in (SHIPPED, OFF))
    quick, exact = quick_and_exact_change(GRAPH, _cluster("bf16"), on, off,
                                          lambda config: config.dp > 1 and config.zero <= 1, count=6)
    assert np.all(exact != 0)
    np.testing.assert_allclose(quick, exact, rtol=1e-6, atol=1e-12)


def test_a_self_copy_costs_a_pass_only_before_torch_2() -> None:
    """One rule for torch's copy_ of a view onto its own data (gradpasses.self_copy_passes, PR #88884): a
    buffer alone in its bucket pays buf.copy_'s read + write, b + b = 8 more bytes, under a torch that lacks
    the early exit (BLOOM's PyTorch 1.11: 16 + 8 = 24), none under torch 2 (16); the several-buffer bucket's
    real copy is unaffected (32 either way)."""
    old_torch = dataclasses.replace(SHIPPED, self_copy_skipped=False)
    alone = SHIPPED.dp_bucket_numel + 1
    assert bf16_comm_pass_bytes("bf16", old_torch, alone) == 16.0 + 2 * 4.0
    assert bf16_comm_pass_bytes("bf16", SHIPPED, alone) == 16.0
    assert bf16_comm_pass_bytes("bf16", old_torch, 1e6) == bf16_comm_pass_bytes("bf16", SHIPPED, 1e6) == 32.0
    assert not Engine.load("deepspeed").self_copy_skipped  # 2021's torch 1.8: cost.deepspeedrank's single_s too
