"""Overlapped pipeline p2p (Engine.pp_p2p_overlap: Megatron-Core's overlap_p2p_comm, interleaved schedule only)
against hand computations, and Megatron-Core r0.8.0 + Transformer Engine's activations under the interleaved
warm-up counted tensor by tensor."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from test_cost_graph_helper import every_zero_stage, gpt_graph

from autoplan import cost
from autoplan.cluster.load import Cluster
from autoplan.cost import comm, estimate_config, pipeline_time_s
from autoplan.cost.compute import BlockShape
from autoplan.cost.hetero import default_split
from autoplan.cost.layer import estimate_layer
from autoplan.cost.memory import block_activation_bytes
from autoplan.cost.p2p import overlapped_p2p_saving_s
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig, Recompute, Schedule
from autoplan.search.space import SCHEDULES, SearchOptions, enumerate_space
from autoplan.search.surrogate import quick_estimate

H, A, S, TP, B = 1024, 16, 1024, 4, 8
GRAPH = gpt_graph(h=H, a=A, layers=8, seq=S, vocab=8192, unfused=False)
CLUSTER = Cluster.load("dgx-h100-80gb", num_nodes=1)


def _slow(fraction: float):
    """CLUSTER with its NVLink p2p at `fraction` of the link: a 512 KiB hop of ~ms, against chunks of ~10 us."""
    return dataclasses.replace(CLUSTER, intra_node=dataclasses.replace(CLUSTER.intra_node, p2p_bw_fraction=fraction))


ON = every_zero_stage(Engine.load("megatron-core"))  # every schedule priced, to show which overlap
OFF = dataclasses.replace(ON, pp_p2p_overlap=False)


def _config(schedule: Schedule, v: int, pp: int = 2) -> ParallelConfig:
    return ParallelConfig(tp=TP, pp=pp, dp=8 // (TP * pp), sp=True, microbatch=1, schedule=schedule, virtual_stages=v)


def test_the_steady_state_loses_each_hop_but_its_nccl_share() -> None:
    """pp 2 x v 2: stages 0..3 on ranks 0, 1, 0, 1, three cuts, each touching both ranks. Each hop is the SP
    shard of the bf16 activation, s / tp x h x 2 bytes, over NVLink (the pp group inside the node), and its NCCL
    kernel holds nccl_sms of the num_sms SMs while it runs beside the chunks: the step falls by
    m x 3 x hop x (1 - nccl_sms / num_sms), the fill and drain keeping the hops."""
    config = _config(Schedule.INTERLEAVED, 2)
    m = B // config.dp
    hop = comm.p2p_s(S // TP * H * 2, False, CLUSTER)
    frac = CLUSTER.device.nccl_sms / CLUSTER.device.num_sms
    on = estimate_config(GRAPH, CLUSTER, config, global_batch=B, engine=ON)
    off = estimate_config(GRAPH, CLUSTER, config, global_batch=B, engine=OFF)
    assert 0 < frac < 1 and hop > 0
    assert math.isclose(off.step_time_s - on.step_time_s, m * 3 * hop * (1 - frac), rel_tol=1e-9)
    assert math.isclose(off.breakdown.pp_comm - on.breakdown.pp_comm, m * 3 * hop * (1 - frac), rel_tol=1e-9)
    assert math.isclose(on.breakdown.pp_comm, m * 3 * hop * frac, rel_tol=1e-9)  # what stays: the SMs it takes


def test_the_saving_is_capped_by_the_compute_it_hides_behind_by_hand() -> None:
    """core_r0.8.0 schedules.py: a transfer runs beside the one chunk computed before its wait; a 3 s hop beside a
    2 s chunk at a 1/4 SM share saves 2 x 3/4 = 1.5 s (the last second is waited out); a 1 s hop all but 1/4."""
    assert overlapped_p2p_saving_s(3.0, 0.25, 2.0) == 1.5
    assert overlapped_p2p_saving_s(1.0, 0.25, 2.0) == 0.75
    assert overlapped_p2p_saving_s(np.array([3.0, 1.0]), 0.25, np.array([2.0, 2.0])).tolist() == [1.5, 0.75]


def test_a_hop_longer_than_its_chunk_saves_only_the_chunk() -> None:
    """With the p2p 10^5 and 10^6 times slower (hops of 0.12 and 1.2 s against chunks under 2 ms), each hop
    saves, per microbatch, only its chunk x (1 - frac): the sending chunk's backward on its rank, the
    receiving chunk's forward on the other, summed by hand from the chunks' layer costs (forward fwd_s +
    fwd_comm_s, backward the rest of time_s). pp 2 x v 2, stages 0..3 on ranks 0, 1, 0, 1: rank 0 saves
    b0 + f2 + b2, rank 1 f1 + b1 + f3; the step (m max_r of the slots) falls by m x one rank's saving or
    between the two, the same at both speeds, where uncapped it fell by m x 3 x hop x (1 - frac)."""
    config = _config(Schedule.INTERLEAVED, 2)
    m = B // config.dp
    frac = CLUSTER.device.nccl_sms / CLUSTER.device.num_sms
    stages = default_split(GRAPH, CLUSTER, config, B)
    by_name = {layer.name: layer for layer in GRAPH.layers}

    def chunk(i: int) -> tuple[float, float]:  # (forward, backward) of one microbatch of stage i
        costs = [estimate_layer(by_name[n], CLUSTER, config, config.recompute, seq_len=GRAPH.seq_len,
                                graph_microbatch=GRAPH.microbatch, engine=ON) for n in stages[i]]
        fwd = sum(c.fwd_s + c.fwd_comm_s for c in costs)
        return fwd, sum(c.time_s for c in costs) - fwd

    (_, b0), (f1, b1), (f2, b2), (f3, _) = (chunk(i) for i in range(4))
    rank_saves = [m * (1 - frac) * x for x in (b0 + f2 + b2, f1 + b1 + f3)]
    saved = []
    for fraction in (1e-5, 1e-6):
        cluster = _slow(fraction)
        assert comm.p2p_s(S // TP * H * 2, False, cluster) > 50 * max(max(chunk(i)) for i in range(4))
        on, off = (estimate_config(GRAPH, cluster, config, global_batch=B, engine=e).step_time_s for e in (ON, OFF))
        saved.append(off - on)
    assert math.isclose(saved[0], saved[1], rel_tol=1e-9)
    assert min(rank_saves) * (1 - 1e-9) <= saved[0] <= max(rank_saves) * (1 + 1e-9)


def test_a_negative_steady_part_leaves_the_fill_and_drain_alone() -> None:
    """T = m max_r (X_r + steady_r) + (sum_r Y_r - max_r Y_r) / v with Y_r = X_r: p 2, v 2, m 4, F 1, B 2 and
    0.5 hidden per slot: 4 (3 - 0.5) + (6 - 3) / 2 = 11.5 (the bubble still (p - 1) X / v)."""
    t = pipeline_time_s("interleaved", 2, 2, 4, [1.0, 1.0], [2.0, 2.0], steady_s=[-0.5, -0.5])
    assert math.isclose(t, 11.5, rel_tol=1e-12)


def test_only_the_interleaved_schedule_overlaps() -> None:
    """validate_args (core_r0.8.0) turns overlap_p2p_comm off without virtual stages: 1F1B, zero bubble and a
    single stage price the same with the flag on or off."""
    for schedule, v, pp in ((Schedule.ONE_F_ONE_B, 1, 2), (Schedule.ZERO_BUBBLE, 1, 2), (Schedule.ZERO_BUBBLE, 2, 2),
                            (Schedule.ONE_F_ONE_B, 1, 1)):
        config = _config(schedule, v, pp)
        assert (estimate_config(GRAPH, CLUSTER, config, global_batch=B, engine=ON).step_time_s
                == estimate_config(GRAPH, CLUSTER, config, global_batch=B, engine=OFF).step_time_s), config


@pytest.mark.parametrize("fraction", [None, 1e-4])
def test_the_quick_estimate_moves_by_the_exact_seconds(fraction: float | None) -> None:
    """Also with hops longer than the chunks (the saving capped by each chunk: cost.p2p.chunk_slots_s), where
    each rank saves its own chunks and the step moves by the bottleneck rank's: on ranks near a tie the quick
    estimate (its X_r within ~0.05 % of the exact one's) may pick the other rank, 3.7 % apart on these rows
    (measured; bound 5 %)."""
    cluster = CLUSTER if fraction is None else _slow(fraction)
    space = enumerate_space(GRAPH, cluster, SearchOptions(global_batch=B))
    before = quick_estimate(GRAPH, cluster, space, B, cost.with_engine(OFF)).step_time_s
    after = quick_estimate(GRAPH, cluster, space, B, cost.with_engine(ON)).step_time_s
    cols = space.columns
    inter = np.flatnonzero(cols["schedule"] == SCHEDULES.index(Schedule.INTERLEAVED))
    other = np.flatnonzero((cols["pp"] > 1) & (cols["schedule"] != SCHEDULES.index(Schedule.INTERLEAVED)))
    assert len(inter) and len(other)
    rng = np.random.default_rng(0)
    rows = np.concatenate([rng.choice(inter, min(20, len(inter)), replace=False),
                           rng.choice(other, min(10, len(other)), replace=False)]).tolist()
    moved, worst = 0, 0.0
    for r in rows:
        config = space.config(r)
        want = (estimate_config(GRAPH, cluster, config, global_batch=B, engine=ON).step_time_s
                - estimate_config(GRAPH, cluster, config, global_batch=B, engine=OFF).step_time_s)
        if fraction is None or want == 0:
            assert math.isclose(after[r] - before[r], want, rel_tol=1e-6, abs_tol=1e-12), config
        else:
            worst = max(worst, abs((after[r] - before[r]) / want - 1))
        moved += want < 0
    assert moved >= min(20, len(inter))  # every interleaved row gained, no other row moved
    assert worst < 0.05


def test_only_megatron_core_overlaps_its_pipeline_p2p() -> None:
    assert not Engine().pp_p2p_overlap
    for name in Engine.names():
        assert Engine.load(name).pp_p2p_overlap == (name == "megatron-core"), name


def test_megatron_core_te_layer_activations_by_hand() -> None:
    """One GPT layer under Megatron-Core r0.8.0 + TE 1.7 / 1.8 with SP over t, GELU 4h MLP, hidden and attention
    dropout 0.1, bf16, per token (bytes): TELayerNormColumnParallelLinear (qkv) saves its input and ln_out, the
    local shard (transformer_engine/pytorch/module/layernorm_linear.py: save_for_backward(inputmat, ..., ln_out)),
    2h / t + 2h / t; FusedAttnFunc (attention.py) q, k, v and out, 8h / t (its softmax statistics, 4 a / t, and
    RNG state are left out; no dropout mask: the mask is regenerated from the RNG state), out being
    linear_proj's saved input; bias-dropout-add's mask, h / t (1 byte); fc1 as qkv, 4h / t; bias_gelu's input,
    the 4h / t fc1 output, 8h / t; linear_fc2's input, the GELU output, 8h / t; the second mask, h / t.
    Sum 34 h / t: Korthikanti et al.'s s b h 34 / t without the score term."""
    h, a, s, t = 18432, 144, 4096, 8
    shape = BlockShape(h=h, a=a, g=a, f=4 * h, n_mlp=2)  # GELU: a block with dropout (BlockShape.dropout)
    config = ParallelConfig(tp=t, sp=True)
    held, extra = block_activation_bytes(shape, 1, s, config, Recompute.NONE, 2, False, engine=ON)
    by_hand = s * (4 * h + 8 * h + h + 4 * h + 8 * h + 8 * h + h) / t
    assert held == by_hand and extra == 0.0


def test_the_462b_rank_zero_holds_the_interleaved_warm_up() -> None:
    """Megatron-LM README 937571cfd49d 462B on 6144 H100: tp 8, pp 16, dp 48, 112 layers, interleaved at V = 7
    (the only V the 7 layers per stage allow), m = 3072 / 48 = 64. Rank 0 runs (16 - 1) 2 + (7 - 1) 16 = 126
    warm-up chunk forwards (schedules.py forward_backward_pipelining_with_interleaving) and holds one more at
    its first steady forward: 127 chunks of one layer, plus the embedding's SP-sharded output over its 18 1/7
    microbatches; with the distributed optimizer it fits."""
    h, s, t = 18432, 4096, 8
    graph = gpt_graph(h=h, a=144, layers=112, seq=s, vocab=131072, unfused=False)
    cluster = dataclasses.replace(Cluster.load("dgx-h100-80gb", num_nodes=768), dtype="bf16")
    config = ParallelConfig(tp=t, pp=16, dp=48, sp=True, zero=1, microbatch=1, schedule=Schedule.INTERLEAVED,
                            virtual_stages=7)  # zero 1: --use-distributed-optimizer
    est = estimate_config(graph, cluster, config, global_batch=3072, engine=ON)
    per_layer = 34 * s * h / t
    embed = s * h / t  # gpt_graph's embedding activation (tok x h), split over tp with SP
    assert math.isclose(est.memory.activations, 127 / 7 * (7 * per_layer + embed), rel_tol=1e-6)
    assert est.fits and est.peak_mem_bytes < est.mem_capacity_bytes
