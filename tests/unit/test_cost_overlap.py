"""Two-stream overlap of data-parallel communication with compute, against hand-traced timelines."""

from __future__ import annotations

import math

import pytest

from autoplan.cost import exposed_s, overlapped_s


def test_ddp_buckets_expose_only_the_last_when_comm_is_short() -> None:
    # buckets of 0.5 s follow layers of 1 s: each finishes before the next is ready; the last sticks out
    assert math.isclose(exposed_s([1.0] * 3, [0.0] * 3, [0.5] * 3), 0.5)


def test_comm_bound_buckets_queue_up() -> None:
    # reductions of 2 s start at 1, 3, 5 and end at 7: 4 s past the 3 s of compute
    assert math.isclose(overlapped_s([1.0] * 3, [0.0] * 3, [2.0] * 3), 7.0)


def test_prefetched_gathers_expose_the_first() -> None:
    assert math.isclose(exposed_s([1.0] * 3, [0.5] * 3, [0.0] * 3), 0.5)
    # gathers longer than compute: each layer waits for its own gather
    assert math.isclose(overlapped_s([1.0] * 3, [2.0] * 3, [0.0] * 3), 7.0)


def test_nothing_to_send_exposes_nothing() -> None:
    assert exposed_s([0.1, 0.2, 0.3], [0.0] * 3, [0.0] * 3) == 0.0
    with pytest.raises(ValueError, match="equal lengths"):
        overlapped_s([1.0], [0.0, 0.0], [0.0])
