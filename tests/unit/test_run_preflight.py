"""`autoplan run` refuses each mistake in the parent process, before any rank starts: one line on stderr, exit
code 2, and torchrun never launched (run_torchrun is replaced by a failure here). One test per mistake. How
long each takes from a cold start is printed by bench/preflight_speed.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from autoplan.cli.main import main
from autoplan.execute import launch
from autoplan.execute.checkpoint_dirs import latest_checkpoint
from autoplan.execute.source import meta_device
from autoplan.graph.fingerprint import model_fingerprint
from autoplan.models import preset
from autoplan.plan.io import save_plan
from autoplan.plan.types import Breakdown, Estimate, MemoryBreakdown, ParallelConfig, Plan, Stage

BLOCK_MODEL = str(Path(__file__).parents[1] / "fixtures" / "models" / "block_lm.py") + ":build"
JOB = ["--global-batch", "8", "--seq-len", "16", "--steps", "2"]


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("torchrun was launched")

    monkeypatch.setattr(launch, "run_torchrun", refuse)


def _plan(model: str = "tiny-gpt", config: ParallelConfig | None = None, *, num_devices: int | None = None,
          fingerprint: bool = True, stages: tuple[Stage, ...] = (), memory: int = 0) -> Plan:
    config = config or ParallelConfig(dp=2)
    with meta_device():
        fp = model_fingerprint(preset(model)) if fingerprint else ""
    estimate = Estimate(step_time_s=0.1, tokens_per_s=1.0, mfu=0.1, peak_mem_bytes=memory + 2**28,
                        mem_capacity_bytes=2**34, fits=True, breakdown=Breakdown(),
                        memory=MemoryBreakdown(weights=memory, reserve=2**28))
    return Plan(config=config, estimate=estimate, model_name=model, cluster_name="local-cpu",
                num_devices=num_devices or config.num_devices, global_batch=8, seq_len=16, stages=stages,
                fingerprint=fp)


def refused(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoplan: error: ") and err.count("\n") == 1, err
    return err


def _saved(tmp_path: Path, plan: Plan) -> str:
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    return str(path)


def test_plan_made_for_another_model(tmp_path: Path, capsys) -> None:
    err = refused(["--plan", _saved(tmp_path, _plan("tiny-gpt")), "--model", "tiny-llama", "--steps", "2"], capsys)
    assert "made for another model (tiny-gpt" in err and "than tiny-llama" in err


def test_old_plan_without_fingerprint_made_for_another_preset(tmp_path: Path, capsys) -> None:
    path = _saved(tmp_path, _plan("tiny-gpt", fingerprint=False))
    assert "fingerprint" not in json.loads(Path(path).read_text())
    err = refused(["--plan", path, "--model", "tiny-llama", "--steps", "2"], capsys)
    assert "made for tiny-gpt, not tiny-llama" in err


def test_hand_edited_plan_whose_degrees_do_not_give_its_devices(tmp_path: Path, capsys) -> None:
    path = _saved(tmp_path, _plan(config=ParallelConfig(tp=4, dp=8), num_devices=8))
    err = refused(["--plan", path, "--model", "tiny-gpt", "--steps", "2"], capsys)
    assert "= 32 devices but the plan says num_devices 8" in err


def test_rank_count_other_than_the_plans(tmp_path: Path, capsys) -> None:
    path = _saved(tmp_path, _plan(config=ParallelConfig(dp=4)))
    err = refused(["--plan", path, "--model", "tiny-gpt", "--steps", "2", "--nproc-per-node", "2"], capsys)
    assert "needs pp*dp*ep*cp*tp = 4 ranks but --nproc-per-node is 2" in err


def test_zero_steps(capsys) -> None:
    assert "--steps must be a positive" in refused(["--model", "tiny-gpt", *JOB[:4], "--steps", "0"], capsys)


def test_save_every_without_a_checkpoint_dir(capsys) -> None:
    assert "needs --checkpoint-dir" in refused(["--model", "tiny-gpt", *JOB, "--save-every", "1"], capsys)


def test_resume_of_a_missing_directory(tmp_path: Path, capsys) -> None:
    err = refused(["--model", "tiny-gpt", *JOB, "--resume", str(tmp_path / "nowhere")], capsys)
    assert "no such directory" in err


def test_resume_of_a_directory_without_a_checkpoint(tmp_path: Path, capsys) -> None:
    (tmp_path / "step-00000002").mkdir()  # no DCP metadata: an interrupted save
    assert latest_checkpoint(tmp_path) is None
    assert "no complete checkpoint" in refused(["--model", "tiny-gpt", *JOB, "--resume", str(tmp_path)], capsys)


def test_stage_layout_that_is_not_the_models(tmp_path: Path, capsys) -> None:
    stages = (Stage(index=0, layer_names=("embed", "layers.1", "layers.0")),
              Stage(index=1, layer_names=("layers.2", "layers.3", "head")))
    path = _saved(tmp_path, _plan(config=ParallelConfig(pp=2, microbatch=1), stages=stages))
    err = refused(["--plan", path, "--model", "tiny-gpt", "--steps", "2"], capsys)
    assert "must hold ['layers.0', 'layers.1', 'layers.2', 'layers.3'] in order" in err


def test_schedule_with_fewer_microbatches_than_stages(capsys) -> None:
    argv = ["--model", "tiny-gpt", "--global-batch", "2", "--seq-len", "16", "--steps", "2", "--pp", "2",
            "--microbatch", "2", "--nproc-per-node", "2"]
    assert "1f1b needs at least pp=2 microbatches per step, got 1" in refused(argv, capsys)


def test_token_ids_beyond_the_models_vocabulary(tmp_path: Path, capsys) -> None:
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(1000, dtype=np.int32))  # tiny-gpt's vocabulary is 128
    err = refused(["--model", "tiny-gpt", *JOB, "--dp", "1", "--data", str(tokens)], capsys)
    assert "token ids in [0, 999] but the model's vocabulary is 128" in err


def test_tp_that_does_not_divide_the_model(capsys) -> None:
    err = refused(["--model", "tiny-gpt", *JOB, "--tp", "3", "--nproc-per-node", "3"], capsys)
    assert "tp=3 does not divide the attention heads (4)" in err


def test_llama3_8b_does_not_fit_this_host(capsys) -> None:
    err = refused(["--model", "llama3-8b", *JOB], capsys)
    assert "GiB per rank" in err and "8.03 B parameters" in err and "of RAM for 1 rank" in err


def test_plan_whose_predicted_memory_does_not_fit(tmp_path: Path, capsys, monkeypatch) -> None:
    from autoplan.execute import preflight

    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: 2 * 2**30)  # 2 GiB for 2 ranks
    path = _saved(tmp_path, _plan(memory=3 * 2**30))
    err = refused(["--plan", path, "--model", "tiny-gpt", "--steps", "2"], capsys)
    assert "3.0 GiB per rank (the plan's predicted peak on local-cpu" in err and "1.0 GiB each" in err


def test_part_of_a_model_the_executor_cannot_parallelise(capsys) -> None:
    err = refused(["--model", BLOCK_MODEL, *JOB, "--cp", "2"], capsys)
    assert "cp=2: context parallelism" in err and "block_lm computes them in its own forward" in err


def test_checks_pass_for_a_good_run_and_only_then_launch(capsys) -> None:
    with pytest.raises(AssertionError, match="torchrun was launched"):
        main(["run", "--model", "tiny-gpt", *JOB, "--dp", "2", "--nproc-per-node", "2"])
