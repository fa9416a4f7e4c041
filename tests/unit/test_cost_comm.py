"""Collective costs and group placement of autoplan.cost.comm against hand-computed alpha-beta values."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan.cost import (
    GroupPlacement,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    estimate_layer,
    group_placement,
    p2p_s,
)
from autoplan.plan.types import MESH_AXIS_ORDER, ParallelConfig


def test_ring_all_reduce_inside_a_node() -> None:
    c = a100_cluster(1)
    group = GroupPlacement(size=8, num_nodes=1, per_node=8)
    expected = 2 * 7 * 5e-6 + 2 * 7 / 8 * 1e9 / (300e9 * 0.8)
    assert math.isclose(all_reduce_s(1e9, group, c), expected, rel_tol=1e-12)
    assert math.isclose(all_gather_s(1e9, group, c), expected / 2, rel_tol=1e-12)


def test_all_reduce_across_nodes_uses_the_nics() -> None:
    c = a100_cluster(8)
    one_per_node = GroupPlacement(size=8, num_nodes=8, per_node=1)
    ring = 2 * 7 * 10e-6 + 2 * 7 / 8 * 1e9 / (25e9 * 0.8)
    assert math.isclose(all_reduce_s(1e9, one_per_node, c), ring, rel_tol=1e-12)
    # 8 per node: the node's 8 NICs carry the ring, ~8x the bandwidth of one NIC
    full_nodes = GroupPlacement(size=64, num_nodes=8, per_node=8)
    assert all_reduce_s(1e9, full_nodes, c) < ring / 5


def test_tree_wins_only_for_tiny_messages() -> None:
    c = a100_cluster(64)
    group = GroupPlacement(size=64, num_nodes=64, per_node=1)
    ring_latency = 2 * 63 * 10e-6
    assert all_reduce_s(8.0, group, c) < ring_latency / 5  # log2(64) steps, not 63
    big = 1e9
    assert math.isclose(all_reduce_s(big, group, c), ring_latency + 2 * 63 / 64 * big / (25e9 * 0.8), rel_tol=1e-9)


def test_group_placement_follows_mesh_order() -> None:
    cfg = ParallelConfig(pp=2, dp=4, tp=8)
    assert group_placement(cfg, ("tp",), 8) == GroupPlacement(size=8, num_nodes=1, per_node=8)
    assert group_placement(cfg, ("dp",), 8) == GroupPlacement(size=4, num_nodes=4, per_node=1)
    assert group_placement(cfg, ("pp",), 8).num_nodes == 2
    small = ParallelConfig(dp=4, tp=2)
    assert group_placement(small, ("dp",), 8) == GroupPlacement(size=4, num_nodes=1, per_node=4)
    partial = ParallelConfig(dp=2, tp=6)  # a 12-rank job on 8-GPU nodes: the tp group of rank 0 fits,
    assert group_placement(partial, ("dp", "tp"), 8) == GroupPlacement(size=12, num_nodes=2, per_node=4)


def test_tp_across_nodes_is_far_slower_than_inside() -> None:
    """A tp=16 group over two 8-GPU nodes rides the nodes' NICs. With one 100 Gb/s NIC per two GPUs
    (vTrain's cluster) its all-reduces are several times slower than NVLink's; even with a DGX's eight
    200 Gb/s NICs per node (NCCL runs one ring per NIC) they stay slower."""
    g = gpt_graph(h=8192, a=64, layers=1, seq=2048)
    for nic_bw, factor in ((12.5e9, 2.0), (25e9, 1.3)):
        c = a100_cluster(2, nic_bw=nic_bw)
        inside = estimate_layer(g.blocks[0], c, ParallelConfig(tp=8, dp=2), "none", seq_len=2048)
        across = estimate_layer(g.blocks[0], c, ParallelConfig(tp=16), "none", seq_len=2048)
        assert across.tp_comm_s > factor * inside.tp_comm_s
    # per unit of work (tp=16 does half the FLOPs per GPU), communication dominates across nodes
    assert across.tp_comm_s / across.fwd_s > 2 * inside.tp_comm_s / inside.fwd_s


def test_all_to_all_and_p2p() -> None:
    c = a100_cluster(2)
    inter = GroupPlacement(size=16, num_nodes=2, per_node=8)
    expected = 15 * 10e-6 + max(7 / 16 * 1e9 / (300e9 * 0.8), 8 / 16 * 1e9 / (25e9 * 0.8))
    assert math.isclose(all_to_all_s(1e9, inter, c), expected, rel_tol=1e-12)
    assert math.isclose(p2p_s(1e9, True, c), 10e-6 + 1e9 / (25e9 * 0.8), rel_tol=1e-12)
    assert p2p_s(1e9, False, c) < p2p_s(1e9, True, c) / 5


def test_groups_of_one_cost_nothing() -> None:
    c = a100_cluster(1)
    one = GroupPlacement(size=1, num_nodes=1, per_node=1)
    assert all_reduce_s(1e9, one, c) == all_gather_s(1e9, one, c) == all_to_all_s(1e9, one, c) == 0.0


def test_group_placement_equals_brute_force_over_every_rank() -> None:
    # rank 0's group found by walking every rank's mesh coordinates (MESH_AXIS_ORDER, tp innermost):
    # the members are the ranks whose coordinates differ from 0 only on the group's axes
    rng = random.Random(0)
    names = [a.value for a in MESH_AXIS_ORDER]
    for _ in range(200):
        sizes = {n: rng.choice((1, 2, 3, 4, 8)) for n in names}
        axes = tuple(n for n in ("dp", "ep", "cp", "tp", "pp") if rng.random() < 0.5) or ("dp",)
        per_node = rng.choice((1, 2, 4, 6, 8, 16))
        config = ParallelConfig(**{n: sizes[n] for n in ("tp", "pp", "dp", "cp")})
        config = dataclasses.replace(config, ep=sizes["ep"]) if sizes["ep"] > 1 else config
        dims = [getattr(config, n) for n in names]
        members = []
        for rank, coords in enumerate(itertools.product(*[range(d) for d in dims])):
            if all(c == 0 for n, c in zip(names, coords) if n not in axes):
                members.append(rank)
        nodes: dict[int, int] = {}
        for r in members:
            nodes[r // per_node] = nodes.get(r // per_node, 0) + 1
        got = group_placement(config, axes, per_node)
        assert (got.size, got.num_nodes, got.per_node) == (len(members), len(nodes), min(nodes.values()))


def _megatron_groups(t: int, d: int, p: int) -> dict[str, list[int]]:
    """Rank 0's tp, dp and pp groups as Megatron-DeepSpeed builds them (megatron/core/parallel_state.py,
    initialize_model_parallel, commit c08e2cc2): tp = range(i t, (i + 1) t); pp = range(i, world, world / p);
    dp = range(start + j, start + world / p, t) inside pipeline block i. deepspeed.pipe's
    PipeModelDataParallelTopology (axes ['pipe', 'data', 'model'], row-major) gives the same ranks."""
    world = t * d * p
    return {"tp": list(range(t)), "pp": list(range(0, world, world // p)), "dp": list(range(0, world // p, t))}


def test_placement_is_megatron_deepspeed_rank_order() -> None:
    # the vTrain multi-node (t, d, p) grids on 8-GPU nodes: every group as its members' node counts
    grids = [(t, d, p) for t, d, p in itertools.product((1, 2, 4, 8, 16), (2, 4, 8, 16, 32, 64), (1, 2, 4, 8, 16, 32))
             if t * d * p in (64, 256, 512)]
    for t, d, p in grids:
        config = ParallelConfig(tp=t, dp=d, pp=p)
        for axis, members in _megatron_groups(t, d, p).items():
            nodes = [sum(1 for r in members if r // 8 == n) for n in sorted({r // 8 for r in members})]
            got = group_placement(config, (axis,), 8)
            assert (got.size, got.num_nodes, got.per_node) == (len(members), len(nodes), min(nodes)), (t, d, p, axis)
    # the 39.1B t=2 d=16 p=16 rows: tp inside a node, dp over 4 nodes with 4 members each, pp across nodes
    config = ParallelConfig(tp=2, dp=16, pp=16)
    assert group_placement(config, ("tp",), 8) == GroupPlacement(size=2, num_nodes=1, per_node=2)
    assert group_placement(config, ("dp",), 8) == GroupPlacement(size=16, num_nodes=4, per_node=4)
    assert group_placement(config, ("pp",), 8) == GroupPlacement(size=16, num_nodes=16, per_node=1)
