"""Engine.zero_stages: the ZeRO stages each engine runs, what the search enumerates under it, and the one-line
refusal of a stage the engine does not run (search, API, exact model, CLI), before any pricing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

import autoplan
from autoplan.cli.main import main
from autoplan.cost import estimate_config
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig
from autoplan.search import api
from autoplan.search.space import SearchOptions, engine_zero, enumerate_space

# hand-listed from each engine's code (the YAML comments): DeepSpeed's pipeline engine asserts stage < 2,
# Megatron-LM 2021-22 has only DDP, torchtitan 2024 runs DDP, FSDP2 without pp (3) or not resharded under pp (2)
EXPECTED = {"autoplan": (0, 1, 2, 3), "deepspeed": (0, 1, 2, 3), "deepspeed-2024": (0, 1, 2, 3),
            "megatron-core": (0, 1, 2, 3), "megatron-deepspeed": (0, 1), "megatron-lm": (0,), "torchtitan": (0, 2, 3)}


def test_each_shipped_engine_lists_the_stages_its_code_runs() -> None:
    assert {name: Engine.load(name).zero_stages for name in Engine.names()} == EXPECTED
    assert Engine().zero_stages == (0, 1, 2, 3)  # the default is autoplan's executor


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_search_space_holds_only_the_engines_stages(name: str) -> None:
    graph = gpt_graph(h=256, a=4, layers=4, seq=128, vocab=512)
    space = enumerate_space(graph, a100_cluster(2, per_node=4),
                            SearchOptions(global_batch=8, zero=engine_zero(None, Engine.load(name))))
    c = space.columns
    sharded = (c["dp"] * c["ep"] * c["cp"]) > 1
    assert set(c["zero"][sharded].tolist()) == set(EXPECTED[name])
    assert set(c["zero"][~sharded].tolist()) == {0}  # nothing data parallel: unsharded under every engine


def test_autoplan_ranks_only_plans_the_engine_runs() -> None:
    graph = gpt_graph(h=256, a=4, layers=4, seq=128, vocab=512)
    plans = autoplan.autoplan(graph, a100_cluster(1, per_node=4), global_batch=8, seq_len=128, top_k=3,
                              engine="megatron-deepspeed", use_ilp=False)
    assert {cand.config.zero for cand in plans.candidates["exact"]} <= {0, 1}
    assert all(p.config.zero in (0, 1) for p in plans)


def test_a_stage_the_engine_does_not_run_is_one_line_before_the_capture(monkeypatch) -> None:
    def no_capture(*args, **kwargs):
        raise AssertionError("captured the model before refusing the stage")

    monkeypatch.setattr(api, "model_graph", no_capture)
    cluster = a100_cluster(1, per_node=4)
    message = r"engine 'megatron-deepspeed' runs ZeRO stage\(s\) 0, 1 only \(its zero_stages\), not zero 3"
    with pytest.raises(ValueError, match=message) as err:
        autoplan.autoplan("tiny-llama", cluster, global_batch=8, seq_len=64, engine="megatron-deepspeed", zero=(1, 3))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=message):
        autoplan.estimate("tiny-llama", cluster, {"dp": 4, "zero": 3}, global_batch=8, seq_len=64,
                          engine="megatron-deepspeed")
    with pytest.raises(ValueError, match=r"engine 'megatron-lm' runs ZeRO stage\(s\) 0 only .* not zero 1"):
        autoplan.estimate("tiny-llama", cluster, {"dp": 4, "zero": 1}, global_batch=8, seq_len=64,
                          engine="megatron-lm")


def test_the_exact_model_refuses_it_too() -> None:
    graph = gpt_graph(h=256, a=4, layers=4, seq=128, vocab=512)
    cluster = a100_cluster(1, per_node=4)
    with pytest.raises(ValueError, match="'torchtitan' runs ZeRO stage"):
        estimate_config(graph, cluster, ParallelConfig(dp=4, zero=1), global_batch=8, engine=Engine.load("torchtitan"))
    ran = estimate_config(graph, cluster, ParallelConfig(dp=4, zero=2), global_batch=8, engine=Engine.load("torchtitan"))
    assert ran.step_time_s > 0


def test_the_cli_says_which_stages_the_engine_runs_exit_2(capsys) -> None:
    argv = ["plan", "--model", "gpt3-1.7b", "--cluster", "dgx-a100-80gb", "--nodes", "2", "--global-batch", "64",
            "--seq-len", "2048", "--engine", "megatron-deepspeed", "--zero", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == ("autoplan: error: engine 'megatron-deepspeed' runs ZeRO stage(s) 0, 1 only (its zero_stages), "
                   "not zero 3: use --zero / zero= among 0, 1, or an engine that runs stage 3\n")


@pytest.mark.parametrize("value, message", [
    ("0,1", "must be a YAML list of ZeRO stages among 0, 1, 2, 3 (e.g. [0, 1]), got '0,1'"),
    ("[0, 4]", "must be a YAML list of ZeRO stages among 0, 1, 2, 3"),
    ("[true]", "must be a YAML list of ZeRO stages among 0, 1, 2, 3"),
    ("[1, 3]", "must list distinct stages with 0 among them"),
    ("[0, 1, 1]", "must list distinct stages with 0 among them"),
])
def test_a_bad_zero_stages_value_is_one_line(tmp_path: Path, value: str, message: str) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(f"schema_version: 1\nname: mine\nzero_stages: {value}\n")
    with pytest.raises(ValueError, match="zero_stages") as err:
        Engine.load(path)
    assert message in str(err.value) and str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_zero_stages_come_back_from_json_as_a_sorted_tuple(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("schema_version: 1\nname: mine\nzero_stages: [3, 0]\n")
    e = Engine.load(path)
    assert e.zero_stages == (0, 3)
    data = e.to_dict()
    assert data["zero_stages"] == [0, 3]  # JSON-native, as a plan's JSON holds it
    assert Engine.from_dict(json.loads(json.dumps(data))) == e
