"""Two-stream overlap: a compute stream running layers in order and a communication stream running the
collectives they depend on (prefetched weight gathers) or produce (gradient buckets).
"""

from __future__ import annotations

from collections.abc import Sequence

from autoplan.cluster.types import ClusterSpec
from autoplan.cost.types import GroupPlacement

# NCCL's channel rules for a communicator spanning nodes (NVIDIA/nccl master 5067397c; the same since
# 2.18.3). src/graph/search.cc ncclTopoCompute walks speedArrayInter (sm80) / sm90SpeedArrayInter (sm90) down
# to the first per-channel speed (GB/s) the GPU-NIC path carries and fits one ring per such path ...
_SPEED_INTER_GBPS = {
    80: (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2, 0.24, 0.12),
    90: (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24, 0.12),
}
_SEARCH_MAX_CHANNELS = 32  # init.cc: ringGraph->maxChannels = MAXCHANNELS / 2
_MAX_CHANNELS = 64  # device.h MAXCHANNELS
# ... ncclTopoDupChannels doubles them unless bwIntra < 25, or (ccMin > 80) bwIntra < 50 with more than 4
_DUP_MIN_GBPS, _SM90_DUP_MIN_GBPS, _SM90_DUP_MAX_RINGS = 25.0, 50.0, 4
# ... connect.cc ncclTopoPostset doubles them, and on sm90 across nodes doubles again while the ring's
# bwIntra > 45 and there are fewer than 16 ("Use 4 compute channels per search channel ... on <8 PPN")
_SM90_QUAD_MIN_GBPS, _SM90_QUAD_BELOW = 45.0, 16


def cross_node_channels(per_node: int, path_bw_bytes_per_s: float, compute_capability: int) -> int:
    """NCCL's channels for a communicator with `per_node` GPUs in each node, each GPU reaching its own NIC
    over a path of `path_bw_bytes_per_s` (LinkSpec.nccl_path_bw_bytes_per_s), on compute capability
    `compute_capability` (80 or 90; the constants above, with their NCCL functions):
    rings = per_node x floor(path / speed), speed the first entry of the architecture's speed array the path
    carries; doubled by ncclTopoDupChannels (to speed / 2 each) unless the speed is below 25 GB/s or, on
    sm90, below 50 GB/s with more than 4 rings; doubled by ncclTopoPostset; on sm90 doubled once more while
    fewer than 16 remain and the ring's per-channel speed exceeds 45 GB/s. DGX A100 (PCIe Gen4 x16 = 24
    GB/s to a 25 GB/s HDR NIC): 2 per GPU, 16 for 8 per node ('DGX with 8 NICs ... 16 SMs', NVIDIA/nccl
    issue 689); DGX H100 (Gen5 x16 = 48 GB/s to a 50 GB/s NDR NIC): 4 per GPU below 8 per node, 16 at 8."""
    speeds = _SPEED_INTER_GBPS[90 if compute_capability >= 90 else 80]
    path = path_bw_bytes_per_s / 1e9
    speed = next((x for x in speeds if x <= path), speeds[-1])
    rings = min(per_node * max(int(path // speed), 1), _SEARCH_MAX_CHANNELS)
    skip_dup = speed < _DUP_MIN_GBPS or (compute_capability > 80 and speed < _SM90_DUP_MIN_GBPS
                                         and rings > _SM90_DUP_MAX_RINGS)
    channels, bw = (rings, speed) if skip_dup else (min(2 * rings, _SEARCH_MAX_CHANNELS), speed / 2)
    channels = min(2 * channels, _MAX_CHANNELS)  # ncclTopoPostset
    if compute_capability >= 90 and bw > _SM90_QUAD_MIN_GBPS and channels < _SM90_QUAD_BELOW:
        channels = min(2 * channels, _MAX_CHANNELS)
    return channels


def nccl_channels(group: GroupPlacement | None, cluster: ClusterSpec) -> int:
    """Channels (one thread block, holding one SM, each: NVIDIA/nccl issues 181, 689) of NCCL's communicator
    over `group`: device.nccl_sms inside one node (the profile's intra-node count: 6 NVLink rings, duplicated
    and Postset-doubled to 24 on DGX A100 / H100), cross_node_channels across nodes when the profile gives
    the device's compute_capability and the inter-node link's nccl_path_bw_bytes_per_s (else nccl_sms). None
    stands for a group inside one node. Zero without NCCL channels (a CPU profile) or for a group of one.
    Messages below channels x 512 threads x 64 B run on fewer channels (enqueue.cc topoGetAlgoInfo): not
    modelled, every collective is charged its communicator's full count."""
    device = cluster.device
    if device.nccl_sms <= 0 or (group is not None and group.size <= 1):
        return 0
    path = cluster.inter_node.nccl_path_bw_bytes_per_s
    if group is None or not group.crosses_nodes or path <= 0 or device.compute_capability <= 0:
        return device.nccl_sms
    return cross_node_channels(group.per_node, path, device.compute_capability)


def contention_fraction(cluster: ClusterSpec, group: GroupPlacement | None = None) -> float:
    """Share of a device's compute lost while a collective over `group` runs beside it: NCCL's kernel
    holds nccl_channels(group) of the num_sms SMs (one thread block per channel), so overlapped kernels
    run on the rest (the GEMM that filled all SMs in one wave spills into a second: NVIDIA developer forum,
    "Compute-Communication Overlap Causes Severe GEMM Performance Degradation because of Tail Effect").
    group None: a communicator inside one node (device.nccl_sms). Zero without SM counts (a CPU profile)."""
    channels = nccl_channels(group, cluster)
    if channels <= 0 or cluster.device.num_sms <= 0:
        return 0.0
    return min(channels / cluster.device.num_sms, 1.0)


def mixed_fraction(parts: Sequence[tuple[float, GroupPlacement]], cluster: ClusterSpec) -> float:
    """contention_fraction of collectives over several groups that share one communication stream (the
    dense and the expert data-parallel reductions), weighted by each group's seconds of communication:
    the stream runs one collective at a time, so a hidden second holds the SMs of whichever one runs."""
    total = sum(t for t, _ in parts)
    if total <= 0:
        return contention_fraction(cluster, parts[0][1]) if parts else 0.0
    return sum(t * contention_fraction(cluster, g) for t, g in parts) / total


def hidden_penalty_s(hidden_comm_s: float, cluster: ClusterSpec, frac: float | None = None) -> float:
    """Extra compute time when `hidden_comm_s` of communication ran under compute: that compute lost
    `frac` of its SMs for that long (default: contention_fraction of a communicator inside one node)."""
    share = contention_fraction(cluster) if frac is None else frac
    return share * max(hidden_comm_s, 0.0)


def overlapped_s(compute_s: Sequence[float], pre_s: Sequence[float], post_s: Sequence[float]) -> float:
    """Makespan of n layers on two streams (PyTorch FSDP2 / DDP; Li et al., VLDB 2020, section 3.2).

    Layer i computes for compute_s[i] once its prerequisite collective pre_s[i] (a ZeRO-3 weight
    all-gather) is done; pre_s[i + 1] is issued when layer i starts (one layer of prefetch), and
    post_s[i] (its gradient bucket's reduction) is queued when layer i ends. The communication stream
    runs one collective at a time, in issue order. The exposed communication is the makespan minus
    sum(compute_s): the first gather, any gather the previous layer did not hide, and the reductions
    still running after the last layer (at least the last bucket)."""
    n = len(compute_s)
    if not (len(pre_s) == len(post_s) == n):
        raise ValueError(f"overlapped_s needs equal lengths, got {n}, {len(pre_s)}, {len(post_s)}")
    if n == 0:
        return 0.0
    comm_free = float(pre_s[0])
    pre_done = comm_free
    compute_end = 0.0
    for i in range(n):
        start = max(compute_end, pre_done)
        compute_end = start + compute_s[i]
        if i + 1 < n:
            pre_done = max(comm_free, start) + pre_s[i + 1]
            comm_free = pre_done
        comm_free = max(comm_free, compute_end) + post_s[i] if post_s[i] > 0 else comm_free
    return max(compute_end, comm_free)


def exposed_s(compute_s: Sequence[float], pre_s: Sequence[float], post_s: Sequence[float]) -> float:
    """Communication time not hidden by compute: overlapped_s minus sum(compute_s), >= 0 (exactly 0
    when there is nothing to communicate)."""
    if not any(pre_s) and not any(post_s):
        return 0.0
    return max(overlapped_s(compute_s, pre_s, post_s) - sum(compute_s), 0.0)
