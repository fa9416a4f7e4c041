"""TE userbuffers' communication SMs beside a full-width GEMM (Engine.tp_overlap_comm_sms_by_op,
cost/userbuffers.comm_contention_s): a pipeline / bulk overlap with set_sm_margin 0 runs its all-gather or
reduce-scatter kernel on num_sm CTAs while its GEMM runs on every SM, so the GEMM loses num_sm / num_sms of
the SMs for the communication's duration. Checked against hand computations."""

from __future__ import annotations

import dataclasses
import math

import pytest
from test_cost_graph_helper import gpt_graph

from autoplan.cluster.load import Cluster
from autoplan.cost import comm, estimate_layer
from autoplan.cost.userbuffers import comm_contention_s
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig

RECIPE_70B = {"qkv_dgrad": 4, "qkv_wgrad": 24, "fc1_dgrad": 2, "fc1_wgrad": 4}  # llama3.1_70b.yaml, bulk, margin 0


def test_each_margin_free_overlap_holds_its_own_sms_for_its_collective() -> None:
    """132 SMs, all-gather 1 s, reduce-scatter 2 s, proj_fprop with a 24-SM margin: forward, only fc2_fprop's
    reduce-scatter (16 SMs) counts (proj_fprop's comm runs on its margin SMs): 16 / 132 x 2; backward, the
    bulk all-gathers qkv_dgrad 4 + fc1_dgrad 2 over 1 s and the bulk reduce-scatters qkv_wgrad 24 + fc1_wgrad 4
    over 2 s: (6 x 1 + 28 x 2) / 132."""
    engine = Engine(tp_overlap_margin_sms_by_op={"proj_fprop": 24},
                    tp_overlap_comm_sms_by_op={"proj_fprop": 24, "fc2_fprop": 16, **RECIPE_70B})
    fwd, bwd = comm_contention_s(engine, 132, 1.0, 2.0)
    assert math.isclose(fwd, 16 / 132 * 2.0, rel_tol=1e-12)
    assert math.isclose(bwd, (6 * 1.0 + 28 * 2.0) / 132, rel_tol=1e-12)
    assert comm_contention_s(Engine(), 132, 1.0, 2.0) == (0.0, 0.0)
    assert comm_contention_s(engine, 0, 1.0, 2.0) == (0.0, 0.0)  # a CPU profile: no SM counts


def _block_costs(engines: list[Engine]):
    h100 = Cluster.load("dgx-h100-80gb", num_nodes=1)
    block = gpt_graph(h=16384, a=128, layers=1, seq=4096, unfused=False).blocks[0]
    config = ParallelConfig(tp=8, sp=True, microbatch=1)
    costs = [estimate_layer(block, h100, config, "none", seq_len=4096, engine=e) for e in engines]
    group = comm.group_placement(config, ("tp",), h100.devices_per_node)
    hidden = 1 * 4096 * 16384 * 2  # b s h in bf16
    return costs, comm.all_gather_s(hidden, group, h100), comm.reduce_scatter_s(hidden, group, h100)


def test_the_block_pays_the_recipes_sms_over_each_collective_in_place_of_nccls_channels() -> None:
    """DGX H100, tp 8 with SP, no margin, the TP communication hidden behind the GEMMs (h = 16384): without
    the field, each phase pays NCCL's 24 / 132 of its collectives (forward 2 all-gathers + 2 reduce-scatters,
    backward 4 + 2 with the two re-gathered inputs: cost.layer.sp_regathers); with the 70B recipe's
    bulk SMs, the forward pays nothing (its all-gathers copy on the copy engines, its reduce-scatters unlisted)
    and the backward (4 + 2) / 132 of an all-gather plus (24 + 4) / 132 of a reduce-scatter."""
    base = dataclasses.replace(Engine.load("megatron-core"), tp_bwd_overlap=False, tp_overlap_margin_sms=0)
    recipe = dataclasses.replace(base, tp_overlap_comm_sms_by_op=RECIPE_70B)
    (nccl, te), ag, rs = _block_costs([base, recipe])
    assert math.isclose(nccl.fwd_comm_s, 24 / 132 * (2 * ag + 2 * rs), rel_tol=1e-9)  # hidden: proxy of it all
    assert math.isclose(nccl.tp_comm_s, 24 / 132 * (2 * ag + 2 * rs) + 24 / 132 * (4 * ag + 2 * rs), rel_tol=1e-9)
    assert te.fwd_comm_s == pytest.approx(0.0, abs=1e-15)
    assert math.isclose(te.tp_comm_s, (6 * ag + 28 * rs) / 132, rel_tol=1e-9)


def test_nccls_channel_count_on_every_forward_op_is_the_proxy() -> None:
    """The forward's four overlaps (2 all-gathers, 2 reduce-scatters) each holding 24 SMs: exactly NCCL's
    24-channel proxy over the forward's hidden communication; the 2024 megatron-core-h100 records' TE 1.x
    default (16 SMs on the six pipeline / bulk ops) prices the forward at 16 / 132 of its 2 reduce-scatters."""
    base = dataclasses.replace(Engine.load("megatron-core"), tp_bwd_overlap=False, tp_overlap_margin_sms=0)
    forward_24 = dataclasses.replace(base, tp_overlap_comm_sms_by_op={
        "qkv_fprop": 24, "proj_fprop": 24, "fc1_fprop": 24, "fc2_fprop": 24})
    te1 = dataclasses.replace(base, tp_overlap_comm_sms_by_op=dict.fromkeys(
        ("proj_fprop", "fc2_fprop", "qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad"), 16))
    (nccl, f24, t1), ag, rs = _block_costs([base, forward_24, te1])
    assert math.isclose(f24.fwd_comm_s, nccl.fwd_comm_s, rel_tol=1e-12)
    assert math.isclose(t1.fwd_comm_s, 16 / 132 * 2 * rs, rel_tol=1e-9)
    assert math.isclose(t1.tp_comm_s - t1.fwd_comm_s, 16 / 132 * (2 * ag + 2 * rs), rel_tol=1e-9)


def test_the_comm_field_takes_a_mapping_and_refuses_unknown_ops() -> None:
    """Same format as tp_overlap_margin_sms_by_op: sorted pairs from a mapping, an unknown op or a negative
    count one clear line naming the field."""
    e = Engine(tp_overlap_comm_sms_by_op={"qkv_wgrad": 24, "fc1_dgrad": 2})
    assert e.tp_overlap_comm_sms_by_op == (("fc1_dgrad", 2), ("qkv_wgrad", 24))
    with pytest.raises(ValueError, match="tp_overlap_comm_sms_by_op.*qkv_fprop"):
        Engine(tp_overlap_comm_sms_by_op={"qkv": 2})
    with pytest.raises(ValueError, match="tp_overlap_comm_sms_by_op"):
        Engine(tp_overlap_comm_sms_by_op={"qkv_wgrad": -1})


def test_an_early_stopping_recompute_runs_no_fc2_reduce_scatter() -> None:
    """Full recompute, pipeline overlaps holding 16 SMs each: the recompute re-runs the forward's overlaps,
    proj_fprop and fc2_fprop (16 / 132 of 2 reduce-scatters); one that stops before the MLP output projection
    (engine.recompute_early_stop) runs proj_fprop's only: the TP cost is 16 / 132 of one reduce-scatter less."""
    h100 = Cluster.load("dgx-h100-80gb", num_nodes=1)
    block = gpt_graph(h=16384, a=128, layers=1, seq=4096, unfused=False).blocks[0]
    config = ParallelConfig(tp=8, sp=True, microbatch=1)
    base = dataclasses.replace(Engine.load("megatron-core"), tp_bwd_overlap=False, tp_overlap_margin_sms=0,
                               tp_overlap_comm_sms_by_op={"proj_fprop": 16, "fc2_fprop": 16})
    full, early = (estimate_layer(block, h100, config, "full", seq_len=4096,
                                  engine=dataclasses.replace(base, recompute_early_stop=stop)) for stop in (False, True))
    group = comm.group_placement(config, ("tp",), h100.devices_per_node)
    rs = comm.reduce_scatter_s(4096 * 16384 * 2, group, h100)
    assert math.isclose(full.tp_comm_s - early.tp_comm_s, 16 / 132 * rs, rel_tol=1e-9)
    assert math.isclose(full.tp_comm_s - full.fwd_comm_s, 16 / 132 * 2 * rs, rel_tol=1e-9)  # rec only: bwd lists none
