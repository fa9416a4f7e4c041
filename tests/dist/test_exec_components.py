"""Component plans train exactly like one process running the model's own forward: the LLaVA-style model
planned with separate device groups for the vision tower (data parallel) and the language model (tensor
parallel, and tp x dp with FSDP), and the sensor-branch policy as a DAG of three groups. Losses of 3 AdamW
steps to 1e-5, final parameters to 1e-4, against transformers' LlavaForConditionalGeneration.forward (and
SensorPolicy.forward) in a single process (one run with SGD, whose update shows a mis-scaled gradient)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from harness import assert_matches_reference, run_ranks

import autoplan
from autoplan.models.multimodal import SensorPolicy, tiny_llava

pytest.importorskip("transformers")

STEPS, B, SEQ = 3, 8, 24
SGD_LR = 0.5  # large steps: a wrongly scaled gradient moves the parameters visibly (Adam would normalise it)
EXECUTABLE = {"pp": 1, "cp": 1, "sp": False}
FACTORIES = {"tiny-llava": tiny_llava, "tiny-policy": SensorPolicy}


def _forward_loss(name: str, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if name == "tiny-llava":
        logits = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"]).logits
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    return F.mse_loss(model(batch["images"], batch["state"]), batch["actions"])


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR, foreach=False)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=False)


def _reference(rank: int, world_size: int, name: str, optimizer_name: str) -> dict:
    from autoplan.execute.component_models import program_for

    torch.manual_seed(0)
    model = FACTORIES[name]()
    optimizer = _optimizer(optimizer_name, model.parameters())
    data = program_for(model, SEQ).make_batch  # the data contract only; the forward is the model's own
    losses = []
    for step in range(STEPS):
        loss = _forward_loss(name, model, data(0, step, B))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@functools.cache
def reference(name: str, optimizer: str = "adamw") -> dict:
    return run_ranks(_reference, 1, name, optimizer)[0]


def _rank(rank: int, world_size: int, name: str, plan, optimizer: str) -> dict:
    from autoplan.execute.component_train import ComponentTrainOptions, train_components

    torch.manual_seed(0)
    options = ComponentTrainOptions(steps=STEPS, optimizer=optimizer, lr=SGD_LR if optimizer == "sgd" else 1e-3)
    return train_components(FACTORIES[name](), plan, options, device=torch.device("cpu"))


def run(name: str, plan, optimizer: str = "adamw") -> dict:
    results = run_ranks(_rank, plan.num_devices, name, plan, optimizer, deadline_s=180)
    assert all(r["losses"] == results[0]["losses"] for r in results), "ranks disagree on the loss"
    params: dict[str, torch.Tensor] = {}
    for r in results:
        params.update(r["params"])
    return {"losses": results[0]["losses"], "params": params}


def llava_plan(devices: tuple[int, int], *, lm_tp: int, m: int, zero: int, recompute: str = "none"):
    cluster = autoplan.Cluster.load("local-cpu", num_nodes=1, devices_per_node=sum(devices))
    plans = autoplan.plan_components("tiny-llava", cluster, global_batch=B, seq_len=SEQ, devices=devices,
                                     num_microbatches=m, zero=(zero,), recompute=(recompute,),
                                     group_options={"model.language_model": {"tp": lm_tp}}, **EXECUTABLE)
    return plans[0]


def test_llava_vision_dp2_language_model_tp2_on_4_ranks() -> None:
    # SGD: the vision group's gradients arrive from a dp-1 group into a dp-2 one (scaled by 2 / 1)
    plan = llava_plan((2, 2), lm_tp=2, m=1, zero=0)
    assert [(g.components, g.plan.config.dp, g.plan.config.tp) for g in plan.groups] == [
        (("model.vision_tower", "model.multi_modal_projector"), 2, 1), (("model.language_model",), 1, 2)]
    assert_matches_reference(run("tiny-llava", plan, "sgd"), reference("tiny-llava", "sgd"))


def test_llava_fsdp_vision_and_tp2_dp2_language_model_on_6_ranks() -> None:
    # vision tower FSDP (ZeRO-3) over 2 ranks; language model tp 2 x dp 2 with FSDP and full recompute;
    # 2 hand-off microbatches (the vision group runs both forwards before its backwards)
    plan = llava_plan((2, 4), lm_tp=2, m=2, zero=3, recompute="full")
    assert [(g.plan.config.dp, g.plan.config.tp) for g in plan.groups] == [(2, 1), (2, 2)]
    assert_matches_reference(run("tiny-llava", plan), reference("tiny-llava"))


def test_policy_sensor_and_vision_branches_feed_a_data_parallel_trunk() -> None:
    model = SensorPolicy()
    cluster = autoplan.Cluster.load("local-cpu", num_nodes=1, devices_per_node=4)
    plan = autoplan.plan_components(model, cluster, global_batch=B, seq_len=16, devices=(1, 1, 2),
                                    num_microbatches=2, example_inputs=model.example_inputs(),
                                    group_options={"trunk": {"dp": 2}}, **EXECUTABLE)[0]
    assert {(e.src, e.dst) for e in plan.edges} == {(0, 2), (1, 2)}
    assert_matches_reference(run("tiny-policy", plan), reference("tiny-policy"))
