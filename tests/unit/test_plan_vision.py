"""Models without tokens (a ViT, a ResNet) are planned in samples/s and say what input they were assumed to
take; language models' plans keep tokens/s and their JSON unchanged."""

from __future__ import annotations

import functools

import pytest

import autoplan
from autoplan.models.vision import resnet_tiny, vit_tiny
from autoplan.plan.io import plan_from_json, plan_to_dict, plan_to_json

B = 32


@functools.cache
def plans(name: str):
    model, seq = {"vit": (vit_tiny(), 64), "resnet": (resnet_tiny(), 64)}[name]
    return autoplan.autoplan(model, autoplan.Cluster.load("local-cpu"), global_batch=B, seq_len=seq, top_k=2,
                             use_ilp=False)


# vit-tiny: 32 x 32 images of 4 x 4 patches = 64 patches; resnet-tiny: a stride-1 stem, so seq_len 64 means
# 8 x 8 images (capture's convention: seq_len = (side / stride)^2)
@pytest.mark.parametrize("name,shape", [("vit", (3, 32, 32)), ("resnet", (3, 8, 8))])
def test_plans_report_samples_per_second_and_the_input_shape(name: str, shape: tuple[int, ...]) -> None:
    best = plans(name)[0]
    assert best.sample_shape == shape
    assert best.samples_per_s == pytest.approx(B / best.estimate.step_time_s)
    text = str(plans(name))
    assert "samples/s" in text and "tokens/s" not in text
    assert f"one sample = input {shape}" in text
    assert f"{best.samples_per_s:,.1f}" in text
    assert f"{best.samples_per_s:,.1f} samples/s" in best.explain()
    assert plan_from_json(plan_to_json(best)) == best


def test_language_model_plans_keep_tokens() -> None:
    best = autoplan.autoplan("tiny-gpt", autoplan.Cluster.load("local-cpu"), global_batch=8, seq_len=16, top_k=1,
                             use_ilp=False)[0]
    assert best.sample_shape == () and "sample_shape" not in plan_to_dict(best)
    assert "tokens/s" in str(autoplan.Plans([best]))
