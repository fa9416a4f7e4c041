"""The Llama 3 405B records' TP setting (Dubey et al. 2024, section 3.3.2 overlaps DP, PP and not TP; the
records run Megatron-Core's TP without --tp-comm-overlap) against hand computations of the sequence-parallel
collectives' bandwidth time."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from published import engine_of, graph_of, predict, records, with_alternative

from autoplan.cluster.load import Cluster
from autoplan.cost.layer import estimate_layer
from autoplan.graph.types import LayerRole
from autoplan.plan.types import ParallelConfig

# h100-roce-400g: NVLink 4 at 450 GB/s one way, ring bus bandwidth 0.822 of it (NCCL maintainer, nccl-tests#212)
NVLINK_BUSBW = 450e9 * 0.822
# the profile's NCCL latency model for one ring pass inside a node, Simple protocol (tuning.cc): 35 us per
# collective plus 3.4 us per ring step
BASE_S, SIMPLE_STEP_S = 35e-6, 3.4e-6
NCCL_SMS, NUM_SMS = 24, 132  # NCCL's channels inside an NVLink-4 node, one SM each; H100 SXM5's SMs


def _record(rid: str) -> dict:
    return next(r for r in records() if r["id"] == rid)


def _sp_collective_s(seq: int, h: int, tp: int, passes: int = 1) -> float:
    """`passes` ring passes (an SP all-gather or reduce-scatter 1, an all-reduce 2) over a [seq, h] bf16
    activation on tp ranks of one node: (t - 1)/t of the bytes each pass at the ring bus bandwidth, plus NCCL's
    Simple-protocol latency (base + one step latency per hop): the cheapest protocol at 256 MiB."""
    steps = passes * (tp - 1)
    return BASE_S + steps * SIMPLE_STEP_S + passes * (tp - 1) / tp * seq * h * 2 / NVLINK_BUSBW


def _block_tp_by_hand(c: float, f: float, bwd_overlap: bool) -> float:
    """One block's exposed TP seconds per microbatch, SP, no --tp-comm-overlap, no recompute (cost/layer.py
    _tp_comm_s): forward 2 all-gathers + 2 reduce-scatters exposed; backward the row-parallel linears' 2
    all-gathers exposed, the column-parallel linears' 2 input-gradient reduce-scatters each beside its
    weight-gradient GEMM and the 2 re-gathered inputs (cost.layer.sp_regathers) beside the input-gradient GEMMs,
    each of those exposing max(c - gemm, 0) + f min(c, gemm). The GEMMs outlast c = 0.69 ms: the smallest, QKV's
    (2 x 8192 x 16384 x 18432 / 8 = 6.2e11 FLOPs), takes 0.63 ms even at the 989 TFLOP/s peak and longer at
    any GEMM efficiency under 0.90, so each hidden collective exposes f c. Without the asynchronous backward all
    6 backward collectives are exposed."""
    return 4 * c + (6 * c if not bwd_overlap else 2 * c + 4 * f * c)


def test_llama3_8k_row_exposes_exactly_the_hand_counted_sp_collectives() -> None:
    """32 microbatches per DP rank; 126 blocks one per chunk over the 126 chunks between the embedding's (chunk
    0, rank 0) and the head's (chunk 127, rank 15) of 16 x 8 interleaved: ranks 1-14 hold 8 blocks, ranks 0
    and 15 seven and an embedding or head chunk of less TP time (each one 2-pass all-reduce, 1.35 ms, against a
    block's 4.67 ms), so the critical rank's tp_comm is 32 x 8 blocks of the hand count, f = 24 / 132 of a
    collective's hidden part. The no-asynchronous-backward alternative exposes all 10 of them; the TP-overlapped
    one (TE userbuffers) less than the forward's 4 alone."""
    rec = _record("llama3-405b-8192-cp1")
    assert rec["engine_overrides"]["tp_comm_overlap"] is False and rec["config"]["sp"] is True
    c, f = _sp_collective_s(8192, 16384, 8), NCCL_SMS / NUM_SMS
    assert c == pytest.approx(6.35e-4 + 5.88e-5, rel=1e-4)
    m = rec["global_batch"] // rec["config"]["dp"]
    assert m == 32
    tp = predict(rec).estimate.breakdown.tp_comm
    assert tp == pytest.approx(m * 8 * _block_tp_by_hand(c, f, True), rel=1e-9)
    assert tp == pytest.approx(1.1948, abs=1e-4)  # 32 x 8 x (6 c + 4 f c) by hand, for the reader
    sync = next(a for a in rec["alternatives"] if a["name"] == "no asynchronous backward TP")
    assert predict(with_alternative(rec, sync)).estimate.breakdown.tp_comm == pytest.approx(
        m * 8 * _block_tp_by_hand(c, f, False), rel=1e-9)
    alt = next(a for a in rec["alternatives"] if a["name"] == "TP overlapped (TE userbuffers)")
    overlapped = predict(with_alternative(rec, alt)).estimate.breakdown.tp_comm
    assert overlapped < m * 8 * 4 * c < tp


def test_llama3_8k_row_blocks_embedding_and_head_each_match_the_hand_count() -> None:
    """One block's LayerCost.tp_comm_s is the hand count; the vocab-parallel embedding's forward all-reduce of
    its [8192, 16384] output and the head's backward all-reduce of its input gradient are each one 2-pass ring
    all-reduce (NCCL's ring, cheaper than the tree inside one node here)."""
    rec = _record("llama3-405b-8192-cp1")
    costs = _layer_costs(rec)
    c, f = _sp_collective_s(8192, 16384, 8), NCCL_SMS / NUM_SMS
    assert costs[LayerRole.BLOCK].tp_comm_s == pytest.approx(_block_tp_by_hand(c, f, True), rel=1e-9)
    assert costs[LayerRole.BLOCK].fwd_comm_s == pytest.approx(4 * c, rel=1e-9)
    all_reduce = _sp_collective_s(8192, 16384, 8, passes=2)
    assert costs[LayerRole.EMBEDDING].tp_comm_s == pytest.approx(all_reduce, rel=1e-9)
    assert costs[LayerRole.HEAD].tp_comm_s == pytest.approx(all_reduce, rel=1e-9)
    assert costs[LayerRole.HEAD].fwd_comm_s == 0.0


def _layer_costs(rec: dict) -> dict:
    """The first block's, the embedding's and the head's LayerCost under the record's cluster, config, engine."""
    cl = rec["cluster"]
    cluster = dataclasses.replace(Cluster.load(cl["profile"], num_nodes=cl["gpus"] // 8), dtype=cl["dtype"])
    graph, config = graph_of(rec["model"]), ParallelConfig.from_dict(rec["config"])
    firsts = {}
    for layer in graph.layers:
        firsts.setdefault(layer.role, layer)
    return {role: estimate_layer(layer, cluster, config, config.recompute, seq_len=rec["model"]["seq_len"],
                                 graph_microbatch=graph.microbatch, engine=engine_of(rec))
            for role, layer in firsts.items() if role in (LayerRole.BLOCK, LayerRole.EMBEDDING, LayerRole.HEAD)}


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
