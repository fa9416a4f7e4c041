"""Collective communication times: alpha-beta costs of ring / tree / hierarchical algorithms on the
link level each device group crosses, and the placement of mesh-axis groups on nodes.

Pure functions of (bytes, GroupPlacement, ClusterSpec). Bandwidth fractions come from the profile's
LinkSpec (nccl-tests bus bandwidth / link bandwidth), never from literals here.
"""

from __future__ import annotations

import math
from functools import lru_cache

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
    sizes = tuple(getattr(config, axis.value) for axis in MESH_AXIS_ORDER)
    wanted = tuple(axis.value in axes for axis in MESH_AXIS_ORDER)
    return _placement(sizes, wanted, devices_per_node)


@lru_cache(maxsize=4096)
def _placement(sizes: tuple[int, ...], wanted: tuple[bool, ...], devices_per_node: int) -> GroupPlacement:
    ranks = [0]
    stride = 1
    for size, use in zip(reversed(sizes), reversed(wanted)):  # innermost (tp) first
        if use and size > 1:
            ranks = [r + k * stride for k in range(size) for r in ranks]
        stride *= size
    counts: dict[int, int] = {}
    for rank in ranks:
        counts[rank // devices_per_node] = counts.get(rank // devices_per_node, 0) + 1
    return GroupPlacement(size=len(ranks), num_nodes=len(counts), per_node=min(counts.values()))


def _ring_bw(group: GroupPlacement, cluster: ClusterSpec, fraction: str) -> tuple[float, float]:
    """(bandwidth, per-step latency) of a ring over the group.

    Inside a node: the NVLink-class link at its measured bus-bandwidth fraction. Across nodes NCCL
    runs its rings through the NICs (nccl-tests PERFORMANCE.md; NCCL sets one ring per NIC): a node
    holding `per_node` members of the group drives `per_node` NICs, so the ring's bottleneck is
    min(intra bus bw, per_node * per-device NIC bw * fraction) and every step waits on the
    inter-node latency."""
    intra, inter = cluster.intra_node, cluster.inter_node
    intra_bw = intra.bw_bytes_per_s * getattr(intra, fraction)
    if not group.crosses_nodes:
        return intra_bw, intra.latency_s
    inter_bw = group.per_node * inter.bw_bytes_per_s * getattr(inter, fraction)
    bw = min(intra_bw, inter_bw) if group.per_node > 1 else inter_bw
    return bw, inter.latency_s


def _ring_steps_s(n: int, steps_per_rank: int, nbytes: float, bw: float, alpha: float) -> float:
    """steps_per_rank * [(n - 1) alpha + (n - 1)/n * S / BW]: ring reduce-scatter or all-gather is one
    such pass (S = full output size), all-reduce two (Thakur et al. 2005; nccl-tests PERFORMANCE.md)."""
    return steps_per_rank * ((n - 1) * alpha + (n - 1) / n * nbytes / bw)


def all_reduce_s(nbytes: float, group: GroupPlacement, cluster: ClusterSpec) -> float:
    """All-reduce of `nbytes` over the group: the cheapest of what NCCL may pick.

    - ring: 2 (n - 1) alpha + 2 (n - 1)/n * S / BW (BW the ring bottleneck, see _ring_bw);
    - hierarchical when the group spans nodes with several members per node: reduce-scatter inside
      the node (n_l = per_node ranks), all-reduce of S / n_l across the nodes (one rank per node and
      NIC), all-gather inside the node;
    - tree (NCCL's double binary tree across nodes): 2 log2(nodes) alpha_inter + 2 S / BW_nic; its
      bandwidth term never beats the ring's, so it wins only for small (latency-bound) messages.
    Zero for a group of one."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, alpha = _ring_bw(group, cluster, "allreduce_busbw_fraction")
    best = _ring_steps_s(n, 2, nbytes, bw, alpha)
    if group.crosses_nodes:
        inter = cluster.inter_node
        nic_bw = group.per_node * inter.bw_bytes_per_s * inter.allreduce_busbw_fraction
        best = min(best, 2 * math.ceil(math.log2(group.num_nodes)) * inter.latency_s + 2 * nbytes / nic_bw)
        if group.per_node > 1:
            local = GroupPlacement(size=group.per_node, num_nodes=1, per_node=group.per_node)
            across = GroupPlacement(size=group.num_nodes, num_nodes=group.num_nodes, per_node=1)
            hier = (2 * reduce_scatter_s(nbytes, local, cluster)
                    + all_reduce_s(nbytes / group.per_node, across, cluster))
            best = min(best, hier)
    return best


def all_gather_s(nbytes: float, group: GroupPlacement, cluster: ClusterSpec) -> float:
    """Ring all-gather producing `nbytes` (the full output) on every rank:
    (n - 1) alpha + (n - 1)/n * S / BW, BW at the link's bus-bandwidth fraction (nccl-tests shows
    all-gather reaching about the all-reduce bus bandwidth)."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, alpha = _ring_bw(group, cluster, "allreduce_busbw_fraction")
    return _ring_steps_s(n, 1, nbytes, bw, alpha)


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
    """Point-to-point send/recv: alpha + S / (BW * p2p_bw_fraction) on the link it crosses."""
    if nbytes <= 0:
        return 0.0
    link: LinkSpec = cluster.inter_node if crosses_nodes else cluster.intra_node
    return link.latency_s + nbytes / (link.bw_bytes_per_s * link.p2p_bw_fraction)
