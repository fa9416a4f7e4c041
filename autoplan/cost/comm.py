"""Collective communication times: alpha-beta costs of ring / tree / hierarchical algorithms on the
link level each device group crosses, and the placement of mesh-axis groups on nodes.

Pure functions of (bytes, GroupPlacement, ClusterSpec). Bandwidth fractions come from the profile's
LinkSpec (nccl-tests bus bandwidth / link bandwidth), never from literals here.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from autoplan.cluster.types import ClusterSpec, LinkSpec
from autoplan.cost.types import GroupPlacement
from autoplan.plan.types import MESH_AXIS_ORDER, ParallelConfig


def group_placement(config: ParallelConfig, axes: tuple[str, ...], devices_per_node: int) -> GroupPlacement:
    """Placement of the group spanned by `axes` (names from MESH_AXIS_ORDER) that contains rank 0.

    Ranks are laid out with MESH_AXIS_ORDER = (pp, dp, ep, cp, tp), tp innermost: an axis has stride
    = product of the sizes of the axes inside it. Rank k lives on node k // devices_per_node. A group
    of size n and stride s lies inside one node iff n * s <= devices_per_node and the node size is a
    multiple of n * s; otherwise it spans nodes, and `per_node` is the fewest members any spanned node
    holds (a partial span counts as crossing, with its worst node as the bottleneck)."""
    sizes = tuple(getattr(config, name) for name in _AXIS_NAMES)
    wanted = tuple(name in axes for name in _AXIS_NAMES)
    return _placement(sizes, wanted, devices_per_node)


_AXIS_NAMES = tuple(axis.value for axis in MESH_AXIS_ORDER)  # read once: an Enum's .value is a slow descriptor


@lru_cache(maxsize=4096)
def _placement(sizes: tuple[int, ...], wanted: tuple[bool, ...], devices_per_node: int) -> GroupPlacement:
    ranks = np.zeros(1, dtype=np.int64)
    stride = 1
    for size, use in zip(reversed(sizes), reversed(wanted)):  # innermost (tp) first
        if use and size > 1:
            ranks = (ranks[None, :] + stride * np.arange(size, dtype=np.int64)[:, None]).ravel()
        stride *= size
    counts = np.bincount(ranks // devices_per_node)
    counts = counts[counts > 0]
    return GroupPlacement(size=int(ranks.size), num_nodes=int(counts.size), per_node=int(counts.min()))


def ring_bw(group: GroupPlacement, cluster: ClusterSpec, fraction: str) -> tuple[float, float]:
    """(bandwidth, per-step latency) of a ring over the group.

    Inside a node: the NVLink-class link at its measured bus-bandwidth fraction, for all-reduce-class rings
    the one measured for the group's size (LinkSpec.busbw_fraction: on A100 NVSwitch a 2-rank all-reduce
    reaches 197 GB/s of bus bandwidth, an 8-rank one 229). Across nodes NCCL
    runs its rings through the NICs (nccl-tests PERFORMANCE.md; NCCL sets one ring per NIC): a node
    holding `per_node` members of the group drives `per_node` NICs, so the ring's bottleneck is
    min(intra bus bw, per_node * per-device NIC bw * fraction) and every step waits on the
    inter-node latency."""
    intra, inter = cluster.intra_node, cluster.inter_node
    if not group.crosses_nodes:  # all-reduce-class rings by the group's size where the profile measured it
        share = intra.busbw_fraction(group.size) if fraction == "allreduce_busbw_fraction" else getattr(intra, fraction)
        return intra.bw_bytes_per_s * share, intra.latency_s
    intra_bw = intra.bw_bytes_per_s * getattr(intra, fraction)
    inter_bw = group.per_node * inter.bw_bytes_per_s * getattr(inter, fraction)
    bw = min(intra_bw, inter_bw) if group.per_node > 1 else inter_bw
    return bw, inter.latency_s


def base_latency_s(crosses_nodes: bool, cluster: ClusterSpec) -> float:
    """The fixed cost of one NCCL collective or send/recv (LinkSpec.base_latency_s; NCCL's tuning.cc baseLatencies,
    the profiles' measured kernel launch and completion): the larger of the links it uses, the intra-node one
    always (its kernel runs on the node's GPUs), the inter-node one when it crosses nodes."""
    inter = cluster.inter_node.base_latency_s if crosses_nodes else 0.0
    return max(cluster.intra_node.base_latency_s, inter)


# NCCL's protocols (src/graph/tuning.cc ncclTopoTuneModel): LL moves 8-byte words with a flag each, half
# the link's bandwidth ("busBw * .5" from v2.21.5; v2.7.8-v2.20.5 took 1/4 across nodes, where the llMaxBw cap
# LinkSpec.ll_max_bw_bytes_per_s binds either way), at the lowest latency per step; LL128 moves 128-byte lines
# with an 8-byte flag at 0.92 of the bus bandwidth, 0.7 with one GPU per node ("busBw * (ppn < 2 ? 0.7 : 0.92)",
# v2.7.8-v2.21.5), where the link has it (LinkSpec.ll128_latency_s); Simple moves full chunks at the full bus
# bandwidth with a longer latency per step. NCCL picks the fastest per call (enqueue.cc getAlgoInfo).
def _protocols(group: GroupPlacement, cluster: ClusterSpec) -> tuple[tuple[float, float, float, float], ...]:
    """(intra-node step latency, inter-node step latency, share of the bus bandwidth, bandwidth cap) per protocol
    the links offer: LL always, LL128 where both links the group uses have it, Simple."""
    intra, inter = cluster.intra_node, cluster.inter_node
    link = inter if group.crosses_nodes else intra
    ll = (intra.latency_s, inter.latency_s, 0.5, link.ll_max_bw_bytes_per_s or math.inf)
    simple = (intra.simple_latency_s, inter.simple_latency_s or inter.latency_s, 1.0, math.inf)
    if not intra.ll128_latency_s or (group.crosses_nodes and not inter.ll128_latency_s):
        return ll, simple
    share = 0.7 if group.crosses_nodes and group.per_node < 2 else 0.92
    return ll, (intra.ll128_latency_s, inter.ll128_latency_s, share, math.inf), simple


def _ring_steps_s(group: GroupPlacement, passes: int, nbytes: float, bw: float, cluster: ClusterSpec) -> float:
    """`passes` ring passes (reduce-scatter or all-gather: 1, all-reduce: 2) over the group: each pass is
    n - 1 steps moving (n - 1)/n of S (Thakur et al. 2005; nccl-tests PERFORMANCE.md). NCCL's latency model
    (tuning.cc): base + intra steps x intra latency + inter steps x inter latency, for the cheapest protocol
    (_protocols); a link without Simple latencies gives every step its latency_s (one protocol). Inter steps: the
    hops of the longest dependency chain that cross the network. NCCL's rings visit a node's GPUs in a row
    (search.cc: NET n -> GPU a -> ... -> GPU x -> NET n), so one edge in per_node leaves the node and a chunk's
    passes x (n - 1) consecutive hops cross it ceil(passes (n - 1) / per_node) times at worst: passes x (nodes - 1)
    with one GPU per node, 2 x nodes for an all-reduce with more (NCCL v2.14.3-v2.21.5's nInterSteps = 2 nNodes;
    v2.7.8 and master count 2 (nNodes - 1))."""
    n = group.size
    inter_steps = min(-(-passes * (n - 1) // group.per_node), passes * (n - 1)) if group.crosses_nodes else 0
    intra_steps = passes * (n - 1) - inter_steps
    volume = passes * (n - 1) / n * nbytes
    intra, inter = cluster.intra_node, cluster.inter_node
    if not intra.simple_latency_s:  # one protocol: every step at the slowest link's latency (alpha-beta)
        alpha = inter.latency_s if group.crosses_nodes else intra.latency_s
        return passes * (n - 1) * alpha + volume / bw
    return base_latency_s(group.crosses_nodes, cluster) + min(
        intra_steps * lat_intra + inter_steps * lat_inter + volume / min(bw * share, cap)
        for lat_intra, lat_inter, share, cap in _protocols(group, cluster))


def all_reduce_s(nbytes: float, group: GroupPlacement, cluster: ClusterSpec) -> float:
    """All-reduce of `nbytes` over the group: the cheaper of NCCL's two algorithms (enqueue.cc getAlgoInfo
    takes the one its model prices lowest; CollNet and NVLS need switch support and are not modelled).

    - ring: two passes, 2 (n - 1)/n * S / BW plus NCCL's latency (BW the ring bottleneck, ring_bw);
    - tree across nodes (_tree_s): NCCL's double binary tree, log-depth latency, its own bandwidth.
    Zero for a group of one."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, _ = ring_bw(group, cluster, "allreduce_busbw_fraction")
    ring = _ring_steps_s(group, 2, nbytes, bw, cluster)
    return min(ring, _tree_s(group, nbytes, cluster)) if group.crosses_nodes else ring


def _tree_s(group: GroupPlacement, nbytes: float, cluster: ClusterSpec) -> float:
    """NCCL's tree all-reduce across nodes: a chain through the group's per_node GPUs in each node and a double
    binary tree over the nodes, reduce then broadcast. Latency as NCCL's model (src/graph/tuning.cc
    ncclTopoTuneModel, the same formula from v2.7.8 to v2.21.5): base + 2 ((per_node - 1) x intra hop +
    log2i(nodes) x inter hop), hops at LinkSpec.tree_latency_s (tuning.cc hwLat[NVLINK|NET][TREE][LL128]: the
    protocol NCCL's model picks for the tree at the sizes it wins). Bandwidth: each node sends and receives 2 S
    through its NICs (interior in one tree, leaf in the other), at the measured tree bus bandwidth
    (the ring's fraction x inter_node.tree_busbw_ratio beyond two nodes, where its sources measured it).
    On exactly two nodes NCCL's model gives the tree about the ring's per-channel bandwidth (tuning.cc
    perChMaxTreeBws[Ampere] 23.6 GB/s for 2 nodes, 17.8 for 4+) and its tree crosses the network with S, not 2 S
    (NVIDIA/nccl issue 946); published 2-node nccl-tests on 8 A100 + 4 HDR NICs reach only ring-level bus
    bandwidth (86-91 GB/s: NVIDIA/nccl-tests issues 100, 175), so two nodes keep the ring's fraction and 2 S."""
    intra, inter = cluster.intra_node, cluster.inter_node
    ratio = (inter.tree_busbw_ratio or 1.0) if group.num_nodes > 2 else 1.0
    nic_bw = group.per_node * inter.bw_bytes_per_s * inter.allreduce_busbw_fraction * ratio
    inter_hop = inter.tree_latency_s or inter.simple_latency_s or inter.latency_s
    hops = (group.per_node - 1) * intra.tree_latency_s + int(math.log2(group.num_nodes)) * inter_hop
    return base_latency_s(True, cluster) + 2 * hops + 2 * nbytes / nic_bw


def all_gather_s(nbytes: float, group: GroupPlacement, cluster: ClusterSpec) -> float:
    """Ring all-gather producing `nbytes` (the full output) on every rank: one pass, (n - 1)/n * S / BW
    plus NCCL's latency (_ring_steps_s), BW at the link's bus-bandwidth fraction (nccl-tests shows
    all-gather reaching about the all-reduce bus bandwidth)."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, _ = ring_bw(group, cluster, "allreduce_busbw_fraction")
    return _ring_steps_s(group, 1, nbytes, bw, cluster)


def reduce_scatter_s(nbytes: float, group: GroupPlacement, cluster: ClusterSpec) -> float:
    """Ring reduce-scatter of an `nbytes` input: the same cost as the all-gather of that size."""
    return all_gather_s(nbytes, group, cluster)


def all_to_all_s(nbytes: float, group: GroupPlacement, cluster: ClusterSpec) -> float:
    """All-to-all where each rank holds `nbytes` split evenly over the n ranks (its own share stays):
    (n - 1) alpha + max(intra, inter) with intra = (n_l - 1)/n * S / (BW_intra * f) for the peers in
    the same node and inter = (n - n_l)/n * S / (BW_nic * f) for those behind the NIC (each device
    its own NIC; full-bisection fabric), f the profile's alltoall_bw_fraction."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    intra, inter = cluster.intra_node, cluster.inter_node
    local = group.per_node if group.crosses_nodes else n
    t_intra = (local - 1) / n * nbytes / (intra.bw_bytes_per_s * intra.alltoall_bw_fraction)
    t_inter = (n - local) / n * nbytes / (inter.bw_bytes_per_s * inter.alltoall_bw_fraction)
    alpha = inter.latency_s if group.crosses_nodes else intra.latency_s
    return (n - 1) * alpha + max(t_intra, t_inter)


def p2p_s(nbytes: float, crosses_nodes: bool, cluster: ClusterSpec) -> float:
    """Point-to-point send/recv: base + alpha + S / (BW * p2p_bw_fraction) on the link it crosses (base: the
    per-collective fixed cost of the profile's NCCL latency model)."""
    if nbytes <= 0:
        return 0.0
    link: LinkSpec = cluster.inter_node if crosses_nodes else cluster.intra_node
    bw = link.bw_bytes_per_s * link.p2p_bw_fraction
    return base_latency_s(crosses_nodes, cluster) + link.latency_s + nbytes / bw
