"""Pipeline schedule times and bubbles against the published closed forms."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoplan.cost import bubble_fraction, pipeline_time_s
from autoplan.plan.types import Schedule


def test_uniform_1f1b_and_gpipe() -> None:
    for schedule in (Schedule.ONE_F_ONE_B, Schedule.GPIPE):
        t = pipeline_time_s(schedule, 4, 1, 8, [1.0] * 4, [2.0] * 4)
        assert math.isclose(t, (8 + 4 - 1) * 3.0)  # (m + p - 1)(F + B)


def test_interleaved_divides_the_bubble_by_v() -> None:
    t = pipeline_time_s("interleaved", 4, 2, 8, [1.0] * 4, [2.0] * 4)
    assert math.isclose(t, 8 * 3.0 + 3 * 3.0 / 2)
    per_stage = pipeline_time_s("interleaved", 4, 2, 8, [0.5] * 8, [1.0] * 8)  # p*v chunk entries
    assert math.isclose(per_stage, t)


def test_zero_bubble_h1_is_a_third_of_1f1b() -> None:
    """Qi et al. 2024: F = B_input = W gives ZB-H1 a bubble of (p - 1) F, a third of 1F1B's."""
    f, b, w = 1.0, 2.0, 1.0
    one_f_one_b = pipeline_time_s("1f1b", 8, 1, 16, [f] * 8, [b] * 8) - 16 * 3.0
    zb = pipeline_time_s("zb", 8, 1, 16, [f] * 8, [b] * 8, [w] * 8) - 16 * 3.0
    assert math.isclose(zb, one_f_one_b / 3)
    assert math.isclose(bubble_fraction(Schedule.ZERO_BUBBLE, 8, 1, 16), bubble_fraction("1f1b", 8, 1, 16) / 3)


def test_slowest_stage_sets_the_pace() -> None:
    t = pipeline_time_s("1f1b", 2, 1, 10, [1.0, 2.0], [2.0, 4.0])
    assert math.isclose(t, 10 * 6.0 + 3.0)  # m * slowest + the other stage once


def test_single_stage_has_no_bubble() -> None:
    assert pipeline_time_s("1f1b", 1, 1, 5, [1.0], [2.0]) == 15.0
    assert bubble_fraction("interleaved", 1, 1, 5) == 0.0


def test_bad_lengths_and_counts() -> None:
    with pytest.raises(ValueError, match="entries"):
        pipeline_time_s("1f1b", 4, 1, 8, [1.0] * 3, [2.0] * 3)
    with pytest.raises(ValueError, match="positive"):
        pipeline_time_s("1f1b", 4, 1, 0, [1.0] * 4, [2.0] * 4)
    with pytest.raises(ValueError, match="schedule"):
        pipeline_time_s("pipedream", 4, 1, 8, [1.0] * 4, [2.0] * 4)


@settings(max_examples=50, deadline=None)
@given(p=st.integers(2, 16), v=st.integers(1, 4), m=st.integers(1, 64))
def test_bubble_shrinks_with_microbatches_and_virtual_stages(p: int, v: int, m: int) -> None:
    sched = Schedule.INTERLEAVED
    assert bubble_fraction(sched, p, v, m + 1) < bubble_fraction(sched, p, v, m)
    assert bubble_fraction(sched, p, v + 1, m) < bubble_fraction(sched, p, v, m)
    assert math.isclose(bubble_fraction(sched, p, v, m), (p - 1) / (v * m))
    t = [pipeline_time_s(sched, p, vv, m, [1.0] * p, [2.0] * p) / (m * 3.0) - 1 for vv in (v, v + 1)]
    assert t[1] < t[0]
