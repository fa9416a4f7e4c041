"""`autoplan validate` on 2 ranks end to end (its JSON contract and scores recomputed from its own
entries), and the executor's action trace behind `autoplan timeline --report`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from autoplan.execute.launch import execute
from autoplan.plan.io import save_plan
from autoplan.plan.types import Breakdown, Estimate, ParallelConfig, Plan

CONTRACT = ("config", "predicted_step_time_s", "measured_step_time_s", "predicted_peak_mem_bytes",
            "measured_peak_mem_bytes")
PNG = b"\x89PNG\r\n\x1a\n"


def _cli(*args: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan.cli.main", *args], capture_output=True, text=True,
                          timeout=240, cwd=cwd, check=False, env=os.environ.copy())


def test_validate_json_holds_the_contract_and_its_scores(tmp_path) -> None:
    out, png = tmp_path / "v.json", tmp_path / "v.png"
    done = _cli("validate", "--model", "tiny-gpt", "--cluster", "local-cpu", "--nproc-per-node", "2",
                "--plans", "3", "--top", "1", "--steps", "3", "--global-batch", "8", "--seq-len", "16",
                "--json", str(out), "--plot", str(png), cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert "[3/3]" in done.stdout and "Spearman" in done.stdout
    result = json.loads(out.read_text())
    plans = result["plans"]
    assert len(plans) == 3 and {"plans", "spearman", "mape"} <= set(result)
    for entry in plans:
        assert set(CONTRACT) <= set(entry)
        assert ParallelConfig.from_dict(entry["config"]).num_devices == 2
        assert entry["measured_step_time_s"] > 0 and entry["measured_peak_mem_bytes"] > 2**20
    # the three are different configurations, the first the planner's best
    assert len({json.dumps(e["config"], sort_keys=True) for e in plans}) == 3
    pred = [e["predicted_step_time_s"] for e in plans]
    meas = [e["measured_step_time_s"] for e in plans]
    assert math.isclose(result["mape"], sum(abs(p - m) / m for p, m in zip(pred, meas)) / 3)
    rank = lambda xs: [sorted(xs).index(x) for x in xs]
    d2 = sum((a - b) ** 2 for a, b in zip(rank(pred), rank(meas)))
    assert math.isclose(result["spearman"], 1 - 6 * d2 / (3 * (9 - 1)))
    assert png.read_bytes()[:8] == PNG


def test_trace_records_every_pipeline_action_and_timeline_draws_it(tmp_path) -> None:
    config = ParallelConfig(pp=2, schedule="zb", virtual_stages=2, microbatch=2)
    est = Estimate(step_time_s=0.05, tokens_per_s=1.0, mfu=0.1, peak_mem_bytes=2**28, mem_capacity_bytes=2**31,
                   fits=True, breakdown=Breakdown())
    plan = Plan(config=config, estimate=est, model_name="tiny-gpt", cluster_name="local-cpu", num_devices=2,
                global_batch=8, seq_len=16)
    with open(os.devnull, "w") as quiet:
        report = execute(plan, "tiny-gpt", steps=2, trace=True, report=tmp_path / "run.json", out=quiet)
    ranks = report["timeline"]["ranks"]
    assert sorted(ranks) == ["0", "1"]
    m = 4  # 8 sequences / microbatch 2
    for rank, stages in (("0", {0, 3}), ("1", {1, 2})):  # the V: rank 0 holds the first and last stage
        actions = ranks[rank]
        assert {a[1] for a in actions} == stages
        for stage in stages:
            for kind in ("F", "W"):
                assert sorted(a[2] for a in actions if a[0] == kind and a[1] == stage) == list(range(m))
        assert all(0 <= a[3] <= a[4] for a in actions)
    save_plan(plan, tmp_path / "plan.json")
    done = _cli("timeline", str(tmp_path / "plan.json"), "--report", str(tmp_path / "run.json"), "-o",
                str(tmp_path / "t.png"), cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG
