"""Checkpoints: save under one plan, resume under another, and the losses continue as if uninterrupted
(against the single-process reference of all the steps); plus the atomic save (a crash mid-save leaves the
previous checkpoint the latest loadable one) and the pruning of old step directories."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo  # (DTensor imports it on first use: ~5 s per forked rank unless done here)
from harness import assert_matches_reference, reference, run_ranks
from torch import nn

from autoplan.execute import checkpoint
from autoplan.execute.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from autoplan.plan.types import ParallelConfig

STEPS, SAVE_AT = 4, 2


def _train_rank(rank: int, world_size: int, model_name: str, config: ParallelConfig, options) -> dict:
    from autoplan.execute.train import full_parameters, train

    result = train(model_name, config, options, device=torch.device("cpu"))
    return {"losses": result.losses, "start": result.start_step, "params": full_parameters(result.parts)}


def _run(model_name: str, config: ParallelConfig, **options) -> dict:
    from autoplan.execute.train import TrainOptions

    results = run_ranks(_train_rank, config.num_devices, model_name, config,
                        TrainOptions(global_batch=8, seq_len=16, **options))
    params: dict[str, torch.Tensor] = {}
    for result in results:
        params.update(result["params"])
    return {"losses": results[0]["losses"], "start": results[0]["start"], "params": params}


# A rank killed mid-run, then resumed under another plan through torchrun: tests/dist/test_exec_launch.py
@pytest.mark.parametrize("model_name,before,after", [
    ("tiny-gpt", ParallelConfig(dp=2, zero=3), ParallelConfig(tp=2, sp=True)),
    ("tiny-llama", ParallelConfig(tp=2, recompute="full"), ParallelConfig(pp=2, schedule="1f1b", microbatch=2)),
    ("tiny-moe", ParallelConfig(ep=2, dp=2, zero=3), ParallelConfig(dp=2, zero=0)),
    ("tiny-moe", ParallelConfig(ep=2, zero=0), ParallelConfig(ep=4, zero=2)),
], ids=["fsdp-dp2-to-tp2", "tp2-recompute-to-pp2", "ep2xdp2-to-replicate-dp2", "ep2-to-ep4"])
def test_resume_under_another_plan_continues_the_loss_curve(tmp_path: Path, model_name: str,
                                                             before: ParallelConfig, after: ParallelConfig) -> None:
    ref = reference(model_name, steps=STEPS)
    first = _run(model_name, before, steps=SAVE_AT, save_every=SAVE_AT, checkpoint_dir=str(tmp_path))
    assert latest_checkpoint(tmp_path) is not None
    resumed = _run(model_name, after, steps=STEPS, resume=str(tmp_path))
    assert resumed["start"] == SAVE_AT
    assert_matches_reference({"losses": first["losses"] + resumed["losses"], "params": resumed["params"]}, ref)


# --- atomicity and layout, in this process (DCP runs without a process group) ---

def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, p in enumerate(model.parameters()):
        for key, value in optimizer.state[p].items():
            out[f"state.{i}.{key}"] = torch.as_tensor(value).clone()
    return out


def test_crash_mid_save_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = _model_and_optimizer(0)
    saved = _snapshot(model, optimizer)
    save_checkpoint(tmp_path, step=3, model_parts=[model], optimizers=[optimizer])

    other_model, other_optimizer = _model_and_optimizer(1)  # different weights and moments
    real_save = checkpoint.dcp.save

    def crash_after_writing(state, *, checkpoint_id, **kwargs):
        real_save(state, checkpoint_id=checkpoint_id, **kwargs)  # all data and metadata on disk, not yet renamed
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(checkpoint.dcp, "save", crash_after_writing)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, step=5, model_parts=[other_model], optimizers=[other_optimizer])
    monkeypatch.undo()
    assert (tmp_path / ".step-00000005.tmp").is_dir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000003"

    assert load_checkpoint(tmp_path, model_parts=[other_model], optimizers=[other_optimizer]) == 3
    restored = _snapshot(other_model, other_optimizer)
    assert restored.keys() == saved.keys()
    for key, value in saved.items():
        torch.testing.assert_close(restored[key], value, rtol=0, atol=0, msg=key)


def test_keeps_the_newest_checkpoints_and_reports_missing_ones(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer(0)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(tmp_path, model_parts=[model], optimizers=[optimizer])
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step=step, model_parts=[model], optimizers=[optimizer], keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000006"]
    named = save_checkpoint(tmp_path / "step-0000010", step=10, model_parts=[model], optimizers=[optimizer])
    assert named == tmp_path / "step-0000010" and latest_checkpoint(tmp_path) == named
    assert load_checkpoint(named, model_parts=[model], optimizers=[optimizer]) == 10
    with pytest.raises(ValueError, match="one optimizer per model part"):
        save_checkpoint(tmp_path, step=1, model_parts=[model, model], optimizers=[optimizer])

