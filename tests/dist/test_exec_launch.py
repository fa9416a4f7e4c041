"""The torchrun path: `autoplan run` with a rank killed mid-run exits non-zero within 60 s, naming that
rank. (Resuming the killed run's last checkpoint under another plan: test_exec_checkpoint.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from autoplan.execute.worker import KILL_RANK_ENV, KILL_STEP_ENV


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
