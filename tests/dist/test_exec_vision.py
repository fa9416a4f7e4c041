"""Models without tokens train under their plans exactly like one process running the model's own forward: the
ResNet (convolutions, BatchNorm) and the ViT of autoplan.models.vision, on seeded images and class labels
(execute.images), pipelined over their blocks where the plan says so. The plans are the search's own best
(which, for these models, only proposes what the executor runs: search.space.token_free_restriction) and
fixed ones for pipeline x tensor parallelism, ZeRO-3 and recompute. Losses of 3 AdamW steps to 1e-5, every
final parameter to 3e-4 (test_exec_hf.PARAM_ATOL).

BatchNorm normalises over the samples of one forward, so the reference groups the samples as the plan does:
microbatches of the plan's size, in order (a replica holds contiguous rows)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from harness import run_ranks
from test_exec_hf import assert_matches

import autoplan
from autoplan.cli.main import main
from autoplan.execute.images import image_batch
from autoplan.execute.preflight import check_plan
from autoplan.execute.source import model_spec
from autoplan.execute.train import TrainOptions, full_parameters, train
from autoplan.execute.weights import materialise
from autoplan.plan.types import ParallelConfig

STEPS, BATCH, SEQ = 3, 16, 64  # 64 patches: ViT 32 x 32 images of 4 x 4 patches; ResNet 8 x 8 images


@functools.cache
def spec_of(name: str):
    return model_spec(name, seq_len=SEQ)[0]


def _reference(rank: int, world: int, spec, microbatch: int) -> dict:
    model = spec.build()
    materialise(model, device=torch.device("cpu"), seed=0, std=spec.init_std)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    losses = []
    for step in range(STEPS):
        images, labels = image_batch(0, step, global_batch=BATCH, input_shape=spec.input_shape,
                                     num_outputs=spec.num_outputs)
        chunks = BATCH // microbatch
        total = 0.0
        for x, y in zip(images.chunk(chunks), labels.chunk(chunks)):
            loss = F.cross_entropy(model(x), y) / chunks
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@functools.cache
def reference(name: str, microbatch: int) -> dict:
    return run_ranks(_reference, 1, spec_of(name), microbatch)[0]


def _train(rank: int, world: int, spec, plan) -> dict:
    result = train(spec, plan, TrainOptions(steps=STEPS, global_batch=BATCH, seq_len=SEQ), device=torch.device("cpu"))
    return {"losses": result.losses, "params": full_parameters(result.parts)}


def run(name: str, plan) -> dict:
    config = plan.config if hasattr(plan, "config") else plan
    results = run_ranks(_train, config.num_devices, spec_of(name), plan, deadline_s=240.0)
    assert all(r["losses"] == results[0]["losses"] for r in results), "ranks disagree on the global loss"
    params: dict[str, torch.Tensor] = {}
    for r in results:
        params.update(r["params"])
    return {"losses": results[0]["losses"], "params": params}


def searched(name: str):
    cluster = autoplan.Cluster.load("local-cpu", num_nodes=1, devices_per_node=4)
    return autoplan.autoplan(name, cluster, global_batch=BATCH, seq_len=SEQ, top_k=3, use_ilp=False)


def test_model_specs_record_the_sample_shape_and_classes() -> None:
    assert (spec_of("vit-tiny").input_shape, spec_of("vit-tiny").num_outputs) == ((3, 32, 32), 10)
    assert (spec_of("resnet-tiny").input_shape, spec_of("resnet-tiny").num_outputs) == ((3, 8, 8), 10)
    assert spec_of("resnet-tiny").family == "module"


@pytest.mark.parametrize("name", ["resnet-tiny", "vit-tiny"])
def test_the_searched_plans_train_like_one_process(name: str) -> None:
    plans = searched(name)
    check_plan(plans[0], global_batch=BATCH, nproc_per_node=4)  # the best passes the checks before launch
    for plan in plans[:2]:
        try:
            check_plan(plan, global_batch=BATCH, nproc_per_node=4)
        except ValueError:  # e.g. 1F1B with fewer microbatches than stages, which torch refuses (for any model)
            continue
        c = plan.config
        assert c.cp == 1 and not c.sp  # a model without tokens: no sequence to split
        if name == "resnet-tiny":
            assert c.tp == 1 and c.recompute.value != "selective"
        assert_matches(run(name, plan), reference(name, c.microbatch))


@pytest.mark.parametrize(("name", "config"), [
    ("resnet-tiny", ParallelConfig(pp=4, schedule="1f1b", microbatch=4)),  # a pipeline over the 4 blocks
    ("resnet-tiny", ParallelConfig(dp=4, zero=3, microbatch=2, recompute="full")),
    ("vit-tiny", ParallelConfig(pp=2, tp=2, microbatch=4, schedule="interleaved", virtual_stages=2)),
    ("vit-tiny", ParallelConfig(tp=2, dp=2, microbatch=4, zero=2, recompute="selective")),
], ids=["resnet-pp4", "resnet-fsdp-full", "vit-pp2-tp2-interleaved", "vit-tp2-dp2-selective"])
def test_pipelines_tensor_parallelism_and_sharding(name: str, config: ParallelConfig) -> None:
    assert_matches(run(name, config), reference(name, config.microbatch))


def test_autoplan_run_of_the_searched_resnet_plan(tmp_path, capsys) -> None:
    plan_path, report = tmp_path / "plan.json", tmp_path / "report.json"
    assert main(["plan", "--model", "resnet-tiny", "--cluster", "local-cpu", "--devices-per-node", "4",
                 "--global-batch", str(BATCH), "--seq-len", str(SEQ), "--quiet", "--no-ilp", "--top-k", "1",
                 "--json", str(plan_path)]) == 0
    assert main(["run", "--plan", str(plan_path), "--model", "resnet-tiny", "--steps", str(STEPS),
                 "--report", str(report)]) == 0
    microbatch = json.loads(plan_path.read_text())["config"]["microbatch"]
    ran = json.loads(report.read_text())
    torch.testing.assert_close(torch.tensor(ran["losses"]), torch.tensor(reference("resnet-tiny", microbatch)["losses"]),
                               rtol=1e-5, atol=1e-5)
