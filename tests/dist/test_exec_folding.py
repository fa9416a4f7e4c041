"""MoE parallel folding on gloo: tiny-moe plans whose experts take their own layout (etp, eep) over the
ranks of a stage train like the single-process reference (losses to 1e-5, parameters to 1e-4)."""

from __future__ import annotations

import pytest
import torch._dynamo  # noqa: F401  (DTensor imports it on first use: ~5 s per forked rank unless done here)
from harness import assert_matches_reference, reference, run_plan

from autoplan.plan.types import ParallelConfig

pytestmark = pytest.mark.dist

MODEL = "tiny-moe"


@pytest.mark.parametrize("config", [
    ParallelConfig(tp=2, dp=2, etp=1, eep=4),
    ParallelConfig(tp=2, dp=2, etp=1, eep=2, zero=3, sp=True),
    ParallelConfig(pp=2, tp=2, etp=1, eep=2, microbatch=2),
    ParallelConfig(cp=2, dp=2, eep=4, zero=1),
], ids=["tp2-etp1-eep4", "tp2sp-etp1-eep2-fsdp", "pp2xtp2-etp1-eep2", "cp2xdp2-eep4-zero1"])
def test_folded_moe_plans_train_like_the_reference(config: ParallelConfig) -> None:
    """Dense layers on (dp, ep, cp, tp), experts on (edp, eep, etp) over the same 4 ranks: tokens split over
    tp before the experts, the all-to-all over eep, expert gradients averaged over edp (1 or 2 here)."""
    assert config.folded and config.num_devices == 4
    assert_matches_reference(run_plan(MODEL, config, steps=3), reference(MODEL, steps=3))
