"""The torchrun path. `autoplan run` with a rank killed mid-run exits non-zero within 60 s naming that
rank; then `autoplan.execute` resumes its last checkpoint under another plan (a saved Plan with an uneven
pipeline cut), continues the reference loss curve and writes the report next to the plan's prediction."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch
from harness import reference

import autoplan
from autoplan.plan.types import Breakdown, Estimate, ParallelConfig, Plan, Stage


def _autoplan_run(*flags: str, env: dict, cwd: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "autoplan.cli.main", "run", "--model", "tiny-gpt", "--global-batch", "8",
           "--seq-len", "16", "--nproc-per-node", "2", "--timeout-s", "30", *flags]
    return subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=120, cwd=cwd,
                          check=False)


def _uneven_pipeline_plan() -> Plan:
    estimate = Estimate(step_time_s=0.25, tokens_per_s=512.0, mfu=0.1, peak_mem_bytes=2**20,
                        mem_capacity_bytes=2**30, fits=True, breakdown=Breakdown(compute=0.25))
    stages = (Stage(index=0, layer_names=("embed", "layers.0")),
              Stage(index=1, layer_names=("layers.1", "layers.2", "layers.3", "norm", "head")))
    return Plan(config=ParallelConfig(pp=2, schedule="1f1b"), estimate=estimate, model_name="tiny-gpt",
                cluster_name="local-cpu", num_devices=2, global_batch=8, seq_len=16, stages=stages)


def test_killed_rank_is_named_and_its_checkpoint_resumes_under_another_plan(tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    start = time.monotonic()
    done = _autoplan_run("--steps", "20", "--dp", "2", "--save-every", "1", "--checkpoint-dir", ckpt,
                         env={"AUTOPLAN_TEST_KILL_RANK": "1", "AUTOPLAN_TEST_KILL_STEP": "2"}, cwd=str(tmp_path))
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("autoplan run: FAILED: rank 1 died: killed by signal SIGKILL"), last
    assert elapsed < 60, f"took {elapsed:.1f} s"

    report_path = tmp_path / "report.json"
    with open(os.devnull, "w") as quiet:
        report = autoplan.execute(_uneven_pipeline_plan(), "tiny-gpt", steps=4, resume=ckpt, report=report_path,
                                  out=quiet)
    assert report_path.exists() and report["start_step"] == 2
    torch.testing.assert_close(torch.tensor(report["losses"]),
                               torch.tensor(reference("tiny-gpt", steps=4)["losses"][2:]), rtol=1e-5, atol=1e-5)
    assert report["predicted_step_time_s"] == 0.25
    assert report["step_time_s"] > 0 and len(report["peak_mem_bytes_per_rank"]) == 2
    assert report["plan"]["pp"] == 2 and report["seed"] == 0
