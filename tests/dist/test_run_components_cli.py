"""`autoplan plan --json` then `autoplan run --plan` of the LLaVA-style model (a component plan, launched by
torchrun through autoplan.execute_components): its losses equal one process running transformers' own
forward (test_exec_components.reference) to 1e-5."""

from __future__ import annotations

import json

import pytest
from test_exec_components import SEQ, STEPS, B, reference

from autoplan.cli.main import main

pytest.importorskip("transformers")


def test_cli_plan_then_run_of_tiny_llava_matches_one_process(tmp_path, capsys) -> None:
    plan, report = tmp_path / "plan.json", tmp_path / "report.json"
    assert main(["plan", "--model", "tiny-llava", "--cluster", "local-cpu", "--devices-per-node", "4",
                 "--global-batch", str(B), "--seq-len", str(SEQ), "--pp", "1", "--cp", "1", "--sp", "off",
                 "--group-devices", "2,2", "--handoff-microbatches", "2", "--quiet", "--json", str(plan)]) == 0
    assert main(["run", "--plan", str(plan), "--model", "tiny-llava", "--steps", str(STEPS), "--report",
                 str(report)]) == 0
    measured = json.loads(report.read_text())
    assert [len(g["ranks"]) for g in measured["groups"]] == [2, 2]
    assert measured["losses"] == pytest.approx(reference("tiny-llava")["losses"], abs=1e-5)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["losses"] == measured["losses"]
