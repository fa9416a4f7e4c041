"""Public multi-node NCCL measurements against autoplan's collective model (autoplan/cost/comm.py).

    python bench/nccl_scale.py

Each row is a published nccl-tests figure (bus bandwidth of one collective at one size over so many nodes),
its setting, and what cost/comm prices for the same setting on the shipped profile of that node, the
per-GPU NIC bandwidth changed where the cluster had fewer or slower NICs than the DGX the profile
describes (NICs x rate / 8 GPUs; nothing else changed). busbw as nccl-tests reports it
(nccl-tests doc/PERFORMANCE.md): all-reduce 2 (n - 1)/n S / t, all-gather (n - 1)/n S / t.

A second column (lockstep) prices a hypothesis, not the model: a Simple-protocol ring in which EVERY step (not only the hops that
cross the network) waits the inter-node Simple latency, as it would if the per-rank data fitted in one
chunk per channel so that every edge of the ring moves in lock-step with its network edge. It is printed
to show which way the measurements lean; it is not used by autoplan.

A check, never fitted to: no profile value comes from these rows (the profiles' sources are in their YAML).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's autoplan

from autoplan.cluster.load import Cluster
from autoplan.cluster.types import ClusterSpec
from autoplan.cost import comm
from autoplan.cost.comm import all_gather_s, all_reduce_s
from autoplan.cost.types import GroupPlacement

GIB = 2**30

# (source, setting, profile, per-GPU NIC bytes/s or None for the profile's, nodes, op, bytes, measured busbw GB/s)
MEASURED = (
    ("NVIDIA/nccl#812 (NVIDIA, AddyLaddy)", "DGX A100, 8 x HDR IB, ring, large sizes, few nodes",
     "dgx-a100-80gb", None, 2, "all_reduce", 8 * GIB, 192.0),
    ("NVIDIA/nccl-tests#119", "3 x 8 A100-40GB, 4 x HDR IB, NCCL auto, peak (<= 128 MiB)",
     "dgx-a100-80gb", 4 * 25e9 / 8, 3, "all_reduce", 128 * 2**20, 96.0),
    ("NVIDIA/nccl#1048", "2 x 8 A100, 4 x 200G IB (dual port), up to 4 GiB",
     "dgx-a100-80gb", 4 * 25e9 / 8, 2, "all_reduce", 4 * GIB, 86.0),
    ("NVIDIA/nccl-tests#169", "3 x 8 A100-80GB, 8 x 100G RoCE (PCIe), 1-8 GiB",
     "dgx-a100-80gb", 12.5e9, 3, "all_reduce", 8 * GIB, 70.0),
    ("NVIDIA/nccl-tests#169", "4-5 x 8 A100-80GB, 8 x 100G RoCE, 1-8 GiB",
     "dgx-a100-80gb", 12.5e9, 5, "all_reduce", 8 * GIB, 58.0),
    ("NVIDIA/nccl-tests#169", "6 x 8 A100-80GB, 8 x 100G RoCE, 1-8 GiB",
     "dgx-a100-80gb", 12.5e9, 6, "all_reduce", 8 * GIB, 40.0),
    ("NVIDIA/nccl#1368", "5 x 8 H100, 4 x 400G RoCE, NCCL 2.20, ring, 1 GB",
     "h100-roce-400g", 4 * 50e9 / 8, 5, "all_reduce", 10**9, 190.0),
    ("NVIDIA/nccl#1221", "4 x 8 H100, 8 x 400G RoCE, NCCL 2.19.3, 4-8 GiB",
     "h100-roce-400g", None, 4, "all_reduce", 8 * GIB, 320.0),
    ("NVIDIA/nccl#1218", "32 x 8 H100, 8 x 400G RoCE, 16 channels forced, 2 GiB",
     "h100-roce-400g", None, 32, "all_gather", 2 * GIB, 200.0),
    ("NVIDIA/nccl#1218", "same flags, all_reduce_perf (issue text '340GB'; NVLSTree likely, not a ring)",
     "h100-roce-400g", None, 32, "all_reduce", 2 * GIB, 340.0),
    ("NVIDIA/nccl-tests#290 (NVIDIA)", "'For NDR @ 400Gbps you should see 46-48GB/s per NIC' (8 NICs, ring)",
     "dgx-h100-80gb", None, 2, "all_reduce", 8 * GIB, 8 * 47.0),
)

# the training rows' own collectives (no measurement at these scales found): what the model gives
AT_SCALE = (
    ("ZeRO-3 175B fc1 gather, 48 nodes", "dgx-a100-80gb", 48, "all_gather", 12288 * 49152 * 2),
    ("ZeRO-3 175B fc1 gather, 192 nodes", "dgx-a100-80gb", 192, "all_gather", 12288 * 49152 * 2),
    ("ZeRO-3 530B fc1 gather, 80 nodes", "dgx-a100-80gb", 80, "all_gather", 20480 * 81920 * 2),
    ("ZeRO-3 530B fc1 gather, 280 nodes", "dgx-a100-80gb", 280, "all_gather", 20480 * 81920 * 2),
)


def cluster_for(profile: str, nic_bw: float | None, nodes: int) -> ClusterSpec:
    cluster = Cluster.load(profile, num_nodes=nodes)
    if nic_bw is None:
        return cluster
    return dataclasses.replace(cluster, inter_node=dataclasses.replace(cluster.inter_node, bw_bytes_per_s=nic_bw))


def ring_passes(op: str) -> int:
    """Ring passes of the collective (cost/comm._ring_steps_s): an all-reduce two, an all-gather one; also
    nccl-tests' busbw factor (2 (n - 1)/n and (n - 1)/n)."""
    return 2 if op == "all_reduce" else 1


def model_s(op: str, nbytes: float, group: GroupPlacement, cluster: ClusterSpec) -> float:
    return (all_reduce_s if op == "all_reduce" else all_gather_s)(nbytes, group, cluster)


def lockstep_s(op: str, nbytes: float, group: GroupPlacement, cluster: ClusterSpec) -> float:
    """The hypothesis column: the ring's volume at the ring bandwidth cost/comm uses (comm.ring_bw), every one
    of its passes x (n - 1) steps at the inter-node Simple latency, plus the per-collective base latency
    (comm.base_latency_s)."""
    passes, n, inter = ring_passes(op), group.size, cluster.inter_node
    bw, _ = comm.ring_bw(group, cluster, "allreduce_busbw_fraction")
    base = comm.base_latency_s(group.crosses_nodes, cluster)
    return base + passes * (n - 1) * (inter.simple_latency_s or inter.latency_s) + passes * (n - 1) / n * nbytes / bw


def busbw_gbs(op: str, nbytes: float, n: int, seconds: float) -> float:
    return ring_passes(op) * (n - 1) / n * nbytes / seconds / 1e9


def row_busbw(profile: str, nic_bw: float | None, nodes: int, op: str, nbytes: float) -> tuple[float, float]:
    """(model, lockstep) busbw in GB/s of one row: the whole world of 8 GPUs per node on the profile."""
    cluster = cluster_for(profile, nic_bw, nodes)
    group = GroupPlacement(size=8 * nodes, num_nodes=nodes, per_node=8)
    return tuple(busbw_gbs(op, nbytes, group.size, f(op, nbytes, group, cluster)) for f in (model_s, lockstep_s))


def main() -> None:
    print(f"{'source':36s} {'nodes':>5s} {'op':10s} {'size':>9s} {'measured':>9s} {'model':>7s} {'m/meas':>7s}"
          f" {'lockstep':>9s}  setting")
    for source, setting, profile, nic_bw, nodes, op, nbytes, measured in MEASURED:
        model, lock = row_busbw(profile, nic_bw, nodes, op, nbytes)
        print(f"{source:36s} {nodes:5d} {op:10s} {nbytes / GIB:7.2f} G {measured:7.0f}   {model:7.0f} "
              f"{model / measured:7.2f} {lock:9.0f}  {setting}")
    print("\nbusbw in GB/s; model = autoplan's cost/comm on the profile; m/meas > 1: the model is optimistic.")
    print("\nno public measurement found at these scales; the model's busbw (8 GPUs per node, whole world):")
    for label, profile, nodes, op, nbytes in AT_SCALE:
        model, lock = row_busbw(profile, None, nodes, op, nbytes)
        print(f"  {label:36s} {nbytes / GIB:5.2f} GiB  model {model:4.0f} GB/s  lockstep {lock:4.0f} GB/s")


if __name__ == "__main__":
    main()
