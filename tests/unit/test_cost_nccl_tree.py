"""NCCL's tree all-reduce and the ring's inter-node hop count in autoplan.cost.comm, against hand computations
with the NCCL latency model's terms (src/graph/tuning.cc ncclTopoTuneModel) written out in each test."""

from __future__ import annotations

import dataclasses
import math

import pytest
from test_cost_graph_helper import a100_cluster, write_profile_variant

from autoplan.cluster.load import Cluster
from autoplan.cost import GroupPlacement, all_gather_s, all_reduce_s

BASE, LL, SIMPLE, NET_LL, NET_SIMPLE = 35e-6, 0.6e-6, 3.4e-6, 2.7e-6, 14e-6
TREE_NVL, TREE_NET = 1.25e-6, 8.5e-6


def _nccl_cluster(num_nodes: int, *, tree_ratio: float = 0.625):
    """a100_cluster with NCCL's two ring protocols (LL latency_s / Simple simple_latency_s, LL at half the bus
    bandwidth, no LL cap) and tree hop latencies on both links."""
    c = a100_cluster(num_nodes)
    intra = dataclasses.replace(c.intra_node, latency_s=LL, simple_latency_s=SIMPLE, base_latency_s=BASE,
                                tree_latency_s=TREE_NVL)
    inter = dataclasses.replace(c.inter_node, latency_s=NET_LL, simple_latency_s=NET_SIMPLE,
                                tree_latency_s=TREE_NET, tree_busbw_ratio=tree_ratio)
    return dataclasses.replace(c, intra_node=intra, inter_node=inter)


def _ring(n: int, per_node: int, passes: int, nbytes: float, bw: float, inter_steps: int) -> float:
    """The cheaper of LL (half the bandwidth) and Simple for a ring with `inter_steps` network hops."""
    intra_steps = passes * (n - 1) - inter_steps
    volume = passes * (n - 1) / n * nbytes
    ll = BASE + intra_steps * LL + inter_steps * NET_LL + volume / (0.5 * bw)
    simple = BASE + intra_steps * SIMPLE + inter_steps * NET_SIMPLE + volume / bw
    return min(ll, simple)


def test_tree_latency_counts_the_intra_node_chain_and_log2_levels() -> None:
    c = _nccl_cluster(40)
    group = GroupPlacement(size=320, num_nodes=40, per_node=8)
    tiny = 64.0
    # NCCL: base + 2 ((ppn - 1) x intra hop + log2i(nNodes) x inter hop); log2i(40) = 5 (floor)
    tree = BASE + 2 * (7 * TREE_NVL + 5 * TREE_NET) + 2 * tiny / (8 * 25e9 * 0.8 * 0.625)
    assert math.isclose(all_reduce_s(tiny, group, c), tree, rel_tol=1e-12)


def test_tree_bandwidth_below_the_ring_hands_large_messages_back_to_the_ring() -> None:
    c = _nccl_cluster(40)
    group = GroupPlacement(size=320, num_nodes=40, per_node=8)
    big = 4e9
    bw = min(300e9 * 0.8, 8 * 25e9 * 0.8)  # ring: min(NVLink bus bw, the node's 8 NICs)
    ring = _ring(320, 8, 2, big, bw, inter_steps=80)  # ceil(2 x 319 / 8) = 80 network hops
    tree = BASE + 2 * (7 * TREE_NVL + 5 * TREE_NET) + 2 * big / (8 * 25e9 * 0.8 * 0.625)
    assert ring < tree
    assert math.isclose(all_reduce_s(big, group, c), ring, rel_tol=1e-12)
    # at the ring's fraction the tree would have won: its bandwidth term is what hands the message back
    same_bw = _nccl_cluster(40, tree_ratio=1.0)
    assert all_reduce_s(big, group, same_bw) < ring


def test_two_nodes_keep_the_rings_fraction_for_the_tree() -> None:
    c = _nccl_cluster(2, tree_ratio=0.1)
    group = GroupPlacement(size=16, num_nodes=2, per_node=8)
    s = 1e6
    tree = BASE + 2 * (7 * TREE_NVL + 1 * TREE_NET) + 2 * s / (8 * 25e9 * 0.8)
    ring = _ring(16, 8, 2, s, min(300e9 * 0.8, 8 * 25e9 * 0.8), inter_steps=4)
    assert tree < ring
    assert math.isclose(all_reduce_s(s, group, c), tree, rel_tol=1e-12)


def test_ring_network_hops_follow_the_node_ordered_ring() -> None:
    c = _nccl_cluster(2)
    group = GroupPlacement(size=16, num_nodes=2, per_node=8)
    s = 64e6
    bw = min(300e9 * 0.8, 8 * 25e9 * 0.8)
    # all-gather: a chunk's 15 hops cross the network ceil(15 / 8) = 2 times, not nodes - 1 = 1
    assert math.isclose(all_gather_s(s, group, c), _ring(16, 8, 1, s, bw, inter_steps=2), rel_tol=1e-12)
    # one GPU per node: every hop crosses the network, passes x (nodes - 1)
    c8 = _nccl_cluster(8)
    one_each = GroupPlacement(size=8, num_nodes=8, per_node=1)
    assert math.isclose(all_gather_s(s, one_each, c8), _ring(8, 1, 1, s, 25e9 * 0.8, inter_steps=7),
                        rel_tol=1e-12)


def test_profiles_without_tree_fields_keep_the_old_tree() -> None:
    c = a100_cluster(64)  # no tree fields: inter hop at latency_s, no chain, the ring's fraction
    group = GroupPlacement(size=64, num_nodes=64, per_node=1)
    assert math.isclose(all_reduce_s(8.0, group, c), 2 * 6 * 10e-6 + 2 * 8.0 / (25e9 * 0.8), rel_tol=1e-12)


def test_shipped_a100_profile_prices_the_tree_below_the_ring_bandwidth() -> None:
    spec = Cluster.load("dgx-a100-80gb", num_nodes=64)
    inter = spec.inter_node
    assert 0 < inter.tree_busbw_ratio < 1
    assert spec.intra_node.tree_latency_s > 0 and inter.tree_latency_s > 0


LL128_NVL, LL128_NET = 1.9e-6, 4.0e-6


def _ll128_cluster(num_nodes: int):
    c = _nccl_cluster(num_nodes)
    return dataclasses.replace(c, intra_node=dataclasses.replace(c.intra_node, ll128_latency_s=LL128_NVL),
                               inter_node=dataclasses.replace(c.inter_node, ll128_latency_s=LL128_NET))


def test_ll128_wins_mid_size_rings_at_092_of_the_bus_bandwidth() -> None:
    c = _ll128_cluster(1)
    group = GroupPlacement(size=8, num_nodes=1, per_node=8)
    s, bw = 8e6, 300e9 * 0.8
    ll128 = BASE + 14 * LL128_NVL + 2 * 7 / 8 * s / (0.92 * bw)  # tuning.cc: busBw * 0.92, hwLat 1.9 us
    assert ll128 < _ring(8, 8, 2, s, bw, inter_steps=0)  # below both LL and Simple
    assert math.isclose(all_reduce_s(s, group, c), ll128, rel_tol=1e-12)
    huge = 4e9  # Simple's full bandwidth wins again
    assert math.isclose(all_reduce_s(huge, group, c), _ring(8, 8, 2, huge, bw, inter_steps=0), rel_tol=1e-12)


def test_ll128_with_one_gpu_per_node_runs_at_07() -> None:
    c = _ll128_cluster(8)
    group = GroupPlacement(size=8, num_nodes=8, per_node=1)
    s, bw = 2e6, 25e9 * 0.8
    ll128 = BASE + 7 * LL128_NET + 7 / 8 * s / (0.7 * bw)  # "ppn < 2 ? 0.7": every hop crosses the NIC
    assert ll128 < _ring(8, 1, 1, s, bw, inter_steps=7)
    assert math.isclose(all_gather_s(s, group, c), ll128, rel_tol=1e-12)
    # a link without LL128 latencies leaves only LL and Simple
    assert math.isclose(all_gather_s(s, group, _nccl_cluster(8)), _ring(8, 1, 1, s, bw, inter_steps=7), rel_tol=1e-12)


def test_a_tree_ratio_above_one_is_refused_like_any_fraction(tmp_path) -> None:
    path = write_profile_variant(tmp_path, lambda d: d["inter_node"].update(tree_busbw_ratio=1.4))
    with pytest.raises(ValueError, match=r"inter_node.tree_busbw_ratio.*\(0, 1\]"):
        Cluster.load(path)
