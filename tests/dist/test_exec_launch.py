"""The torchrun path: `autoplan.execute` with a saved plan reproduces the reference and writes the report;
`autoplan run` with a rank killed mid-run exits non-zero within 60 s, naming that rank."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch
from harness import reference

import autoplan
from autoplan.plan.types import Breakdown, Estimate, ParallelConfig, Plan, Stage


def test_execute_a_plan_with_an_uneven_pipeline_cut(tmp_path) -> None:
    estimate = Estimate(step_time_s=0.25, tokens_per_s=512.0, mfu=0.1, peak_mem_bytes=2**20,
                        mem_capacity_bytes=2**30, fits=True, breakdown=Breakdown(compute=0.25))
    stages = (Stage(index=0, layer_names=("embed", "layers.0")),
              Stage(index=1, layer_names=("layers.1", "layers.2", "layers.3", "norm", "head")))
    plan = Plan(config=ParallelConfig(pp=2, schedule="1f1b"), estimate=estimate, model_name="tiny-gpt",
                cluster_name="local-cpu", num_devices=2, global_batch=8, seq_len=16, stages=stages)
    report_path = tmp_path / "report.json"
    report = autoplan.execute(plan, "tiny-gpt", steps=3, report=report_path, out=open(os.devnull, "w"))
    assert report_path.exists()
    torch.testing.assert_close(torch.tensor(report["losses"]), torch.tensor(reference("tiny-gpt", steps=3)["losses"]),
                               rtol=1e-5, atol=1e-5)
    assert report["predicted_step_time_s"] == 0.25
    assert report["step_time_s"] > 0 and len(report["peak_mem_bytes_per_rank"]) == 2
    assert report["plan"]["pp"] == 2 and report["seed"] == 0


def test_killed_rank_ends_the_run_with_its_name(tmp_path) -> None:
    env = {**os.environ, "AUTOPLAN_TEST_KILL_RANK": "1", "AUTOPLAN_TEST_KILL_STEP": "1"}
    cmd = [sys.executable, "-m", "autoplan.cli.main", "run", "--model", "tiny-gpt", "--steps", "20", "--dp", "2",
           "--nproc-per-node", "2", "--global-batch", "8", "--seq-len", "16", "--timeout-s", "30"]
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("autoplan run: FAILED: rank 1 died: killed by signal SIGKILL"), last
    assert elapsed < 60, f"took {elapsed:.1f} s"
