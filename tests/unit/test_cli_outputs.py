"""`autoplan plan` outputs and flags: --version, one flag per SearchOptions field, --json with every ranked
plan (still read as the best plan by `autoplan run --plan`), --csv, --pareto, --export; bad values are
one line before any search."""

from __future__ import annotations

import csv
import dataclasses
import io
from pathlib import Path

import pytest

import autoplan
from autoplan.cli.main import build_parser, main
from autoplan.cli.plan import SEARCH_FLAGS, search_options
from autoplan.plan.export import export_plan
from autoplan.plan.io import load_plan, load_plans
from autoplan.plan.types import Recompute, Schedule
from autoplan.search.space import SearchOptions

JOB = ["--model", "tiny-llama", "--cluster", "local-cpu", "--seq-len", "64", "--global-batch", "16"]


def _plan_parser():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["plan"]


def test_version_is_the_package_version(capsys) -> None:
    tomllib = pytest.importorskip("tomllib")
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert capsys.readouterr().out == f"autoplan {autoplan.__version__}\n" == f"autoplan {project['version']}\n"


def test_one_plan_flag_per_search_option() -> None:
    assert set(SEARCH_FLAGS) == {f.name for f in dataclasses.fields(SearchOptions)}
    by_flag = {flag: a.dest for a in _plan_parser()._actions for flag in a.option_strings}
    assert {name: by_flag.get(flag) for name, flag in SEARCH_FLAGS.items()} == {n: n for n in SEARCH_FLAGS}


def test_flags_give_the_search_options_the_api_takes() -> None:
    args = _plan_parser().parse_args([*JOB, "--top-k", "3", "--tp", "2,4", "--pp", "2", "--dp", "1,2", "--cp", "1",
                                      "--ep", "1", "--microbatch", "1,2", "--zero", "1", "--sp", "on",
                                      "--schedules", "1f1b,interleaved", "--recompute", "none,full",
                                      "--max-virtual-stages", "4", "--max-tp", "4", "--no-ilp", "--quiet"])
    got = SearchOptions(**search_options(args))
    assert got == SearchOptions(global_batch=16, top_k=3, tp=(2, 4), pp=(2,), dp=(1, 2), cp=(1,), ep=(1,),
                                microbatch=(1, 2), zero=(1,), sp=(True,),
                                schedules=(Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED),
                                recompute=(Recompute.NONE, Recompute.FULL), max_virtual_stages=4, max_tp=4,
                                use_ilp=False, progress=False)
    defaults = SearchOptions(**search_options(_plan_parser().parse_args(JOB)))
    assert defaults == SearchOptions(global_batch=16, progress=True)


@pytest.mark.parametrize("extra, message", [
    (["--tp", "2,x"], "--tp takes a comma list, got '2,x' (bad item 'x')"),
    (["--zero", "5"], "zero must be 0, 1, 2 or 3, got 5"),
    (["--sp", "maybe"], "--sp takes a comma list, got 'maybe'"),
    (["--schedules", "pipedream"], "unknown schedule 'pipedream'"),
    (["--max-tp", "0"], "--max-tp must be a positive integer, got 0"),
    (["--export", "nemo", "x.sh"], "--export: unknown engine 'nemo': choose one of megatron, torchtitan, deepspeed"),
    (["--pareto", "plot.jpg"], "--pareto writes a PNG: give a FILE.png, got 'plot.jpg'"),
])
def test_bad_plan_flags_are_one_line_before_searching(extra, message, capsys) -> None:
    assert main(["plan", *JOB, "--quiet", *extra]) == 2
    err = capsys.readouterr().err
    assert err == f"autoplan: error: {err.removeprefix('autoplan: error: ')}" and message in err
    assert err.count("\n") == 1


def test_max_tp_limits_the_mesh() -> None:
    from autoplan.cluster.load import Cluster
    from autoplan.search.api import model_graph
    from autoplan.search.space import mesh_shapes

    graph, cluster = model_graph("tiny-llama", 64), Cluster.load("local-cpu")
    every = mesh_shapes(graph, cluster, SearchOptions(global_batch=16))
    limited = mesh_shapes(graph, cluster, SearchOptions(global_batch=16, max_tp=2))
    assert {m[0] for m in every} == {1, 2, 4} and limited == tuple(m for m in every if m[0] <= 2)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """One `autoplan plan` run writing every output."""
    d = tmp_path_factory.mktemp("plan")
    files = {k: d / name for k, name in (("json", "p.json"), ("csv", "p.csv"), ("png", "p.png"),
                                         ("megatron", "m.sh"), ("torchtitan", "t.toml"), ("deepspeed", "d.json"))}
    capture = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(capture):
        code = main(["plan", *JOB, "--top-k", "3", "--quiet", "--json", str(files["json"]), "--csv", str(files["csv"]),
                     "--pareto", str(files["png"]), *(x for e in ("megatron", "torchtitan", "deepspeed")
                                                      for x in ("--export", e, str(files[e])))])
    assert code == 0
    return files, capture.getvalue()


def test_json_holds_every_ranked_plan_and_reads_as_the_best(outputs) -> None:
    from autoplan.execute.launch import read_plan

    files, printed = outputs
    plans = load_plans(files["json"])
    assert [p.rank for p in plans] == [1, 2, 3] and load_plan(files["json"]) == plans[0]
    assert read_plan(files["json"])[0] == plans[0]  # what `autoplan run --plan FILE` trains
    times = [p.estimate.step_time_s for p in plans]
    assert times == sorted(times) and f"{times[0]:.3f}" in printed and "3 ranked plans written" in printed


def test_csv_rows_are_the_ranked_plans(outputs) -> None:
    files, _ = outputs
    plans = load_plans(files["json"])
    rows = list(csv.DictReader(files["csv"].read_text().splitlines()))
    assert len(rows) == len(plans)
    for row, p in zip(rows, plans):
        assert int(row["rank"]) == p.rank and int(row["tp"]) == p.config.tp and int(row["pp"]) == p.config.pp
        assert row["schedule"] == p.config.schedule.value and row["recompute"] == p.config.recompute.value
        assert float(row["step_time_s"]) == pytest.approx(p.estimate.step_time_s, rel=1e-12)
        assert float(row["samples_per_s"]) == pytest.approx(16 / p.estimate.step_time_s)
        causes = sum(float(row[f"{k}_s"]) for k in p.estimate.breakdown)
        assert causes == pytest.approx(p.estimate.step_time_s, rel=1e-9)


def test_pareto_png_and_exports_are_written(outputs) -> None:
    files, printed = outputs
    assert files["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and files["png"].stat().st_size > 10_000
    best = load_plans(files["json"])[0]
    for engine in ("megatron", "torchtitan", "deepspeed"):
        out = export_plan(best, engine)
        assert files[engine].read_text() == out.text
        assert all(f"not expressible in {engine}: {note}" in printed for note in out.notes)
    assert "micro-batch: samples (sequences) per microbatch per replica" in " ".join(printed.split())  # legend
