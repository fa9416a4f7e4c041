"""The torchrun path: `autoplan run` with a rank killed mid-run exits non-zero within 60 s, naming that
rank; a hung rank is named, with its stack, once the process-group timeout fires.
(Resuming the killed run's last checkpoint under another plan: test_exec_checkpoint.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import autoplan
from autoplan.execute.launch import RunFailed
from autoplan.execute.worker import FAULT_ENV, KILL_RANK_ENV, KILL_STEP_ENV
from autoplan.plan.types import ParallelConfig


def test_killed_rank_ends_autoplan_run_with_its_name(tmp_path) -> None:
    cmd = [sys.executable, "-m", "autoplan.cli.main", "run", "--model", "tiny-gpt", "--global-batch", "8",
           "--seq-len", "16", "--nproc-per-node", "2", "--timeout-s", "30", "--steps", "20", "--dp", "2"]
    env = {**os.environ, KILL_RANK_ENV: "1", KILL_STEP_ENV: "2"}
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("autoplan run: FAILED: rank 1 died: killed by signal SIGKILL"), last
    assert "autoplan run: losses" not in done.stdout  # the job did not run to the end
    assert elapsed < 60, f"took {elapsed:.1f} s"


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
