"""plan_components: the step of a component plan recomputed by hand from its groups' own estimates
(T = longest path + (M - 1) x slowest slot + longest tail, p2p hops on the edges), the best plan against
every other device split (brute force), JSON round trip, and the errors a caller can make."""

from __future__ import annotations

import functools
import math

import pytest

import autoplan
from autoplan.cost import estimate_config, p2p_s
from autoplan.models.multimodal import SensorPolicy
from autoplan.plan.components import ComponentPlan, component_plan_from_json, component_plan_to_json
from autoplan.search.api import component_graph
from autoplan.search.components import group_sizes, splits, sub_cluster

pytest.importorskip("transformers")

B, SEQ = 8, 24
EXECUTABLE = {"pp": 1, "cp": 1, "sp": False}


@functools.cache
def cluster(devices: int = 4):
    return autoplan.Cluster.load("local-cpu", num_nodes=1, devices_per_node=devices)


@functools.cache
def llava_plans(m: int = 2):
    return autoplan.plan_components("tiny-llava", cluster(), global_batch=B, seq_len=SEQ, num_microbatches=m,
                                    top_k=50, **EXECUTABLE)


def test_step_is_the_group_pipeline_by_hand() -> None:
    plan = llava_plans(2)[0]
    m = plan.num_microbatches
    enc, lm = plan.groups
    graph = component_graph("tiny-llava", SEQ)
    slots, tails = [], []
    for group in plan.groups:
        sub = sub_cluster(cluster(), group.num_devices)
        est = estimate_config(graph.merged(group.components), sub, group.plan.config, global_batch=B,
                              stages=tuple(s.layer_names for s in group.plan.stages))
        tails.append(est.breakdown.optimizer + est.breakdown.dp_comm)
        slots.append((est.step_time_s - tails[-1]) / m)
    # one hop per microbatch on the edge: B/m samples of 16 image features x 32 in the profile's training
    # dtype (captured in bf16, rescaled), the LM's tp ranks each take a copy, inside one node
    total = B // m * 16 * 32 * {"fp32": 4, "bf16": 2}[cluster().dtype]
    c_lm, c_enc = lm.plan.config, enc.plan.config
    hop = p2p_s(max(total / c_lm.dp, total * c_lm.tp / (enc.num_devices / c_enc.pp)), False, cluster())
    assert math.isclose(plan.edges[0].hop_time_s, hop, rel_tol=1e-12)
    slots = [s + hop for s in slots]
    expected = sum(slots) + (m - 1) * max(slots) + max(tails)
    assert math.isclose(plan.estimate.step_time_s, expected, rel_tol=1e-9)
    assert math.isclose(plan.estimate.breakdown.total_s, expected, rel_tol=1e-9)
    assert math.isclose(plan.samples_per_s, B / expected)
    assert plan.estimate.tokens_per_s == pytest.approx(B * SEQ / expected)


def test_best_plan_beats_every_device_split() -> None:
    plans = llava_plans(2)
    best = plans[0]
    assert [g.components for g in best.groups] == [("model.vision_tower", "model.multi_modal_projector"),
                                                  ("model.language_model",)]
    for sizes in splits(4, 2, 4):
        try:
            fixed = autoplan.plan_components("tiny-llava", cluster(), global_batch=B, seq_len=SEQ, devices=sizes,
                                             num_microbatches=2, **EXECUTABLE)
        except ValueError:
            continue
        assert fixed[0].estimate.step_time_s >= best.estimate.step_time_s
    steps = [p.estimate.step_time_s for p in plans]
    assert steps == sorted(steps)


def test_parallel_branches_fill_along_the_longest_path() -> None:
    model = SensorPolicy()
    plan = autoplan.plan_components(model, cluster(), global_batch=B, seq_len=16, devices=(1, 1, 2),
                                    num_microbatches=2, example_inputs=model.example_inputs(), **EXECUTABLE)[0]
    s = [g.slot_time_s for g in plan.groups]
    tail = max(g.tail_time_s for g in plan.groups)
    # sensor and vision run side by side: the fill is the longer branch plus the trunk
    assert math.isclose(plan.estimate.step_time_s, max(s[0], s[1]) + s[2] + (2 - 1) * max(s) + tail, rel_tol=1e-9)
    assert {(e.src, e.dst) for e in plan.edges} == {(0, 2), (1, 2)}


def test_feeding_group_holds_every_microbatch() -> None:
    one, four = (autoplan.plan_components("tiny-llava", cluster(), global_batch=B, seq_len=SEQ, devices=(2, 2),
                                          num_microbatches=m, zero=(0,), recompute=("none",), **EXECUTABLE)[0]
                 for m in (1, 4))
    # the encoder group keeps all microbatches until their gradients return: more memory at M=4 than
    # its own plan's peak; the language-model group (the loss) keeps only its own
    enc = four.groups[0]
    assert enc.peak_mem_bytes > enc.plan.estimate.peak_mem_bytes
    assert four.groups[1].peak_mem_bytes == four.groups[1].plan.estimate.peak_mem_bytes
    assert one.groups[0].peak_mem_bytes == one.groups[0].plan.estimate.peak_mem_bytes


def test_component_plan_json_round_trip() -> None:
    plan = llava_plans(2)[0]
    again = component_plan_from_json(component_plan_to_json(plan))
    assert again == plan and isinstance(again, ComponentPlan)
    with pytest.raises(ValueError, match="not a component plan"):
        component_plan_from_json('{"schema_version": 1}')


def test_sizes_and_splits() -> None:
    assert group_sizes(32, 8) == (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32)
    assert splits(4, 2, 4) == [(1, 3), (2, 2), (3, 1)]
    assert all(sum(s) == 32 and len(s) == 3 for s in splits(32, 3, 8))
    sub = sub_cluster(autoplan.Cluster.load("dgx-a100-80gb", num_nodes=2), 12)
    assert (sub.devices_per_node, sub.num_nodes) == (4, 3)


@pytest.mark.parametrize("kwargs,message", [
    ({"devices": (3, 2)}, "summing to 4"),
    ({"num_microbatches": 3}, "divisor of global batch 8"),
    ({"group_options": {"vision": {"tp": 2}}}, "unknown components"),
    ({"tensor": 2}, "unknown option"),
])
def test_bad_options_are_one_line(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        autoplan.plan_components("tiny-llava", cluster(), global_batch=B, seq_len=SEQ, **kwargs)


def test_chain_model_is_sent_to_autoplan() -> None:
    with pytest.raises(ValueError, match="autoplan.autoplan"):
        autoplan.plan_components("tiny-gpt", cluster(), global_batch=B, seq_len=16)


def test_more_groups_than_devices() -> None:
    with pytest.raises(ValueError, match="need at least 2 devices"):
        autoplan.plan_components("tiny-llava", cluster(1), global_batch=B, seq_len=SEQ)
