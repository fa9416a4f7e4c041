"""The console script's entry (autoplan.cli.main.entry) exits with main()'s code and prints what main printed."""

from __future__ import annotations

import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan.cli.main", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_an_error_is_one_line_and_exit_code_2() -> None:
    out = _run("plan", "--model", "no-such-model", "--cluster", "local-cpu", "--global-batch", "8", "--seq-len", "16")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and out.stderr.startswith("autoplan: error: unknown model")


def test_success_is_exit_code_0_with_the_output_flushed() -> None:
    out = _run("engines")
    assert out.returncode == 0 and "torchtitan" in out.stdout and out.stdout.endswith("\n")
