"""The plan / estimate / models / clusters commands, in-process: output, and exit code 2 on bad input."""

from __future__ import annotations

import pytest

from autoplan.cli.main import main
from autoplan.cluster.load import Cluster
from autoplan.models import PRESETS

JOB = ["--model", "tiny-llama", "--cluster", "local-cpu", "--seq-len", "64"]


@pytest.mark.parametrize("argv, message", [
    (["estimate", *JOB, "--global-batch", "16", "--tp", "3"], "8 devices do not divide by tp*pp*cp*ep=3"),
    (["estimate", *JOB, "--global-batch", "10", "--pp", "2"], "global batch 10 does not divide"),
    (["estimate", *JOB, "--global-batch", "16", "--schedule", "pipedream"], "unknown schedule 'pipedream'"),
    (["estimate", *JOB, "--global-batch", "16", "--recompute", "half"], "unknown recompute mode 'half'"),
    (["estimate", *JOB, "--global-batch", "16", "--nodes", "2", "--tp", "16"], "tp=16 is larger than a node of 8"),
    (["plan", *JOB, "--global-batch", "0"], "--global-batch must be a positive integer, got 0"),
    (["plan", "--model", "gpt5", "--cluster", "local-cpu", "--seq-len", "64", "--global-batch", "8"],
     "unknown model 'gpt5'"),
    (["plan", "--model", "nofile.py:make", "--cluster", "local-cpu", "--seq-len", "64", "--global-batch", "8"],
     "model file 'nofile.py' not found"),
])
def test_bad_input_exits_2_with_one_line(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoplan: error: ") and message in err and err.count("\n") == 1


def test_models_and_clusters_list_everything(capsys) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PRESETS)
    assert main(["clusters"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in Cluster.names())


def test_user_model_file_and_estimate_breakdown(tmp_path, capsys) -> None:
    src = tmp_path / "mine.py"
    src.write_text("from autoplan.models import preset\n\ndef make():\n    return preset('tiny-gpt')\n")
    argv = ["estimate", "--model", f"{src}:make", "--cluster", "local-cpu", "--seq-len", "64",
            "--global-batch", "16", "--tp", "2", "--pp", "2", "--sp", "--zero", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tp=2, pp=2, dp=2" in out and "sp=True" in out and "zero=1" in out
    for cause in ("compute", "tp_comm", "pp_bubble", "weights", "activations"):
        assert cause in out


def test_plan_writes_the_best_plan_as_json(tmp_path, capsys) -> None:
    from autoplan.cost import estimate_config
    from autoplan.plan import load_plan
    from autoplan.search.api import model_graph

    out = tmp_path / "best.json"
    assert main(["plan", *JOB, "--global-batch", "16", "--top-k", "2", "--quiet", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = load_plan(out)
    assert plan.rank == 1 and "Plan #1 for tiny-llama" in printed and f"{plan.estimate.step_time_s:.3f}" in printed
    assert plan.estimate.fits and plan.num_devices == 8
    # the cost model, given the plan's own layout, predicts what the JSON says
    again = estimate_config(model_graph("tiny-llama", 64), Cluster.load("local-cpu"), plan.config, global_batch=16,
                            stages=tuple(s.layer_names for s in plan.stages),
                            layer_recompute=dict(plan.layer_recompute) or None)
    assert again == plan.estimate
