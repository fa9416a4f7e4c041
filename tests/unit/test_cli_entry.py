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


def test_a_bare_key_error_is_a_bug_and_keeps_its_traceback(monkeypatch, capsys) -> None:
    """A KeyError that names only a key (a lookup that failed inside autoplan) is not reported as the user's
    mistake: main() re-raises it. One that says what is missing in a sentence stays one line, exit code 2."""
    import argparse

    import pytest

    from autoplan.cli import main as cli

    def parser_raising(exc: Exception):
        parser = argparse.ArgumentParser()
        parser.set_defaults(func=lambda args: (_ for _ in ()).throw(exc))
        return parser

    monkeypatch.setattr(cli, "build_parser", lambda: parser_raising(KeyError("etp")))
    with pytest.raises(KeyError):
        cli.main([])
    monkeypatch.setattr(cli, "build_parser", lambda: parser_raising(KeyError("no component 'vision': have []")))
    assert cli.main([]) == 2
    assert capsys.readouterr().err == "autoplan: error: no component 'vision': have []\n"
