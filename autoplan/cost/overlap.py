"""Two-stream overlap: a compute stream running layers in order and a communication stream running the
collectives they depend on (prefetched weight gathers) or produce (gradient buckets).
"""

from __future__ import annotations

from collections.abc import Sequence

from autoplan.cluster.types import ClusterSpec


def contention_fraction(cluster: ClusterSpec) -> float:
    """Share of a device's compute lost while a collective runs beside it: NCCL's kernel holds
    device.nccl_sms of the num_sms SMs (one thread block per channel), so overlapped kernels run on the
    rest (the GEMM that filled all SMs in one wave spills into a second: NVIDIA developer forum,
    "Compute-Communication Overlap Causes Severe GEMM Performance Degradation because of Tail Effect").
    Zero without SM counts (a CPU profile)."""
    device = cluster.device
    if device.num_sms <= 0 or device.nccl_sms <= 0:
        return 0.0
    return min(device.nccl_sms / device.num_sms, 1.0)


def hidden_penalty_s(hidden_comm_s: float, cluster: ClusterSpec) -> float:
    """Extra compute time when `hidden_comm_s` of communication ran under compute: that compute lost
    contention_fraction of its SMs for that long."""
    return contention_fraction(cluster) * max(hidden_comm_s, 0.0)


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
