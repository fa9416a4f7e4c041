"""The discrete-event simulation of a lane against queueing theory: gamma gaps of vLLM's
--burstiness, Pollaczek-Khinchine's M/D/1 wait, Kingman's G/D/1 approximation, a lone client by
hand, and the analytic steady state of queueing.py at light load."""

from __future__ import annotations

import math
import statistics

import pytest
from serve_helpers import LLAMA3_8B

from autoplan.serve.api import serve_estimate
from autoplan.serve.physics import Iteration
from autoplan.serve.queueing import LaneSpec, md1_wait_s, open_loop
from autoplan.serve.simulate import gamma_gaps, simulate_closed, simulate_open
from autoplan.serve.types import Workload

S = 0.05  # seconds per prompt: one prompt per iteration, decoding free


def _prefill_only(it: Iteration) -> float:
    return S if it.prefill else 1e-9


PROMPTS = LaneSpec(input_len=1000, output_len=1, cap=10**6, budget=1000)  # a single FCFS server


def test_gamma_gaps_have_mean_one_over_rate_and_cv2_one_over_shape() -> None:
    for k in (0.5, 1.0, 4.0):
        gaps = gamma_gaps(10.0, k, 20000, seed=1)
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(0.1, rel=0.05)
        assert statistics.pvariance(gaps) / mean**2 == pytest.approx(1 / k, rel=0.1)  # gamma: var = k theta^2
    assert gamma_gaps(4.0, math.inf, 3) == [0.25, 0.25, 0.25]


def test_poisson_prompts_wait_as_md1() -> None:
    state = simulate_open(_prefill_only, PROMPTS, 16.0, num_requests=4000)  # rho = 0.8
    assert state.ttft_s - S == pytest.approx(md1_wait_s(16.0, S), rel=0.15)  # rho S / (2 (1 - rho)) = 0.1 s


def test_burstier_arrivals_wait_longer_as_kingman_says() -> None:
    waits = {k: simulate_open(_prefill_only, PROMPTS, 16.0, burstiness=k, num_requests=4000).ttft_s - S
             for k in (0.25, 0.5, 1.0, 4.0)}
    assert waits[0.25] > waits[0.5] > waits[1.0] > waits[4.0]
    kingman = (1 / 0.5) / 2 * 0.8 / 0.2 * S  # (ca^2 + cs^2) / 2 x rho / (1 - rho) x S, ca^2 = 1/k, cs^2 = 0
    assert waits[0.5] == pytest.approx(kingman, rel=0.2)


def test_overload_is_unstable() -> None:
    state = simulate_open(_prefill_only, PROMPTS, 30.0, num_requests=2000)  # needs 1.5 s of prefill a second
    assert not state.stable and math.isinf(state.ttft_s)


def _step(it: Iteration) -> float:
    return 0.01 + 1e-5 * it.prefill + 2e-5 * it.decode


SPEC = LaneSpec(input_len=1000, output_len=101, cap=64, budget=8192)


def test_one_client_is_its_prefill_then_decode_steps() -> None:
    state = simulate_closed(_step, SPEC, 1)
    assert state.ttft_s == pytest.approx(0.01 + 1e-5 * 1000 + 0.0)  # alone: no decodes beside it
    assert state.tpot_s == pytest.approx(0.01 + 2e-5)
    assert state.rate == pytest.approx(1 / (0.02 + 100 * 0.01002), rel=0.01)


def test_light_poisson_load_matches_the_analytic_lane() -> None:
    sim = simulate_open(_step, SPEC, 5.0, num_requests=1500)
    ana = open_loop(_step, SPEC, 5.0)
    assert sim.tpot_s == pytest.approx(ana.tpot_s, rel=0.02)
    assert sim.ttft_s == pytest.approx(ana.ttft_s, rel=0.15)


def test_workload_burstiness_is_for_open_loops_and_positive() -> None:
    with pytest.raises(ValueError, match="give rate"):
        Workload(input_len=10, output_len=10, concurrency=4, burstiness=0.5)
    with pytest.raises(ValueError, match="burstiness must be a positive"):
        Workload(input_len=10, output_len=10, rate=1.0, burstiness=0.0)
    assert Workload(input_len=10, output_len=10, rate=1.0, burstiness=0.5).simulated


def test_bursty_traffic_raises_ttft_in_serve_estimate() -> None:
    args = {"input_len": 1000, "output_len": 50, "rate": 8.0, "engine": "vllm"}
    poisson = serve_estimate(LLAMA3_8B, "dgx-h100-80gb", {"tp": 1}, simulate=True, **args)
    bursty = serve_estimate(LLAMA3_8B, "dgx-h100-80gb", {"tp": 1}, burstiness=0.25, **args)
    assert bursty.ttft_s > poisson.ttft_s
    assert bursty.tpot_s == pytest.approx(poisson.tpot_s, rel=0.25)
