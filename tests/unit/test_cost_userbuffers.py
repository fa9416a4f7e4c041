"""Transformer Engine userbuffers' SM margin (Engine.tp_overlap_margin_sms, cost/userbuffers.py): the GEMMs
beside TE's reduce-scatter ('pipeline') and bulk overlaps run on num_sms - margin SMs for their whole run;
the ring-exchange all-gathers copy on the copy engines and take nothing. Checked against hand computations."""

from __future__ import annotations

import dataclasses
import math

from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan.cluster.load import Cluster
from autoplan.cost import estimate_layer
from autoplan.cost.userbuffers import MARGIN_OPS, margin_extra_s, op_margins
from autoplan.plan.engine import TE_UB_OPS, Engine
from autoplan.plan.types import ParallelConfig

PEAK = 312e12


def test_margin_halves_the_narrowed_gemms_on_half_the_sms() -> None:
    """32 SMs, margin 16: every GEMM below fills whole waves of 256 x 128 tiles on 32 and on 16 SMs and is
    compute-bound, so on half the SMs it takes twice as long: the extra is its full-device time, 2 m k n /
    peak. Forward: the projection [m x h/t] @ [h/t x h] and one of the n_mlp = 2 MLP matmuls; backward: the
    QKV and the other MLP matmul's dgrad and wgrad (2 x their forward FLOPs each)."""
    device = dataclasses.replace(a100_cluster(ideal=True).device, num_sms=32, gemm_epilogue_overlap=True)
    m, h, t, f, qkv_w = 8192, 4096, 8, 16384, 3 * 4096
    groups = [(m, h, qkv_w / t, 1.0), (m, h / t, h, 1.0), (m, h, f / t, 2.0)]
    fwd, bwd = margin_extra_s(device, PEAK, groups, 2, 2, 16, 4.0, False)
    assert math.isclose(fwd, (2 * m * h * h / t + 2 * m * h * f / t) / PEAK, rel_tol=1e-9)
    assert math.isclose(bwd, (2 * 2 * m * h * qkv_w / t + 2 * 2 * m * h * f / t) / PEAK, rel_tol=1e-9)
    assert margin_extra_s(device, PEAK, groups, 2, 2, 0, 4.0, False) == (0.0, 0.0)


def test_te_overlap_pays_the_margin_not_the_hidden_time() -> None:
    """Megatron-Core's block on DGX H100, tp = 8 with SP, communication hidden behind the GEMMs: with the
    margin the TP cost is the narrowed GEMMs' loss, the same whatever the link's speed (as long as the
    communication stays hidden); under NCCL's model (margin 0) it is 24 / 132 of the hidden time, which
    grows as the link slows."""
    h100 = Cluster.load("dgx-h100-80gb", num_nodes=1)
    block = gpt_graph(h=16384, a=128, layers=1, seq=4096, unfused=False).blocks[0]
    config = ParallelConfig(tp=8, sp=True, microbatch=1)
    te = dataclasses.replace(Engine.load("megatron-core"), tp_bwd_overlap=False)
    nccl = dataclasses.replace(te, tp_overlap_margin_sms=0)

    def tp_cost(engine: Engine, slow: float) -> tuple[float, float]:
        link = dataclasses.replace(h100.intra_node, bw_bytes_per_s=h100.intra_node.bw_bytes_per_s / slow)
        cost = estimate_layer(block, dataclasses.replace(h100, intra_node=link), config, "none", seq_len=4096,
                              engine=engine)
        return cost.fwd_comm_s, cost.tp_comm_s

    (f1, t1), (f2, t2) = tp_cost(te, 1.0), tp_cost(te, 1.5)
    assert f1 > 0 and math.isclose(f1, f2, rel_tol=1e-12) and math.isclose(t1, t2, rel_tol=1e-12)
    (n1, _), (n2, _) = tp_cost(nccl, 1.0), tp_cost(nccl, 1.5)
    assert n2 > 1.3 * n1 > 0  # 24 / 132 of the hidden time, whose bandwidth part grows 1.5 x
    # its size: the projection (h^2 / t per token) and the MLP output matmul (4 h^2 / t) at the profile's
    # large-GEMM rate, 132 / 116 times as long on 116 SMs: 16 / 116 of their time (wave quantization aside)
    flops = 2.0 * 4096 * (16384 * 16384 + 4 * 16384 * 16384) / 8
    hand = flops / (h100.peak_flops * h100.device.matmul_efficiency) * 16 / 116
    assert 0.8 < f1 / hand < 1.25, f1 / hand


def test_a_24_sm_forward_overlap_costs_its_gemm_24_of_132_sms_and_the_backward_nothing() -> None:
    """132 SMs (H100), proj_fprop num_sm 24 with set_sm_margin: the attention projection's forward GEMM
    [m x h/t] @ [h/t x h] runs on 108 SMs. Its output is (m / 256) x (h / 128) = 297 x 32 = 9504 tiles of
    256 x 128, whole waves on 132 SMs (72) and on 108 (88), compute-bound, so it takes 132 / 108 as long:
    the extra is 2 m (h / t) h / peak x 24 / 108. No other GEMM is narrowed: backward 0."""
    device = dataclasses.replace(a100_cluster(ideal=True).device, num_sms=132, gemm_epilogue_overlap=True)
    m, h, t, f = 256 * 297, 4096, 8, 16384
    groups = [(m, h, 3 * h / t, 1.0), (m, h / t, h, 1.0), (m, h, f / t, 2.0)]
    fwd, bwd = margin_extra_s(device, PEAK, groups, 2, 2, op_margins(Engine(tp_overlap_margin_sms_by_op={
        "proj_fprop": 24})), 4.0, False)
    assert math.isclose(fwd, 2 * m * (h / t) * h / PEAK * 24 / 108, rel_tol=1e-9)
    assert bwd == 0.0


def test_each_overlap_narrows_only_its_own_gemm() -> None:
    """32 SMs, margin 16 (half): qkv_wgrad alone doubles the QKV weight-gradient GEMM [h x m] @ [m x 3h/t]
    (h/128 x 3h/(128 t) = 32 x 12 tiles, whole waves on 32 and 16 SMs), extra 2 m h (3h/t) / peak in
    backward; fc2_fprop alone the MLP output matmul's forward (1 of the n_mlp = 2 in the MLP group), extra
    2 m h f / t / peak in forward. The uniform field keeps its meaning: 16 on the six pipeline / bulk ops."""
    device = dataclasses.replace(a100_cluster(ideal=True).device, num_sms=32, gemm_epilogue_overlap=True)
    m, h, t, f = 8192, 4096, 8, 16384
    groups = [(m, h, 3 * h / t, 1.0), (m, h / t, h, 1.0), (m, h, f / t, 2.0)]
    assert math.isclose(margin_extra_s(device, PEAK, groups, 2, 2, {"qkv_wgrad": 16}, 4.0, False)[1],
                        2 * m * h * 3 * h / t / PEAK, rel_tol=1e-9)
    assert margin_extra_s(device, PEAK, groups, 2, 2, {"qkv_wgrad": 16}, 4.0, False)[0] == 0.0
    fc2 = margin_extra_s(device, PEAK, groups, 2, 2, {"fc2_fprop": 16}, 4.0, False)
    assert math.isclose(fc2[0], 2 * m * h * f / t / PEAK, rel_tol=1e-9) and fc2[1] == 0.0
    assert op_margins(Engine(tp_overlap_margin_sms=16)) == {**dict.fromkeys(TE_UB_OPS, 0),
                                                            **dict.fromkeys(MARGIN_OPS, 16)}


def test_a_forward_only_margin_prices_the_backward_as_without_one() -> None:
    """The dgxc recipes' shape: margins on proj_fprop / fc2_fprop only. The forward TP cost is then the
    uniform-16 engine's (the same two forward GEMMs narrowed by 16, the same forward ops) and the backward's
    the no-margin engine's (NCCL's channels over the hidden time), both exactly."""
    h100 = Cluster.load("dgx-h100-80gb", num_nodes=1)
    block = gpt_graph(h=8192, a=64, layers=1, seq=4096, unfused=False).blocks[0]
    config = ParallelConfig(tp=8, sp=True, microbatch=1)
    uniform = dataclasses.replace(Engine.load("megatron-core"), tp_bwd_overlap=False)
    none = dataclasses.replace(uniform, tp_overlap_margin_sms=0)
    forward_only = dataclasses.replace(none, tp_overlap_margin_sms_by_op={"proj_fprop": 16, "fc2_fprop": 16})
    u, n, fo = (estimate_layer(block, h100, config, "none", seq_len=4096, engine=e)
                for e in (uniform, none, forward_only))
    assert math.isclose(fo.fwd_comm_s, u.fwd_comm_s, rel_tol=1e-12)
    assert math.isclose(fo.tp_comm_s - fo.fwd_comm_s, n.tp_comm_s - n.fwd_comm_s, rel_tol=1e-12)
    assert fo.fwd_comm_s != n.fwd_comm_s


def test_the_per_op_field_takes_a_mapping_and_refuses_unknown_ops(tmp_path) -> None:
    """A YAML mapping (and replace() with a dict) becomes sorted pairs that survive to_dict / JSON /
    from_dict; an op TE does not name is one clear line."""
    import json

    import pytest

    from autoplan.cluster.engines import parse_engine

    e = dataclasses.replace(Engine.load("megatron-core"), tp_overlap_margin_sms_by_op={"proj_fprop": 24, "fc2_fprop": 8})
    assert e.tp_overlap_margin_sms_by_op == (("fc2_fprop", 8), ("proj_fprop", 24))
    assert Engine.from_dict(json.loads(json.dumps(e.to_dict()))) == e and hash(e)
    with pytest.raises(ValueError, match="tp_overlap_margin_sms_by_op.*proj_fprop"):
        dataclasses.replace(e, tp_overlap_margin_sms_by_op={"proj_fwd": 24})
    with pytest.raises(ValueError, match="tp_overlap_margin_sms_by_op"):
        dataclasses.replace(e, tp_overlap_margin_sms_by_op={"proj_fprop": -1})
    with pytest.raises(ValueError, match="mine.yaml.*tp_overlap_margin_sms_by_op"):
        parse_engine({"schema_version": 1, "name": "x", "tp_overlap_margin_sms_by_op": {"qkv": 1}}, "mine.yaml")
