"""Engine.zero_stages_with_pp and Engine.schedules: what each engine runs with a pipeline (pp > 1), what the search
enumerates under it, and the one-line refusal of a stage or schedule it does not run, before any work."""

from __future__ import annotations

import dataclasses
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
from autoplan.search.space import SCHEDULES, SearchOptions, engine_search_options, enumerate_space

# hand-listed from each engine's code (the YAML comments): DeepSpeed's PipelineEngine asserts stage < 2 and runs
# its TrainSchedule (1F1B) only; torchtitan 2024 keeps FSDP2's weights gathered under pp (2, never 3) and runs
# torch.distributed.pipelining's schedules; Megatron (2021 and core_r0.8.0) has 1F1B and interleaved 1F1B
WITH_PP = {"autoplan": (0, 1, 2, 3), "deepspeed": (0, 1), "deepspeed-2024": (0, 1), "megatron-core": (0, 1, 2, 3),
           "megatron-deepspeed": (0, 1), "megatron-lm": (0,), "torchtitan": (0, 2)}
ALL = ("gpipe", "1f1b", "interleaved", "zb")
SCHEDULES_RUN = {"autoplan": ALL, "deepspeed": ("1f1b",), "deepspeed-2024": ("1f1b",),
                 "megatron-core": ("1f1b", "interleaved"), "megatron-deepspeed": ("1f1b",),
                 "megatron-lm": ("1f1b", "interleaved"), "torchtitan": ALL}
GRAPH = gpt_graph(h=256, a=4, layers=4, seq=128, vocab=512)


def test_each_shipped_engine_lists_what_its_pipeline_runs() -> None:
    engines = {name: Engine.load(name) for name in Engine.names()}
    assert {name: e.zero_stages_at(2) for name, e in engines.items()} == WITH_PP
    assert {name: e.schedules for name, e in engines.items()} == SCHEDULES_RUN
    default = Engine()  # autoplan's executor: every stage with a pipeline too, every schedule
    assert default.zero_stages_with_pp is None and default.zero_stages_at(8) == (0, 1, 2, 3)
    assert default.schedules == ALL == tuple(s.value for s in SCHEDULES)


def test_runs_zero_depends_on_the_pipeline_degree() -> None:
    titan = Engine.load("torchtitan")
    assert titan.runs_zero(3, pp=1) and not titan.runs_zero(3, pp=2) and titan.runs_zero(2, pp=16)
    assert not titan.runs_zero(1, pp=1) and not titan.runs_zero(True, pp=1)  # a bool is no stage
    # an override of zero_stages alone (bench/data/published megascale: Megatron's distributed optimizer) reaches
    # the pipeline too where the engine's pipeline adds no restriction (zero_stages_with_pp null)
    megascale = dataclasses.replace(Engine.load("megatron-lm"), zero_stages=(0, 1))
    assert megascale.runs_zero(1, pp=8)


def _fixed(name: str, pp: int, dp: int) -> dict[str, int]:
    """The zero and schedule column counts of the rows of one fixed mesh (tp 1, one microbatch size, one
    recompute mode, no SP) under engine `name`, through the options the API builds."""
    opts = engine_search_options({"tp": (1,), "pp": (pp,), "dp": (dp,), "microbatch": (1,), "recompute": ("none",),
                                  "sp": (False,)}, Engine.load(name))
    space = enumerate_space(GRAPH, a100_cluster(1, per_node=4), SearchOptions(global_batch=8, **opts))
    c = space.columns
    return {"rows": len(space), "zero": sorted(set(c["zero"].tolist())),
            "schedules": sorted({SCHEDULES[s].value for s in c["schedule"].tolist()})}


# pp=2 over 4 blocks, 4 microbatches of 1: gpipe, 1f1b, interleaved v=2, zb v=1 and v=2 (5 schedule choices,
# every one accepting m=4); x the ZeRO stages. pp=1: 1F1B stands for every schedule, x zero_stages. torchtitan
# runs zero 0 (DDP) only as the only dimension (zero0_1d_only: test_engine_zero0_1d.py): with pp=2 beside dp=2, 2 alone
@pytest.mark.parametrize("name, rows_pp2, rows_pp1", [
    ("autoplan", 5 * 4, 4), ("torchtitan", 5 * 1, 3), ("megatron-lm", 2 * 1, 1), ("megatron-core", 2 * 4, 4),
    ("deepspeed", 1 * 2, 4), ("megatron-deepspeed", 1 * 2, 2),
])
def test_the_enumeration_drops_exactly_the_combinations_the_engine_does_not_run(name, rows_pp2, rows_pp1) -> None:
    pipelined, flat = _fixed(name, pp=2, dp=2), _fixed(name, pp=1, dp=4)
    assert pipelined["rows"] == rows_pp2 and flat["rows"] == rows_pp1
    assert pipelined["zero"] == [z for z in WITH_PP[name] if z or name != "torchtitan"]
    assert pipelined["schedules"] == sorted(SCHEDULES_RUN[name])
    assert flat["zero"] == list(Engine.load(name).zero_stages)


def test_torchtitan_candidates_with_a_pipeline_hold_no_zero_3() -> None:
    opts = engine_search_options({}, Engine.load("torchtitan"))
    c = enumerate_space(GRAPH, a100_cluster(2, per_node=4), SearchOptions(global_batch=8, **opts)).columns
    piped, sharded = c["pp"] > 1, (c["dp"] * c["ep"] * c["cp"]) > 1
    assert set(c["zero"][piped & sharded].tolist()) == {2}  # and no zero 0 (DDP) beside the pipeline: zero0_1d_only
    assert set(c["zero"][~piped & sharded].tolist()) == {0, 2, 3}  # without a pipeline FSDP2 reshards: 3 runs


def test_megatron_lm_plans_use_only_its_schedules() -> None:
    plans = autoplan.autoplan(GRAPH, a100_cluster(1, per_node=4), global_batch=8, seq_len=128, top_k=3,
                              engine="megatron-lm", use_ilp=False)
    piped = [cand.config for cand in plans.candidates["exact"] if cand.config.pp > 1]
    assert piped and {c.schedule.value for c in piped} <= {"1f1b", "interleaved"}


def _no_capture(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("captured the model before refusing")

    monkeypatch.setattr(api, "model_graph", refuse)


SCHEDULE_LINE = ("engine 'megatron-lm' runs pipeline schedule(s) 1f1b, interleaved only (its schedules), not 'zb': "
                 "use --schedule / --schedules / schedules= among 1f1b, interleaved, or an engine that runs 'zb'")
ZERO_LINE = ("engine 'torchtitan' runs ZeRO stage(s) 0, 2 only with a pipeline (pp > 1: its zero_stages_with_pp), "
             "not zero 3: use --zero / zero= among 0, 2, or pp=1, or an engine that runs stage 3 with a pipeline")


def test_a_forced_schedule_or_stage_is_one_line_before_the_capture(monkeypatch) -> None:
    _no_capture(monkeypatch)
    cluster = a100_cluster(1, per_node=4)
    for call in (lambda: autoplan.autoplan("tiny-llama", cluster, global_batch=8, seq_len=64, engine="megatron-lm",
                                           schedules=("1f1b", "zb")),
                 lambda: autoplan.estimate("tiny-llama", cluster, {"pp": 2, "dp": 2, "schedule": "zb"},
                                           global_batch=8, seq_len=64, engine="megatron-lm")):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == SCHEDULE_LINE
    for call in (lambda: autoplan.autoplan("tiny-llama", cluster, global_batch=8, seq_len=64, engine="torchtitan",
                                           pp=(2, 4), zero=3),
                 lambda: autoplan.estimate("tiny-llama", cluster, {"pp": 2, "dp": 2, "zero": 3}, global_batch=8,
                                           seq_len=64, engine="torchtitan")):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == ZERO_LINE


def test_zero_3_with_the_pipeline_degree_free_is_searched_without_a_pipeline() -> None:
    opts = engine_search_options({"zero": (0, 3)}, Engine.load("torchtitan"))
    assert opts["zero"] == (0, 3) and opts["zero_with_pp"] == (0,)


def test_the_exact_model_refuses_them_and_a_flat_config_runs_no_schedule() -> None:
    cluster, lm = a100_cluster(1, per_node=4), Engine.load("megatron-lm")
    with pytest.raises(ValueError, match="its schedules"):
        estimate_config(GRAPH, cluster, ParallelConfig(pp=2, dp=2, schedule="gpipe"), global_batch=8, engine=lm)
    with pytest.raises(ValueError, match="its zero_stages_with_pp"):
        estimate_config(GRAPH, cluster, ParallelConfig(pp=2, dp=2, zero=3), global_batch=8,
                        engine=Engine.load("torchtitan"))
    # pp = 1: Megatron's forward_backward_no_pipelining whatever the schedule field says: priced as 1F1B
    flat = estimate_config(GRAPH, cluster, ParallelConfig(dp=4, schedule="zb"), global_batch=8, engine=lm)
    assert flat.step_time_s == estimate_config(GRAPH, cluster, ParallelConfig(dp=4), global_batch=8,
                                               engine=lm).step_time_s


def test_the_cli_refuses_a_schedule_the_engine_lacks_exit_2(capsys) -> None:
    job = ["--model", "gpt3-1.7b", "--cluster", "dgx-a100-80gb", "--global-batch", "64", "--seq-len", "2048",
           "--engine", "megatron-lm"]
    assert main(["estimate", *job, "--pp", "2", "--schedule", "zb"]) == 2
    assert capsys.readouterr().err == f"autoplan: error: {SCHEDULE_LINE}\n"
    assert main(["plan", *job, "--schedules", "zb"]) == 2
    assert capsys.readouterr().err == f"autoplan: error: {SCHEDULE_LINE}\n"


def test_autoplan_engines_shows_the_pipeline_columns(capsys) -> None:
    assert main(["engines"]) == 0
    rows = {line.split()[0]: line.split()[:5] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["torchtitan"] == ["torchtitan", "flash", "0,2,3", "0,2", "gpipe,1f1b,interleaved,zb"]
    assert rows["megatron-lm"] == ["megatron-lm", "unfused", "0", "0", "1f1b,interleaved"]
    assert rows["deepspeed"][2:] == ["0,1,2,3", "0,1", "1f1b"]


def test_autoplan_engines_shows_zero0_1d_only(capsys) -> None:
    # torchtitan alone refuses DDP beside another dimension (engines/torchtitan.yaml's zero0_1d_only)
    assert main(["engines"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-4:] == ["zero", "0", "alone", "description"]
    alone = {line.split()[0]: line.split()[8] for line in lines[1:]}
    assert alone == {name: "true" if name == "torchtitan" else "false" for name in Engine.names()}


@pytest.mark.parametrize("text, message", [
    ("schedules: 1f1b", "field 'schedules' must be a YAML list of pipeline schedules"),
    ("schedules: []", "field 'schedules' must be a YAML list of pipeline schedules"),
    ("schedules: [1f1b, zbv]", "unknown pipeline schedule 'zbv'"),
    ("zero_stages_with_pp: 0,1", "must be a YAML list of ZeRO stages among 0, 1, 2, 3 (e.g. [0, 1], or null"),
    ("zero_stages_with_pp: [1]", "must list distinct stages with 0 among them"),
    ("zero_stages: [0, 2]\nzero_stages_with_pp: [0, 3]", "lists stage(s) [3] that zero_stages [0, 2] does not"),
])
def test_a_bad_pipeline_field_is_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(f"schema_version: 1\nname: mine\n{text}\n")
    with pytest.raises(ValueError) as err:
        Engine.load(path)
    assert message in str(err.value) and str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_the_pipeline_fields_come_back_from_json(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("schema_version: 1\nname: mine\nzero_stages_with_pp: [1, 0]\nschedules: [interleaved, 1f1b]\n")
    e = Engine.load(path)
    assert e.zero_stages_with_pp == (0, 1) and e.schedules == ("1f1b", "interleaved")  # Schedule's order
    data = e.to_dict()
    assert data["zero_stages_with_pp"] == [0, 1] and data["schedules"] == ["1f1b", "interleaved"]
    assert Engine.from_dict(json.loads(json.dumps(data))) == e
    assert Engine.from_dict(json.loads(json.dumps(Engine().to_dict()))).zero_stages_with_pp is None


def test_search_options_keep_the_pipelined_stages_among_zero() -> None:
    with pytest.raises(ValueError, match=r"zero_with_pp \[0, 3\] must be among zero \[0, 1\]"):
        SearchOptions(global_batch=8, zero=(0, 1), zero_with_pp=(0, 3))


def _titan_plan_json() -> dict:
    from autoplan.plan import io

    plans = autoplan.autoplan(GRAPH, a100_cluster(1, per_node=4), global_batch=8, seq_len=128, top_k=1,
                              engine="torchtitan", use_ilp=False)
    return json.loads(io.plan_to_json(plans[0]))


def test_a_plan_json_keeps_the_pipeline_fields_and_an_older_one_loads_without_them() -> None:
    """A plan's engine carries zero_stages_with_pp and schedules through its JSON; a plan written before they
    existed (its engine mapping without the two keys) still loads, its engine then the Engine defaults' (every
    stage with a pipeline, every schedule: what the search it came from assumed), every other field kept."""
    from autoplan.plan import io

    data = _titan_plan_json()
    titan = Engine.load("torchtitan")
    assert data["engine"]["zero_stages_with_pp"] == [0, 2] and data["engine"]["schedules"] == list(ALL)
    assert io.plan_from_dict(data).engine == titan
    for key in ("zero_stages_with_pp", "schedules"):
        del data["engine"][key]
    old = io.plan_from_dict(data).engine
    assert old.zero_stages_with_pp is None and old.schedules == ALL and old.runs_zero(3, pp=2)
    assert old == dataclasses.replace(titan, zero_stages_with_pp=None, schedules=ALL)


def test_the_zero_with_pp_flag_reaches_the_search_and_is_checked_against_the_engine(capsys) -> None:
    """--zero-with-pp is parsed as a list of stages into SearchOptions.zero_with_pp (the pipelined candidates
    then hold only those stages); a stage the engine does not run with a pipeline is one line, exit 2."""
    from autoplan.cli.main import build_parser
    from autoplan.cli.plan import search_options

    job = ["--model", "gpt3-1.7b", "--cluster", "dgx-a100-80gb", "--global-batch", "64", "--seq-len", "2048",
           "--engine", "torchtitan"]
    given = search_options(build_parser().parse_args(["plan", *job, "--zero-with-pp", "2"]))
    assert given["zero_with_pp"] == (2,) and "zero" not in given
    opts = engine_search_options({"zero_with_pp": given["zero_with_pp"]}, Engine.load("torchtitan"))
    c = enumerate_space(GRAPH, a100_cluster(2, per_node=4), SearchOptions(global_batch=8, **opts)).columns
    sharded = (c["dp"] * c["ep"] * c["cp"]) > 1
    alone = (c["tp"] == 1) & (c["pp"] == 1) & (c["cp"] == 1) & (c["ep"] == 1)
    assert set(c["zero"][(c["pp"] > 1) & sharded].tolist()) == {2}
    # zero 0 beside no other dimension only (torchtitan's zero0_1d_only: DDP refuses > 1-D meshes)
    assert set(c["zero"][(c["pp"] == 1) & sharded & alone].tolist()) == {0, 2, 3}
    assert set(c["zero"][(c["pp"] == 1) & sharded & ~alone].tolist()) == {2, 3}
    assert main(["plan", *job, "--zero-with-pp", "0,3"]) == 2
    assert capsys.readouterr().err == (
        "autoplan: error: engine 'torchtitan' runs ZeRO stage(s) 0, 2 only with a pipeline (pp > 1: its "
        "zero_stages_with_pp), not zero_with_pp 3: use --zero-with-pp / zero_with_pp= among 0, 2\n")
    assert main(["plan", *job, "--zero-with-pp", "5"]) == 2  # no stage at all: named as the option it is
    assert capsys.readouterr().err == "autoplan: error: zero_with_pp must be ZeRO stages among 0, 1, 2, 3, got 5\n"


def test_a_forced_schedule_is_not_refused_where_no_pipeline_runs() -> None:
    """pp = 1 runs no schedule (Engine.check_schedule passes any schedule at pp = 1): a search fixed to pp 1 is
    not refused for the schedules it was given, whichever the engine runs; with pp 1 or 2 allowed it is."""
    lm = Engine.load("megatron-lm")
    opts = engine_search_options({"pp": (1,), "schedules": ("zb",)}, lm)
    assert opts["schedules"] == ("zb",)
    c = enumerate_space(GRAPH, a100_cluster(1, per_node=4), SearchOptions(global_batch=8, **opts)).columns
    assert set(c["pp"].tolist()) == {1} and len(c["pp"]) > 0
    with pytest.raises(ValueError) as err:
        engine_search_options({"pp": (1, 2), "schedules": ("zb",)}, lm)
    assert str(err.value) == SCHEDULE_LINE


def test_the_loader_reads_schedules_by_the_engines_rule(tmp_path: Path) -> None:
    # one rule (plan.engine.is_schedule): a name in any case is a schedule, in YAML as in Engine(...)
    path = tmp_path / "mine.yaml"
    path.write_text("schema_version: 1\nname: mine\nschedules: [Interleaved, 1F1B]\n")
    assert Engine.load(path).schedules == Engine(schedules=("Interleaved", "1F1B")).schedules == ("1f1b", "interleaved")
    path.write_text("schema_version: 1\nname: mine\nschedules: [1f1b, 1F1B]\n")
    with pytest.raises(ValueError, match="must be a list of distinct pipeline schedules") as err:
        Engine.load(path)
    assert str(err.value).startswith(str(path))


def test_zero_with_pp_is_not_refused_where_no_pipeline_runs(capsys) -> None:
    """zero_with_pp only applies where pp > 1: a search fixed to pp 1 is not refused for a stage the engine
    runs without a pipeline only (torchtitan's 3), as a forced schedule is not; with pp 1 or 2 allowed it is."""
    titan = Engine.load("torchtitan")
    opts = engine_search_options({"pp": 1, "zero_with_pp": 3}, titan)
    assert opts["zero_with_pp"] == (3,) and opts["zero"] == (0, 2, 3)
    c = enumerate_space(GRAPH, a100_cluster(2, per_node=4), SearchOptions(global_batch=8, **opts)).columns
    assert set(c["pp"].tolist()) == {1} and set(c["zero"][(c["dp"] * c["ep"] * c["cp"]) > 1].tolist()) == {0, 2, 3}
    with pytest.raises(ValueError, match="not zero_with_pp 3: use --zero-with-pp / zero_with_pp= among 0, 2"):
        engine_search_options({"pp": (1, 2), "zero_with_pp": 3}, titan)
    job = ["--model", "gpt3-1.7b", "--cluster", "dgx-a100-80gb", "--global-batch", "64", "--seq-len", "2048",
           "--engine", "torchtitan", "--zero-with-pp", "3"]
    assert main(["plan", *job, "--pp", "1,2"]) == 2
    assert "not zero_with_pp 3" in capsys.readouterr().err
