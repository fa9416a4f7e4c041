"""Engine.zero0_1d_only (engines/torchtitan.yaml: torchtitan 2024 refuses DDP beside any other dimension,
'DDP has not supported > 1D parallelism'): what the search enumerates under it, against hand counts and a
brute-force filter of the unrestricted space, and the one-line refusal of a forced config, before any work."""

from __future__ import annotations

import dataclasses

import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

import autoplan
from autoplan.cli.main import build_parser, main
from autoplan.cost import estimate_config
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig
from autoplan.search import api
from autoplan.search.space import SearchOptions, engine_search_options, enumerate_space

GRAPH = gpt_graph(h=256, a=4, layers=4, seq=128, vocab=512)
TITAN = Engine.load("torchtitan")
FREE = dataclasses.replace(TITAN, zero0_1d_only=False)
LINE = ("engine 'torchtitan' runs ZeRO stage 0 (replicated data parallelism) only as the only parallel dimension "
        "(its zero0_1d_only), not beside tp=2: use --zero / zero= among 2, 3, or tp = pp = cp = ep = 1, or an "
        "engine that runs zero 0 beside them")


def test_only_torchtitan_sets_it_and_the_default_restricts_nothing() -> None:
    assert {n for n in Engine.names() if Engine.load(n).zero0_1d_only} == {"torchtitan"}
    assert not Engine().zero0_1d_only and Engine().runs_zero(0, tp=8, pp=4, dp=2, cp=2, ep=2)


@pytest.mark.parametrize("degrees, runs", [
    ({"dp": 64}, True),  # data parallelism alone: DDP (replicate)
    ({"tp": 8}, True), ({"tp": 2, "pp": 4}, True),  # nothing data parallel: no DDP applied at all
    ({"tp": 2, "dp": 4}, False), ({"pp": 2, "dp": 4}, False),  # world_mesh.ndim > 1
    ({"cp": 2}, False), ({"dp": 2, "ep": 2}, False),  # a cp or ep rank holds a dense replica too: dp*ep*cp > 1
])
def test_runs_zero_0_by_the_mesh(degrees: dict, runs: bool) -> None:
    assert TITAN.runs_zero(0, **degrees) is runs
    assert FREE.runs_zero(0, **degrees)
    assert TITAN.runs_zero(2, **{**degrees, "pp": 1})  # the sharded stages are not this field's


def _zeros(engine: Engine, **mesh: int) -> list[int]:
    """The ZeRO column of one fixed mesh's rows (one microbatch size, one recompute mode, no SP, pp 1)."""
    opts = engine_search_options({**{k: (v,) for k, v in mesh.items()}, "microbatch": (1,),
                                  "recompute": ("none",), "sp": (False,)}, engine)
    space = enumerate_space(GRAPH, a100_cluster(1, per_node=4), SearchOptions(global_batch=8, **opts))
    return sorted(space.columns["zero"].tolist())


def test_the_enumeration_by_hand_on_four_devices() -> None:
    # zero_stages (0, 2, 3): dp 4 alone keeps all three; tp 2 x dp 2 loses 0; tp 4 (dp 1) runs 0 only (nothing to
    # shard); pp 2 x dp 2 (zero_stages_with_pp (0, 2), 1F1B only here) loses 0
    assert _zeros(TITAN, tp=1, pp=1, dp=4) == [0, 2, 3]
    assert _zeros(TITAN, tp=2, pp=1, dp=2) == [2, 3] and _zeros(FREE, tp=2, pp=1, dp=2) == [0, 2, 3]
    assert _zeros(TITAN, tp=4, pp=1, dp=1) == [0]
    opts = {"schedules": ("1f1b",)}
    assert _zeros(dataclasses.replace(TITAN, **opts), tp=1, pp=2, dp=2) == [2]


def test_the_search_space_is_the_unrestricted_one_less_the_refused_rows() -> None:
    cluster = a100_cluster(2, per_node=4)
    spaces = [enumerate_space(GRAPH, cluster, SearchOptions(global_batch=8, **engine_search_options({}, e)))
              for e in (TITAN, FREE)]
    rows = [{tuple(int(s.columns[k][i]) for k in s.columns) for i in range(len(s))} for s in spaces]
    names = list(spaces[0].columns)

    def refused(row: tuple) -> bool:  # by hand: zero 0, a data-parallel group and another degree beside it
        r = dict(zip(names, row))
        return r["zero"] == 0 and r["dp"] * r["ep"] * r["cp"] > 1 and max(r["tp"], r["pp"], r["cp"], r["ep"]) > 1

    assert rows[0] == {r for r in rows[1] if not refused(r)}
    assert len(rows[1]) - len(rows[0]) == sum(map(refused, rows[1])) > 0


def test_a_forced_config_is_one_line_before_the_capture(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("captured the model before refusing")

    monkeypatch.setattr(api, "model_graph", refuse)
    with pytest.raises(ValueError) as err:
        autoplan.estimate("tiny-llama", a100_cluster(1, per_node=4), {"tp": 2, "dp": 2, "zero": 0}, global_batch=8,
                          seq_len=64, engine="torchtitan")
    assert str(err.value) == LINE


def test_the_exact_model_refuses_it_and_runs_the_others() -> None:
    cluster = a100_cluster(1, per_node=4)
    with pytest.raises(ValueError, match="its zero0_1d_only"):
        estimate_config(GRAPH, cluster, ParallelConfig(tp=2, dp=2), global_batch=8, engine=TITAN)
    for config in (ParallelConfig(dp=4), ParallelConfig(tp=4), ParallelConfig(tp=2, dp=2, zero=2)):
        assert estimate_config(GRAPH, cluster, config, global_batch=8, engine=TITAN).step_time_s > 0


def test_the_cli_refuses_it_exit_2(capsys) -> None:
    job = ["--model", "gpt3-1.7b", "--cluster", "dgx-a100-80gb", "--global-batch", "64", "--seq-len", "2048",
           "--engine", "torchtitan"]
    assert main(["estimate", *job, "--tp", "2", "--zero", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoplan: error: engine 'torchtitan' runs ZeRO stage 0") and "not beside tp=2" in err
    assert err.count("\n") == 1


def test_the_plan_flag_asks_it_of_any_engine() -> None:
    from autoplan.cli.plan import search_options

    parser = build_parser()
    args = parser.parse_args(["plan", "--model", "tiny-llama", "--cluster", "local-cpu", "--seq-len", "64",
                              "--global-batch", "16", "--zero0-1d-only"])
    opts = engine_search_options(search_options(args), Engine())
    assert opts["zero0_1d_only"] is True
    assert engine_search_options({}, Engine())["zero0_1d_only"] is False
    space = enumerate_space(GRAPH, a100_cluster(1, per_node=4),
                            SearchOptions(global_batch=8, tp=(2,), dp=(2,), microbatch=(1,), recompute=("none",),
                                          sp=(False,), zero0_1d_only=True))
    assert sorted(space.columns["zero"].tolist()) == [1, 2, 3]  # autoplan's stages less 0 beside tp 2


def test_an_empty_space_names_zero0_1d_only_not_the_batch() -> None:
    # four devices, tp 2 and dp 2 fixed, zero 0 only: the one row (tp 2, dp 2, zero 0) is the refused kind
    kwargs = {"global_batch": 8, "seq_len": 128, "tp": 2, "dp": 2, "zero": 0, "microbatch": 1, "sp": False,
              "recompute": "none"}
    with pytest.raises(ValueError, match="runs zero 0 beside data parallelism and another dimension") as err:
        autoplan.autoplan(GRAPH, a100_cluster(1, per_node=4), zero0_1d_only=True, **kwargs)
    assert "\n" not in str(err.value) and "divides global batch" not in str(err.value)
    with pytest.raises(ValueError, match="divides global batch 7"):  # an empty space for another cause
        autoplan.autoplan(GRAPH, a100_cluster(1, per_node=4), zero0_1d_only=True, **{**kwargs, "global_batch": 7})


def test_a_zero0_1d_only_that_is_not_a_bool_is_refused_not_read_as_true() -> None:
    with pytest.raises(ValueError, match="zero0_1d_only must be true or false, got 'no'"):
        autoplan.autoplan(GRAPH, a100_cluster(1, per_node=4), global_batch=8, seq_len=128, zero0_1d_only="no")
    assert engine_search_options({"zero0_1d_only": False}, TITAN)["zero0_1d_only"] is True  # the engine's stands
    assert engine_search_options({"zero0_1d_only": None}, Engine())["zero0_1d_only"] is False
