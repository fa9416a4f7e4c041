"""bench/vtrain_groups.py (validate_vtrain.py --groups) against hand computations on made-up rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from vtrain_groups import GROUPINGS, group_errors, share_beyond


def _row(t: int, d: int, mb: int, gpus: int = 64, batch: int = 512) -> dict[str, float]:
    return {"tensor parallelism": t, "data parallelism": d, "pipeline parallelism": gpus // (t * d),
            "micro batch": mb, "# GPUs": gpus, "global batch": batch, "hidden size": 3072}


def test_group_errors_medians_and_mape_shares_by_hand():
    pairs = [(0.10, _row(1, 64, 8)), (-0.30, _row(2, 32, 8)), (0.20, _row(2, 32, 4))]
    got = group_errors(pairs, GROUPINGS["t"])
    # sum |e| = 0.6: t=1 holds 0.1 of it, t=2 0.5; t=2's median of (-0.3, 0.2) is -0.05
    assert [(v, n) for v, n, _, _ in got] == [(1, 1), (2, 2)]
    assert [med for _, _, med, _ in got] == pytest.approx([0.10, -0.05])
    assert [share for _, _, _, share in got] == pytest.approx([0.1 / 0.6, 0.5 / 0.6])


def test_share_beyond_threshold_by_hand():
    pairs = [(0.10, _row(1, 64, 8)), (-0.30, _row(2, 32, 8)), (0.20, _row(2, 32, 4))]
    count, share, rest = share_beyond(pairs, 0.15)
    assert count == 2  # |-0.30| and 0.20 are past 0.15
    assert share == pytest.approx(0.5 / 0.6)
    assert rest == pytest.approx(0.10 / 3)  # the MAPE over all three rows with only the 0.10 row left


def test_derived_groupings_microbatches_and_nodes():
    # 3.6B t=8 d=8 mb=64 of vTrain's multi-node file: 512 / (8 x 64) = 1 micro-batch, 64 GPUs on 8 nodes
    assert GROUPINGS["microbatches"](_row(8, 8, 64)) == 1
    assert GROUPINGS["microbatches"](_row(8, 8, 2)) == 32
    assert GROUPINGS["nodes"](_row(8, 8, 2)) == 8
    # a single-node row with d x mb above the global batch still runs one micro-batch; 4 GPUs are one node
    assert GROUPINGS["microbatches"](_row(1, 4, 8, gpus=4, batch=16)) == 1
    assert GROUPINGS["nodes"](_row(1, 4, 8, gpus=4, batch=16)) == 1
