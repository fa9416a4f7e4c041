"""The Llama 3 405B records' TP setting (Dubey et al. 2024, section 3.3.2 overlaps DP, PP and not TP; the
records run Megatron-Core's TP without --tp-comm-overlap) against hand computations of the sequence-parallel
collectives' bandwidth time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from published import predict, records, with_alternative

# h100-roce-400g: NVLink 4 at 450 GB/s one way, ring bus bandwidth 0.822 of it (NCCL maintainer, nccl-tests#212)
NVLINK_BUSBW = 450e9 * 0.822


def _record(rid: str) -> dict:
    return next(r for r in records() if r["id"] == rid)


def _sp_collective_s(seq: int, h: int, tp: int) -> float:
    """One SP all-gather (or reduce-scatter) of a [seq, h] bf16 activation over tp ranks: (t - 1)/t of the
    bytes at the ring bus bandwidth, no latency (a lower bound on comm.all_gather_s)."""
    return (tp - 1) / tp * seq * h * 2 / NVLINK_BUSBW


def test_llama3_8k_row_exposes_the_forward_sp_collectives_without_tp_overlap() -> None:
    """With tp_comm_overlap false nothing hides the forward's two all-gathers and two reduce-scatters per
    block (Megatron-Core's async backward only overlaps the backward's): 32 microbatches x 7 blocks (the
    first rank's, the fewest) x 4 x 0.635 ms = 0.57 s at least; at most every one of the 8 collectives per
    block of the 8 blocks exposed, with NCCL's ~60 us per collective of latency: 32 x 8 x 8 x 0.70 ms.
    Under the TP-overlapped alternative (TE userbuffers) less than the forward's bound is exposed."""
    rec = _record("llama3-405b-8192-cp1")
    assert rec["engine_overrides"]["tp_comm_overlap"] is False
    one = _sp_collective_s(8192, 16384, 8)
    assert one == pytest.approx(6.35e-4, rel=0.01)
    m = rec["global_batch"] // rec["config"]["dp"]
    assert m == 32
    tp = predict(rec).estimate.breakdown.tp_comm
    assert m * 7 * 4 * one <= tp <= m * 8 * 8 * (one + 6e-5)
    alt = next(a for a in rec["alternatives"] if a["name"] == "TP overlapped (TE userbuffers)")
    overlapped = predict(with_alternative(rec, alt)).estimate.breakdown.tp_comm
    assert overlapped < m * 7 * 4 * one < tp


def test_llama3_tp_overlap_off_drops_te_userbuffers_from_memory() -> None:
    """TE's userbuffers exist only under --tp-comm-overlap (cost/reserve.py): 10 buffers of [s b / cp, h]
    bf16 = 10 x 8192 x 16384 x 2 bytes = 2.5 GiB, and the cuBLAS workspaces of TE's two extra userbuffer
    streams (2 x 32 MiB on sm90: transformer_engine base.py get_cublas_workspace_size_bytes), leave the
    reserve when the records turn it off."""
    rec = _record("llama3-405b-8192-cp1")
    alt = next(a for a in rec["alternatives"] if a["name"] == "TP overlapped (TE userbuffers)")
    off = predict(rec).estimate.memory.reserve
    on = predict(with_alternative(rec, alt)).estimate.memory.reserve
    assert on - off == pytest.approx(10 * 8192 * 16384 * 2 + 2 * 32 * 2**20, rel=1e-9)


@pytest.mark.parametrize("rid", ["llama3-405b-8192-cp1", "llama3-405b-16384-cp1", "llama3-405b-16384-cp16"])
def test_llama3_records_quote_the_paper_and_keep_the_overlapped_tp_as_an_alternative(rid: str) -> None:
    rec = _record(rid)
    assert rec["engine_overrides"]["tp_comm_overlap"] is False
    assert "we adopt asynchronous point-to-point communication in PP" in rec["source"]
    names = {a["name"]: a["engine_overrides"] for a in rec["alternatives"] if "engine_overrides" in a}
    assert names["TP overlapped (TE userbuffers)"] == {"tp_comm_overlap": True}
    assert names["no asynchronous backward TP"] == {"tp_bwd_overlap": False}
