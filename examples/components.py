"""Plan a LLaVA-style model with one device group for the vision tower (+ projector) and one for the language
model, train the plan on 4 local gloo ranks, and compare its losses with one process running the model's
own forward. Needs transformers. Run: python examples/components.py"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import autoplan
from autoplan.execute.component_models import program_for
from autoplan.models.multimodal import tiny_llava

STEPS, BATCH, SEQ = 3, 8, 24


def single_process_losses() -> list[float]:
    torch.manual_seed(0)
    model = tiny_llava()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    data = program_for(model, SEQ).make_batch
    losses = []
    for step in range(STEPS):
        batch = data(0, step, BATCH)
        logits = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    cluster = autoplan.Cluster.load("local-cpu", num_nodes=1, devices_per_node=4)
    # what the component executor runs: dp x tp groups (no pipeline, context or sequence parallelism)
    plans = autoplan.plan_components("tiny-llava", cluster, global_batch=BATCH, seq_len=SEQ, pp=1, cp=1, sp=False,
                                     recompute=("none", "full"), group_options={"model.language_model": {"tp": 2}})
    print(plans)
    print(plans[0].explain())
    report = autoplan.execute_components(plans[0], "tiny-llava", steps=STEPS)
    print("component plan losses:", [f"{x:.6f}" for x in report["losses"]])
    print("one process:          ", [f"{x:.6f}" for x in single_process_losses()])
    print(f"step time {report['step_time_s']:.4f} s measured, {report['predicted_step_time_s']:.4f} s predicted")


if __name__ == "__main__":
    main()
