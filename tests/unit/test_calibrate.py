"""cluster.calibrate: the fit recovers known field values from synthetic measurements (an analytic model,
and the real cost model on a profile), its error is measured on runs it did not see, and the written
profile holds the fitted values with every other line kept."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml
from test_cost_graph_helper import gpt_graph

from autoplan.cluster.calibrate import (
    Fit,
    Run,
    calibrate,
    fit_parameters,
    fitted_profile_text,
    get_field,
    split,
    with_fields,
)
from autoplan.cluster.load import Cluster, parse_profile
from autoplan.cost import estimate_config
from autoplan.plan.types import Breakdown, Estimate, ParallelConfig, Plan

GRAPH = gpt_graph(h=256, a=4, layers=4, seq=64, vocab=512)
PROFILE_PATH = Cluster.path("local-cpu")
PROFILE = yaml.safe_load(PROFILE_PATH.read_text())


def test_fit_recovers_an_analytic_model() -> None:
    # t = a x + b y: a compute rate and a per-call latency, measured exactly
    x = np.array([1.0, 2.0, 5.0, 0.5, 3.0])
    y = np.array([10.0, 1.0, 3.0, 8.0, 0.0])
    truth = np.array([0.2, 0.03])
    measured = truth[0] * x + truth[1] * y
    got = fit_parameters(lambda t: t[0] * x + t[1] * y, measured, np.array([1.0, 1.0]),
                         np.array([1e-3, 1e-4]), np.array([10.0, 1.0]))
    np.testing.assert_allclose(got, truth, rtol=1e-6)


def test_split_holds_out_a_seeded_share() -> None:
    train, held = split(10, 0.3, seed=1)
    assert len(held) == 3 and len(train) == 7
    assert sorted(train + held) == list(range(10))
    assert split(10, 0.3, seed=1) == (train, held)
    with pytest.raises(ValueError, match="at least 2"):
        split(1, 0.3, seed=0)


def _plan(config: ParallelConfig) -> Plan:
    est = Estimate(step_time_s=1.0, tokens_per_s=1.0, mfu=0.1, peak_mem_bytes=1, mem_capacity_bytes=2, fits=True,
                   breakdown=Breakdown())
    return Plan(config=config, estimate=est, model_name="gpt", cluster_name="local-cpu",
                num_devices=config.num_devices, global_batch=16, seq_len=GRAPH.seq_len)


CONFIGS = (ParallelConfig(dp=4), ParallelConfig(dp=4, zero=3), ParallelConfig(tp=2, dp=2),
           ParallelConfig(tp=4, sp=True), ParallelConfig(pp=2, dp=2, microbatch=2),
           ParallelConfig(pp=4, schedule="gpipe", microbatch=4), ParallelConfig(tp=2, pp=2, microbatch=8),
           ParallelConfig(dp=4, microbatch=2), ParallelConfig(dp=2, cp=2), ParallelConfig(pp=2, dp=2, zero=1))


def test_calibrate_recovers_known_profile_fields_and_errs_on_held_out_runs() -> None:
    fields = ("device.matmul_efficiency", "intra_node.latency_s")
    truth = {"device.matmul_efficiency": 0.21, "intra_node.latency_s": 3 * get_field(PROFILE, "intra_node.latency_s")}
    true_cluster = parse_profile(with_fields(PROFILE, truth), "truth", devices_per_node=4)
    runs = [Run(model="gpt", nproc_per_node=4, plan=_plan(c), source="synthetic",
                measured_s=estimate_config(GRAPH, true_cluster, c, global_batch=16).step_time_s) for c in CONFIGS]
    fit = calibrate(runs, PROFILE, str(PROFILE_PATH), fields=fields, held_out_fraction=0.3, seed=0,
                    graph_for=lambda model, seq_len: GRAPH)
    for field in fields:
        assert math.isclose(fit.values[field], truth[field], rel_tol=1e-4), field
    assert len(fit.held_out) == 3 and not set(fit.held_out) & set(fit.train)
    assert fit.mape_before["held_out"] > 0.05  # the start was wrong on the held-out runs ...
    assert fit.mape_after["held_out"] < 1e-4  # ... and the fit, which never saw them, is right


def test_written_profile_holds_the_fit_and_keeps_the_rest() -> None:
    text = PROFILE_PATH.read_text()
    fit = Fit(values={"device.op_overhead_s": 4.25e-5, "intra_node.latency_s": 3.5e-3}, start={}, train=(0,),
              held_out=(1,), mape_before={}, mape_after={})
    out = fitted_profile_text(text, fit, note="test runs", name="fitted")
    back = yaml.safe_load(out)
    assert get_field(back, "device.op_overhead_s") == 4.25e-5
    assert get_field(back, "intra_node.latency_s") == 3.5e-3
    assert back["name"] == "fitted"
    if PROFILE["inter_node"] == PROFILE["intra_node"]:  # one machine's loopback: inter follows intra
        assert get_field(back, "inter_node.latency_s") == 3.5e-3
    assert out.splitlines()[0] == "# Calibrated: test runs"
    changed = [(a, b) for a, b in zip(text.splitlines(), out.splitlines()[1:]) if a != b]
    assert all("measured: calibrated" in b or b.startswith("name:") for _, b in changed)
    assert len(text.splitlines()) + 1 == len(out.splitlines())
    parse_profile(back, "fitted")  # still a valid profile


def test_unknown_field_is_named() -> None:
    with pytest.raises(ValueError, match="no field 'device.warp_speed'"):
        get_field(PROFILE, "device.warp_speed")
