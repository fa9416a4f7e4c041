"""A user's model that cannot be loaded is one line, in `autoplan plan` and in the Python API: a file with a
syntax error, a factory that raises or returns something other than an nn.Module, a model that is None."""

from __future__ import annotations

from pathlib import Path

import pytest

import autoplan
from autoplan.cli.main import main

PLAN = ["--cluster", "local-cpu", "--seq-len", "16", "--global-batch", "8", "--quiet"]


@pytest.mark.parametrize("source, message", [
    ("def build(:\n    pass\n", "has a syntax error at line 1"),
    ("def build():\n    return {'layers': 4}\n", "build() returned dict, not an nn.Module"),
    ("def build():\n    raise RuntimeError('no GPU here')\n", "build() raised RuntimeError: no GPU here"),
    ("import not_a_module_anywhere\n", "failed: ModuleNotFoundError: No module named 'not_a_module_anywhere'"),
    ("build = 3\n", "has no callable 'build'"),
])
def test_plan_with_a_broken_model_file_is_one_line(tmp_path: Path, capsys, source: str, message: str) -> None:
    path = tmp_path / "mine.py"
    path.write_text(source)
    assert main(["plan", "--model", f"{path}:build", *PLAN]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoplan: error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("model", [None, 3, object()])
def test_autoplan_of_something_that_is_not_a_model(model: object) -> None:
    with pytest.raises(ValueError, match="model must be a preset name, 'path/to/file.py:factory'"):
        autoplan.autoplan(model, "local-cpu", global_batch=8, seq_len=16)


def test_a_plan_carries_the_fingerprint_of_its_model() -> None:
    from autoplan.execute.source import meta_device
    from autoplan.graph.fingerprint import model_fingerprint
    from autoplan.models import preset

    plans = autoplan.autoplan("tiny-gpt", "local-cpu", global_batch=8, seq_len=16, top_k=2, use_ilp=False)
    with meta_device():
        expected = model_fingerprint(preset("tiny-gpt"))
    assert {p.fingerprint for p in plans} == {expected}
