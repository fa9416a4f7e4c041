"""Megatron's sequence-parallel column-parallel linears all-gather their saved input shard again in backward for
the weight gradient (cost.layer.sp_regathers; megatron/core/tensor_parallel/layers.py
LinearWithGradAccumulationAndAsyncCommunication.backward): two more all-gathers of b s h per dense block,
exposed on the compute stream, or beside the input-gradient GEMM under tp_bwd_overlap; none where the
gathered input is kept (sp_saves_gathered_input: DTensor, torchtitan, autoplan's executor)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan.cost import comm, estimate_layer
from autoplan.cost.layer import sp_regathers
from autoplan.cost.overlap import contention_fraction
from autoplan.cost.types import GroupPlacement
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig

IDEAL = a100_cluster(ideal=True)
H, A, S, B, T = 8192, 64, 2048, 4, 8


def _tp_s(engine: Engine, cluster=IDEAL, sp: bool = True) -> float:
    block = gpt_graph(h=H, a=A, layers=1, seq=S).blocks[0]
    config = ParallelConfig(tp=T, sp=sp, microbatch=B)
    return estimate_layer(block, cluster, config, "none", seq_len=S, engine=engine).tp_comm_s


def _ag(cluster=IDEAL) -> float:
    return comm.all_gather_s(B * S * H * 2, GroupPlacement(size=T, num_nodes=1, per_node=T), cluster)


def test_megatron_sp_pays_two_more_all_gathers_in_backward_on_the_compute_stream() -> None:
    shard, kept = (dataclasses.replace(Engine(), sp_saves_gathered_input=flag) for flag in (False, True))
    rs = comm.reduce_scatter_s(B * S * H * 2, GroupPlacement(size=T, num_nodes=1, per_node=T), IDEAL)
    # forward 2 (AG + RS), backward 2 (AG + RS): 4 AG + 4 RS kept; the shard-saving engine adds 2 AG
    assert math.isclose(_tp_s(kept), 4 * _ag() + 4 * rs, rel_tol=1e-9)
    assert math.isclose(_tp_s(shard) - _tp_s(kept), 2 * _ag(), rel_tol=1e-9)
    assert _tp_s(shard, sp=False) == _tp_s(kept, sp=False)  # no SP: nothing is re-gathered


@pytest.mark.parametrize("nvlink_bw", [300e9, 3e9])
def test_under_async_backward_tp_each_regather_hides_behind_its_input_gradient_gemm(nvlink_bw: float) -> None:
    """tp_bwd_overlap: each re-gather runs beside its linear's input-gradient GEMM, priced at the weight-gradient
    GEMM's time (the same FLOPs, 2 T h 3h / t and 2 T h 4h / t at peak on the ideal device): exposed
    max(0, AG - GEMM) + f min(AG, GEMM) each; a slow link exposes most of it, a fast one only the contention."""
    cluster = dataclasses.replace(IDEAL, intra_node=dataclasses.replace(IDEAL.intra_node, bw_bytes_per_s=nvlink_bw))
    over = dataclasses.replace(Engine(), tp_bwd_overlap=True)
    extra = _tp_s(dataclasses.replace(over, sp_saves_gathered_input=False), cluster) - _tp_s(
        dataclasses.replace(over, sp_saves_gathered_input=True), cluster)
    ag, f = _ag(cluster), contention_fraction(cluster)
    gemms = (2.0 * B * S * H * 3 * H / T / 312e12, 2.0 * B * S * H * 4 * H / T / 312e12)
    assert math.isclose(extra, sum(max(ag - g, 0.0) + f * min(ag, g) for g in gemms), rel_tol=1e-6)


def test_regathers_counted_only_where_the_shard_is_saved() -> None:
    from autoplan.cost.shapes import block_shape

    block = gpt_graph(h=H, a=A, layers=1, seq=S).blocks[0]
    shape = block_shape(block, float(S))  # the helper's graph: one sequence of S tokens per microbatch
    assert shape is not None and shape.n_mlp == 2 and not shape.num_experts
    shard = dataclasses.replace(Engine(), sp_saves_gathered_input=False)
    assert sp_regathers(shape, ParallelConfig(tp=T, sp=True), shard) == 2
    assert sp_regathers(shape, ParallelConfig(tp=T, sp=False), shard) == 0
    assert sp_regathers(shape, ParallelConfig(tp=1, sp=True), shard) == 0
    assert sp_regathers(shape, ParallelConfig(tp=T, sp=True), Engine.load("torchtitan")) == 0
    assert sp_regathers(shape, ParallelConfig(tp=T, sp=True), Engine.load("megatron-core")) == 2


def test_under_te_overlap_the_regathers_join_the_backward_phase_its_gemms_hide() -> None:
    """tp_comm_overlap with SP (no TE margin, no per-op SMs): the backward phase exposes max(0, comm - GEMMs)
    plus contention on the hidden part; on a link slow enough that the phase's 2 AG + 2 RS already outlast its
    GEMMs, the shard-saving engine's 2 more all-gathers are exposed whole (slope 1 past the GEMMs)."""
    cluster = dataclasses.replace(IDEAL, intra_node=dataclasses.replace(IDEAL.intra_node, bw_bytes_per_s=3e9))
    te = dataclasses.replace(Engine(), tp_comm_overlap=True)
    gemm_bwd = 2 * 2.0 * B * S * 12 * H * H / T / 312e12  # dgrad + wgrad of the block's 12 h^2 weights, at peak
    assert 4 * _ag(cluster) > gemm_bwd  # the kept engine's backward comm (2 AG + 2 RS) outlasts its GEMMs
    extra = _tp_s(dataclasses.replace(te, sp_saves_gathered_input=False), cluster) - _tp_s(
        dataclasses.replace(te, sp_saves_gathered_input=True), cluster)
    assert math.isclose(extra, 2 * _ag(cluster), rel_tol=1e-9)


def test_a_routed_expert_block_regathers_the_qkv_and_shared_expert_inputs() -> None:
    from autoplan.cost.shapes import block_shape

    shape = block_shape(gpt_graph(h=H, a=A, layers=1, seq=S).blocks[0], float(S))
    shard = dataclasses.replace(Engine(), sp_saves_gathered_input=False)
    moe = dataclasses.replace(shape, num_experts=8)  # its experts' inputs come through the token dispatcher
    assert sp_regathers(moe, ParallelConfig(tp=T, sp=True), shard) == 1
    for shared in (1, 2):  # Megatron's SharedExpertMLP: the shared experts as one column-parallel MLP input
        assert sp_regathers(dataclasses.replace(moe, num_shared=shared), ParallelConfig(tp=T, sp=True), shard) == 2
