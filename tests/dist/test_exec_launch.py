"""The torchrun path: `autoplan run` with a rank killed mid-run exits non-zero within 60 s, naming that
rank, and `autoplan.execute` resumes its last checkpoint under another plan; a hung rank is named, with
its stack, once the process-group timeout fires."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from harness import reference

import autoplan
from autoplan.execute.launch import RunFailed
from autoplan.execute.worker import FAULT_ENV, KILL_RANK_ENV, KILL_STEP_ENV
from autoplan.plan.types import Breakdown, Estimate, ParallelConfig, Plan, Stage


def _uneven_pipeline_plan() -> Plan:
    estimate = Estimate(step_time_s=0.25, tokens_per_s=512.0, mfu=0.1, peak_mem_bytes=2**20,
                        mem_capacity_bytes=2**30, fits=True, breakdown=Breakdown(compute=0.25))
    stages = (Stage(index=0, layer_names=("embed", "layers.0")),
              Stage(index=1, layer_names=("layers.1", "layers.2", "layers.3", "norm", "head")))
    return Plan(config=ParallelConfig(pp=2, schedule="1f1b"), estimate=estimate, model_name="tiny-gpt",
                cluster_name="local-cpu", num_devices=2, global_batch=8, seq_len=16, stages=stages)


def test_killed_rank_is_named_and_its_last_checkpoint_resumes_under_another_plan(tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    cmd = [sys.executable, "-m", "autoplan.cli.main", "run", "--model", "tiny-gpt", "--global-batch", "8",
           "--seq-len", "16", "--nproc-per-node", "2", "--timeout-s", "30", "--steps", "20", "--dp", "2",
           "--save-every", "1", "--checkpoint-dir", ckpt]
    env = {**os.environ, KILL_RANK_ENV: "1", KILL_STEP_ENV: "2"}
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("autoplan run: FAILED: rank 1 died: killed by signal SIGKILL"), last
    assert "autoplan run: losses" not in done.stdout  # the job did not run to the end
    assert elapsed < 60, f"took {elapsed:.1f} s"

    # the step-2 checkpoint of the dp2 run resumes under a saved Plan with an uneven pipeline cut:
    # steps 2 and 3 continue the uninterrupted reference, and the report carries the plan's prediction
    report_path = tmp_path / "report.json"
    with open(os.devnull, "w") as quiet:
        report = autoplan.execute(_uneven_pipeline_plan(), "tiny-gpt", steps=4, resume=ckpt, report=report_path,
                                  out=quiet)
    assert report_path.exists() and report["start_step"] == 2
    torch.testing.assert_close(torch.tensor(report["losses"]),
                               torch.tensor(reference("tiny-gpt", steps=4)["losses"][2:]), rtol=1e-5, atol=1e-5)
    assert report["predicted_step_time_s"] == 0.25 and len(report["peak_mem_bytes_per_rank"]) == 2


def test_hung_rank_is_named_with_its_stack_after_the_timeout() -> None:
    env = {KILL_RANK_ENV: "1", KILL_STEP_ENV: "1", FAULT_ENV: "hang"}
    start = time.monotonic()
    with open(os.devnull, "w") as quiet, pytest.raises(RunFailed) as failure:
        autoplan.execute(ParallelConfig(pp=2), "tiny-gpt", steps=3, global_batch=8, seq_len=16, timeout_s=10,
                         env=env, out=quiet)
    elapsed = time.monotonic() - start
    message = str(failure.value)
    assert failure.value.rank == 1 and message.startswith("rank 1 hung: it reported no error"), message[:500]
    assert "Timed out" in message and "in hook" in message  # the peer's timeout, then rank 1's own stack
    assert elapsed < 60, f"took {elapsed:.1f} s"
