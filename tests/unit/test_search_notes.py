"""The best plan's note against plan #2 names what differs, also when only one of them folds MoE (etp / eep are
left out of to_dict when 0: mixtral-8x7b on 1,024 H100s once failed with KeyError 'etp' here)."""

from __future__ import annotations

from autoplan.plan.types import ParallelConfig
from autoplan.search.notes import config_diff


def test_the_diff_names_every_changed_field_with_plan_2s_value() -> None:
    best = ParallelConfig(tp=2, pp=4, dp=8, microbatch=2)
    other = ParallelConfig(tp=4, pp=4, dp=4, microbatch=2)
    assert config_diff(best, other) == "tp 4, dp 4"
    assert config_diff(best, best) == ""


def test_a_folded_plan_against_an_unfolded_one_counts_the_missing_degrees_as_zero() -> None:
    unfolded = ParallelConfig(tp=2, dp=4, ep=4, microbatch=1)
    folded = ParallelConfig(tp=2, dp=4, ep=4, microbatch=1, etp=1, eep=8)
    assert "etp" not in unfolded.to_dict() and "etp" in folded.to_dict()
    assert config_diff(unfolded, folded) == "etp 1, eep 8"
    assert config_diff(folded, unfolded) == "etp 0, eep 0"
