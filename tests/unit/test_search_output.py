"""What a ranking shows: ties (candidates predicted the same) folded into one row saying what differs; the
Pareto front against brute force; the explanation weighing other cp and ep degrees; samples/s and the
assumed input shape for a model without tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from autoplan.cluster.load import Cluster
from autoplan.cost import estimate_config
from autoplan.plan.types import Breakdown, Estimate, ParallelConfig
from autoplan.search.api import autoplan, model_graph
from autoplan.search.pareto import pareto_front
from autoplan.search.ties import fold_ties, same_prediction


def _cand(time_s: float, mem: int, **config) -> SimpleNamespace:
    est = Estimate(step_time_s=time_s, tokens_per_s=1.0, mfu=0.1, peak_mem_bytes=mem, mem_capacity_bytes=10**12,
                   fits=True, breakdown=Breakdown(compute=time_s))
    return SimpleNamespace(config=ParallelConfig(**config), estimate=est, stages=(), layer_recompute=())


def test_fold_ties_by_hand() -> None:
    a = _cand(1.0, 1000, dp=8, zero=1)
    b = _cand(1.0008, 1005, dp=8, zero=2)  # +0.08 % time, +0.5 % memory: a tie of a
    c = _cand(1.0015, 1000, dp=4, cp=2, microbatch=2)  # +0.15 % of a: not a tie of a
    d = _cand(1.0022, 1000, dp=4, cp=2, microbatch=2, sp=False, zero=3)  # +0.07 % of c, +0.22 % of a: c's tie
    e = _cand(1.0023, 1200, dp=8, recompute="full")  # time ties c but 20 % more memory: its own row
    groups = fold_ties([a, b, c, d, e])
    assert [(g[0] is x) for g, x in zip(groups, (a, c, e))] == [True, True, True] and len(groups) == 3
    assert groups[0][1] == ("zero=2",) and groups[1][1] == ("zero=3",) and groups[2][1] == ()


def _cnn_graph():
    import importlib.util

    import torch

    from autoplan.graph.capture import capture

    path = Path(__file__).parents[2] / "examples" / "plan_cnn.py"
    spec = importlib.util.spec_from_file_location("plan_cnn", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch.device("meta"):
        return capture(module.make(), seq_len=1024)


def test_search_folds_recompute_modes_a_cnn_cannot_tell_apart() -> None:
    """Selective recompute drops only attention activations: a CNN has none, so its selective and
    none plans are the same plan. The ranking shows one row each, with the other folded into it. (The CNN's
    graph without its image input shape: a model without tokens is searched without selective recompute at
    all, search.space.token_free_restriction, so the twins only meet when its input is not known.)"""
    graph, cluster = dataclasses.replace(_cnn_graph(), input_shape=()), Cluster.load("local-cpu", devices_per_node=2)
    plans = autoplan(graph, cluster, global_batch=8, seq_len=1024, top_k=3, tp=1, pp=1, cp=1, zero=0,
                     recompute=("none", "selective"), use_ilp=False)
    for p in plans:
        other = "selective" if p.config.recompute.value == "none" else "none"
        assert p.folded == (f"recompute={other}",)
        twin = estimate_config(graph, cluster, dataclasses.replace(p.config, recompute=other), global_batch=8)
        assert twin.step_time_s == pytest.approx(p.estimate.step_time_s, rel=1e-3)  # the tie is real
    assert len(plans) == 3 and not any(same_prediction(p, q) for i, p in enumerate(plans) for q in plans[i + 1:])


@pytest.mark.parametrize("seed", range(5))
def test_pareto_front_against_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    t, m = rng.integers(1, 20, 60).astype(float), rng.integers(1, 20, 60).astype(float)
    front = pareto_front(t, m)
    dominated = {i for i in range(60) for j in range(60)
                 if t[j] <= t[i] and m[j] <= m[i] and (t[j] < t[i] or m[j] < m[i])}
    # one point per distinct non-dominated (time, memory) pair
    assert {(t[i], m[i]) for i in front} == {(t[i], m[i]) for i in range(60) if i not in dominated}
    assert len(front) == len({(t[i], m[i]) for i in front}) and list(m[front]) == sorted(m[front])


def test_explanation_weighs_other_cp_and_ep_degrees() -> None:
    graph, cluster = model_graph("tiny-moe", 64), Cluster.load("local-cpu")
    plans = autoplan(graph, cluster, global_batch=16, seq_len=64, top_k=2, use_ilp=False)
    notes = plans[0].notes
    for axis, degrees in (("cp", (1, 2, 4, 8)), ("ep", (1, 2, 4))):
        line = next(n for n in notes if n.startswith(f"Best plan found at other {axis} degrees"))
        mine = getattr(plans[0].config, axis)
        listed = [int(part.split("=")[1].split()[0]) for part in line.split(": ", 1)[1].rstrip(".").split(", ")]
        assert mine not in listed and set(listed) <= set(degrees) and listed, line


def test_a_model_without_tokens_reports_samples_and_its_input_shape() -> None:
    from autoplan.plan.io import plan_from_json, plan_to_json
    from autoplan.search.table import render

    graph = _cnn_graph()
    assert graph.vocab_size == 0 and graph.input_shape == (3, 32, 32)  # seq_len 1024 = 32 x 32 positions
    plans = autoplan(graph, Cluster.load("local-cpu", devices_per_node=2), global_batch=8, seq_len=1024, top_k=1,
                     tp=1, pp=1, cp=1, zero=0, recompute="none", use_ilp=False)
    p = plans[0]
    assert p.sample_shape == (3, 32, 32) and p.samples_per_s == pytest.approx(8 / p.estimate.step_time_s)
    table, text = render(plans.table(), width=250), p.explain()
    assert "samples/s" in table and "tokens/s" not in table and f"{p.samples_per_s:,.1f}" in table
    assert "8 samples of input shape 3 x 32 x 32" in text and "tokens" not in text.split("Why:")[0]
    assert plan_from_json(plan_to_json(p)) == p
    token_plan = autoplan("tiny-llama", "local-cpu", global_batch=16, seq_len=64, top_k=1, tp=1, pp=1, use_ilp=False)
    assert token_plan[0].sample_shape == () and "tokens/s" in token_plan[0].explain()
