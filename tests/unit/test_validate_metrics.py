"""validate: the scores against hand computations, the choice of plans (top plus a spread over other
meshes), and the rescaling of a CPU profile to another rank count."""

from __future__ import annotations

import math

import pytest
import yaml

from autoplan.cluster.cpu_share import rescale, share
from autoplan.cluster.load import Cluster, parse_profile
from autoplan.plan.types import Breakdown, Estimate, ParallelConfig, Plan
from autoplan.validate.metrics import best_gap, mape, spearman
from autoplan.validate.select import mesh_of, spread


def test_scores_by_hand() -> None:
    pred, meas = [1.0, 2.0, 3.0, 4.0], [1.5, 1.0, 3.0, 5.0]
    # ranks 1 2 3 4 vs 2 1 3 4: d = (1, 1, 0, 0), rho = 1 - 6 * 2 / (4 * 15) = 0.8
    assert math.isclose(spearman(pred, meas), 0.8)
    assert math.isclose(mape(pred, meas), (0.5 / 1.5 + 1.0 + 0.0 + 0.2) / 4)
    # predicted best (1.0) measures 1.5; the measured best is 1.0
    assert math.isclose(best_gap(pred, meas), 0.5)
    assert best_gap([2.0, 1.0], [3.0, 2.0]) == 0.0
    with pytest.raises(ValueError, match="equally many"):
        mape([1.0], [1.0, 2.0])


def _plan(time_s: float, **config: object) -> Plan:
    est = Estimate(step_time_s=time_s, tokens_per_s=1.0, mfu=0.1, peak_mem_bytes=1, mem_capacity_bytes=2,
                   fits=True, breakdown=Breakdown())
    cfg = ParallelConfig(**config)
    return Plan(config=cfg, estimate=est, model_name="m", cluster_name="c", num_devices=cfg.num_devices,
                global_batch=16, seq_len=32)


def test_spread_takes_the_top_then_spaced_times_preferring_new_meshes() -> None:
    pool = [_plan(1.0, dp=8), _plan(1.01, dp=8, zero=1), _plan(1.02, dp=8, zero=2), _plan(1.03, dp=8, zero=3),
            _plan(2.0, tp=2, dp=4), _plan(2.05, dp=8, microbatch=2), _plan(4.0, tp=4, dp=2),
            _plan(7.8, tp=8), _plan(8.0, dp=8, microbatch=4)]
    chosen = spread(pool, 5, 2)
    times = [p.estimate.step_time_s for p in chosen]
    assert times[:2] == [1.0, 1.01]
    # targets 1.02, sqrt(1.02 * 8) = 2.86 and 8.0 (log-spaced over the rest); a mesh not chosen yet counts
    # 0.25 nearer in log time: tp4 at 4.0 (0.34 - 0.25) beats tp2 at 2.0 (0.36 - 0.25), tp8 at 7.8 beats
    # dp8 at exactly 8.0
    assert [mesh_of(p) for p in chosen[2:]] == [(1, 1, 8, 1, 1), (4, 1, 2, 1, 1), (8, 1, 1, 1, 1)]
    assert len(spread(pool, 20, 3)) == len(pool)


def test_cpu_profile_rescales_per_rank_figures_by_the_core_share() -> None:
    data = yaml.safe_load(Cluster.path("local-cpu").read_text())
    data["device"]["cpu_cores"], data["devices_per_node"] = 2, 8
    four = rescale(data, 4, "x")
    assert share(2, 8) == 0.25 and share(2, 1) == 1.0 and share(2, 1, threads=True) == 2.0
    dev, dev4 = data["device"], four["device"]
    assert math.isclose(float(dev4["peak_flops"]["fp32"]), 2 * float(dev["peak_flops"]["fp32"]))
    assert math.isclose(float(dev4["op_overhead_s"]), float(dev["op_overhead_s"]) / 2)
    assert dev4["mem_bytes"] == 2 * dev["mem_bytes"]
    assert math.isclose(float(four["intra_node"]["latency_s"]), float(data["intra_node"]["latency_s"]) / 2)
    assert math.isclose(float(four["intra_node"]["bw_bytes_per_s"]), 2 * float(data["intra_node"]["bw_bytes_per_s"]))
    one = rescale(data, 1, "x")  # one rank: its kernels run on both cores (8x), its ops issue on one (4x)
    assert math.isclose(float(one["device"]["peak_flops"]["fp32"]), 8 * float(dev["peak_flops"]["fp32"]))
    assert math.isclose(float(one["device"]["op_overhead_s"]), float(dev["op_overhead_s"]) / 4)
    assert math.isclose(float(rescale(data, 2, "x")["device"]["peak_flops"]["fp32"]), 4 * float(dev["peak_flops"]["fp32"]))
    assert rescale(data, 8, "x") == data
    # a shared core delivers e of its throughput: cancels between 4 and 8 ranks, not between 8 and 1
    # (a core to itself)
    data["device"]["cpu_oversubscribed_efficiency"] = 0.5
    assert math.isclose(float(rescale(data, 4, "x")["device"]["peak_flops"]["fp32"]), 2 * float(dev["peak_flops"]["fp32"]))
    one = rescale(data, 1, "x")
    assert math.isclose(float(one["device"]["peak_flops"]["fp32"]), 16 * float(dev["peak_flops"]["fp32"]))
    assert math.isclose(float(one["device"]["op_overhead_s"]), float(dev["op_overhead_s"]) / 8)
    spec = parse_profile(data, "x", devices_per_node=4)
    assert math.isclose(spec.device.peak("fp32"), 2 * float(dev["peak_flops"]["fp32"]))
