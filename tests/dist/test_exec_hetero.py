"""A plan for a heterogeneous cluster runs on gloo: two node groups of 2 local ranks, the second declared
3x faster (every rate of its profile), plan tiny-gpt with pp=2; the faster group's pipeline rank gets
more blocks, and the plan trains like the single-process reference (losses to 1e-5)."""

from __future__ import annotations

import dataclasses

import pytest
import torch._dynamo  # noqa: F401  (DTensor imports it on first use: ~5 s per forked rank unless done here)
from harness import assert_matches_reference, reference, run_plan

import autoplan
from autoplan import Cluster

pytestmark = pytest.mark.dist

MODEL, BATCH, SEQ, STEPS = "tiny-gpt", 8, 16, 3


def two_group_cluster():
    slow = Cluster.load("local-cpu", devices_per_node=2)
    dev = slow.device
    fast = dataclasses.replace(slow, name="local-cpu-3x", device=dataclasses.replace(
        dev, name="cpu-rank-3x", peak_flops=tuple((d, 3 * f) for d, f in dev.peak_flops),
        mem_bw_bytes_per_s=3 * dev.mem_bw_bytes_per_s, op_overhead_s=dev.op_overhead_s / 3,
        tp_op_overhead_s=dev.tp_op_overhead_s / 3, dp_layer_overhead_s=dev.dp_layer_overhead_s / 3))
    return Cluster.combine([(slow, 1), (fast, 1)])


def test_heterogeneous_plan_trains_like_the_reference() -> None:
    cluster = two_group_cluster()
    plan = autoplan.autoplan(MODEL, cluster, global_batch=BATCH, seq_len=SEQ, pp=(2,), top_k=1)[0]
    blocks = [sum(1 for n in s.layer_names if n.startswith("layers.")) for s in plan.stages]
    groups = [s.group for s in plan.stages]
    assert plan.config.pp == 2 and groups == ["local-cpu", "local-cpu-3x"]
    assert blocks[1] > blocks[0], blocks  # the faster group's stage holds more of the 4 blocks
    run = run_plan(MODEL, plan, steps=STEPS, global_batch=BATCH, seq_len=SEQ)
    assert_matches_reference(run, reference(MODEL, steps=STEPS, global_batch=BATCH, seq_len=SEQ))
