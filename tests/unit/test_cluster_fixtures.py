"""Recorded `autoplan profile` runs (tests/fixtures/profiles): refitting their raw medians must give
the profile they shipped with, and the fitted alpha-beta model must track the measurements."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from autoplan.cluster import Cluster
from autoplan.cluster.fit import bus_bandwidth, fit_alpha_beta, fit_matmul

FIXTURES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "profiles").glob("*.yaml"))


@pytest.fixture(params=FIXTURES, ids=lambda p: p.stem)
def recorded(request) -> tuple[Path, dict]:
    return request.param, yaml.safe_load(request.param.read_text())["measured"]


def test_there_are_recorded_runs() -> None:
    assert len(FIXTURES) >= 2


def test_recorded_profile_loads_with_its_measurement_context(recorded) -> None:
    path, measured = recorded
    spec = Cluster.load(path)
    assert spec.devices_per_node == measured["nproc_per_node"]
    assert measured["date"] and measured["hostname"] and measured["torch"]
    for row in measured["comm"]:  # bus bandwidth recorded as nccl-tests defines it
        expected = bus_bandwidth(row["op"], row["group_size"], row["bytes"], row["time_s"])
        assert row["busbw_bytes_per_s"] == pytest.approx(expected, rel=1e-9)


def test_refit_of_recorded_medians_gives_the_shipped_link(recorded) -> None:
    path, measured = recorded
    spec = Cluster.load(path)
    fits = {}
    for op, stored in measured["comm_fits"]["intra_node"].items():
        rows = [r for r in measured["comm"] if r["op"] == op and r["level"] == "intra_node"]
        fit = fit_alpha_beta(
            op, rows[0]["group_size"], [r["bytes"] for r in rows], [r["time_s"] for r in rows]
        )
        assert fit.alpha_s == pytest.approx(stored["alpha_s"], rel=1e-6)
        assert fit.bw_bytes_per_s == pytest.approx(stored["bw_bytes_per_s"], rel=1e-6)
        fits[op] = fit
    link = spec.intra_node
    nominal = max(f.bw_bytes_per_s for f in fits.values())  # CPU: no datasheet, best fitted bus bw
    assert link.bw_bytes_per_s == pytest.approx(nominal, rel=1e-5)
    assert link.latency_s == pytest.approx(fits["all_reduce"].alpha_s, rel=1e-5)
    assert link.allreduce_busbw_fraction == pytest.approx(
        fits["all_reduce"].bw_bytes_per_s / nominal, rel=1e-5
    )
    assert link.alltoall_bw_fraction == pytest.approx(fits["all_to_all"].bw_bytes_per_s / nominal, rel=1e-5)
    assert link.p2p_bw_fraction == pytest.approx(fits["send_recv"].bw_bytes_per_s / nominal, rel=1e-5)


def test_fitted_model_tracks_the_recorded_measurements(recorded) -> None:
    """Honesty bound on real, noisy data (a shared 2-core machine): for every collective the median
    prediction error over the sweep stays under 35 % and 2 in 3 points are within 2x; where a run
    misses that (a --quick run's short sweep), the profile itself must say the op was noisy."""
    _, measured = recorded
    for op, stored in measured["comm_fits"]["intra_node"].items():
        rows = [r for r in measured["comm"] if r["op"] == op]
        fit = fit_alpha_beta(
            op, rows[0]["group_size"], [r["bytes"] for r in rows], [r["time_s"] for r in rows]
        )
        assert fit.rel_rms_error == pytest.approx(stored["rel_rms_error"], rel=1e-6)
        ratio = np.array([fit.predict_s(r["bytes"]) / r["time_s"] for r in rows])
        good = np.median(np.abs(ratio - 1)) < 0.35 and np.mean((ratio > 0.5) & (ratio < 2)) >= 2 / 3
        flagged = [w for w in measured["warnings"] if f" {op} " in w]
        assert good or (measured["quick"] and flagged), (op, ratio, flagged)


def test_refit_of_recorded_matmuls_gives_the_shipped_device(recorded) -> None:
    path, measured = recorded
    device = Cluster.load(path).device
    rows = [r for r in measured["matmul"] if r["dtype"] == "fp32"]
    fit = fit_matmul([r["flops"] for r in rows], [r["flops_per_s"] for r in rows])
    assert device.peak("fp32") == pytest.approx(fit.peak_flops, rel=1e-4)
    assert device.matmul_half_size_flops == pytest.approx(fit.half_size_flops, rel=1e-4)
    # the curve sits in the middle of the data: median measured / predicted within 2x either way
    ratio = np.median([r["flops_per_s"] / fit.predict_flops_per_s(r["flops"]) for r in rows])
    assert 0.5 < ratio < 2, ratio
