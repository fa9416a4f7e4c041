"""Plan JSON: golden plans round-trip byte for byte; a plan survives to_json -> from_json; bad JSON is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoplan.plan import explain, load_plan, plan_from_json, plan_to_json, save_plan
from autoplan.plan.types import Recompute

GOLDEN = sorted((Path(__file__).parents[1] / "fixtures" / "plans").glob("*.json"))


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_plan_round_trips(path: Path, tmp_path: Path) -> None:
    text = path.read_text()
    plan = load_plan(path)
    assert plan_to_json(plan) == text
    assert plan_from_json(plan_to_json(plan)) == plan
    save_plan(plan, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json") == plan
    # the fields an executor reads, against the raw JSON
    raw = json.loads(text)
    assert plan.config.to_dict() == raw["config"]
    assert [list(s.layer_names) for s in plan.stages] == [s["layer_names"] for s in raw["stages"]]
    assert len(plan.stages) == plan.config.pp * plan.config.virtual_stages


def test_layer_recompute_survives_as_enums() -> None:
    plan = load_plan(next(p for p in GOLDEN if "layer-recompute" in p.name))
    assert plan.recompute_for("layers.1") is Recompute.FULL
    assert plan.recompute_for("layers.2") is Recompute.SELECTIVE
    assert plan.recompute_for("layers.0") is plan.config.recompute


def test_explain_says_what_the_plan_is() -> None:
    plan = load_plan(GOLDEN[0])
    text = explain(plan)
    assert text == plan.explain()
    c = plan.config
    step = plan.estimate.step_time_s  # three decimals, or three significant digits under 10 ms
    assert f"tp={c.tp}, pp={c.pp}, dp={c.dp}" in text and (f"{step:.3f} s" if step >= 0.01 else f"{step:.3g} s") in text


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ("[]", "must be an object"),
    ('{"schema_version": 99}', "schema_version 99 is not supported"),
    ('{"schema_version": 1}', "lacks the field"),
])
def test_bad_plan_json_is_one_clear_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_from_json(text)
