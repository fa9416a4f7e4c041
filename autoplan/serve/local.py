"""The local-cpu profile for a run of fewer ranks than it was measured with.

profiles/local-cpu.yaml gives PER-RANK figures for 8 rank processes sharing the machine's cores
(its note: 2 cores). A rank of a smaller job gets a larger share: with r ranks of one thread each on
c cores, a rank runs on min(1, c / r) of a core instead of c / 8. Compute (peak FLOP/s), memory
bandwidth and host time per op scale by that ratio; so does the gloo latency per step, which the
profile measured with 8 processes contending for 2 cores (context switches at every ring step). The
link bandwidth is left as measured. A model of the sharing, not a measurement: say so when quoting it.
"""

from __future__ import annotations

import dataclasses

from autoplan.cluster.types import ClusterSpec

PROFILE_RANKS = 8  # profiles/local-cpu.yaml: devices_per_node 8, all figures per rank of an 8-rank job


def core_share(ranks: int, cores: int, threads_per_rank: int = 1) -> float:
    """Cores one rank runs on: min(threads, cores / ranks)."""
    return min(float(threads_per_rank), cores / ranks)


def scale_for_ranks(cluster: ClusterSpec, *, ranks: int, cores: int, threads_per_rank: int = 1,
                    busy: int | None = None) -> ClusterSpec:
    """`cluster` (per-rank figures of PROFILE_RANKS ranks on `cores` cores) seen by a job of `ranks` ranks
    of which `busy` (default all) compute at once: a pipeline of one micro-batch keeps one stage (its
    tp ranks) busy while the other stages wait in a blocking receive, so the busy ranks share the cores."""
    busy = ranks if busy is None else busy
    if ranks < 1 or cores < 1 or not 1 <= busy <= ranks:
        raise ValueError(f"ranks, cores and busy must be positive (busy <= ranks), got ranks={ranks}, "
                         f"cores={cores}, busy={busy}")
    speedup = core_share(busy, cores, threads_per_rank) / core_share(PROFILE_RANKS, cores, threads_per_rank)
    dev = cluster.device
    device = dataclasses.replace(
        dev, peak_flops=tuple((d, f * speedup) for d, f in dev.peak_flops),
        mem_bw_bytes_per_s=dev.mem_bw_bytes_per_s * speedup, op_overhead_s=dev.op_overhead_s / speedup)
    links = {level: dataclasses.replace(getattr(cluster, level), latency_s=getattr(cluster, level).latency_s / speedup)
             for level in ("intra_node", "inter_node")}
    return dataclasses.replace(cluster, device=device, devices_per_node=ranks, num_nodes=1, **links)
