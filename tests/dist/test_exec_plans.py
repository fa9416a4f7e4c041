"""Every plan that autoplan() returns for tiny-gpt on an 8-rank local cluster trains like the reference."""

from __future__ import annotations

import pytest
from harness import assert_matches_reference, reference, run_plan

import autoplan
from autoplan import Cluster

TOP_K = 5  # autoplan()'s default top_k: every plan a default call returns
GLOBAL_BATCH, SEQ_LEN, STEPS = 16, 32, 2


@pytest.fixture(scope="module")
def plans() -> list:
    found = autoplan.autoplan("tiny-gpt", Cluster.load("local-cpu", devices_per_node=8),
                              global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN)
    assert len(found) == TOP_K
    return list(found)


@pytest.mark.parametrize("index", range(TOP_K))
def test_searched_plan_trains_like_the_reference(plans: list, index: int) -> None:
    plan = plans[index]
    run = run_plan("tiny-gpt", plan, steps=STEPS, global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN)
    ref = reference("tiny-gpt", steps=STEPS, global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN)
    assert_matches_reference(run, ref)
