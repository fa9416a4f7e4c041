"""The quick estimate's pipeline communication over [candidates, pipeline ranks] arrays, from the exact model's
own functions (cost.p2p.add_hop, tied_grad_reduce_s, step_tail_s): each cut's p2p and what the engine
does around it (Megatron's scatter/gather re-assembly, DeepSpeed's PartitionedTensor, blocking receives of an
unbatched pipeline), and the tied head's gradient all-reduce between the first and the last stage.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from autoplan.cluster.types import ClusterSpec
from autoplan.cost import comm
from autoplan.cost.estimate import tied_pair
from autoplan.cost.kernels import memory_time_s
from autoplan.cost.overlap import contention_fraction
from autoplan.cost.p2p import (
    PARTITION_RECV_BWD,
    PARTITION_RECV_FWD,
    PARTITION_SEND_BWD,
    PARTITION_SEND_FWD,
    overlapped_p2p_saving_s,
    p2p_overlapped,
    partition_meta_bytes,
    partitioned_role_s,
)
from autoplan.cost.pipeline import nic_shared_reduce_s
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig, Schedule
from autoplan.search.collectives import DENSE_DP
from autoplan.search.pricing import Mesh, config_of, per_mesh, price_rows
from autoplan.search.space import SCHEDULES


def crosses_nodes(config: ParallelConfig, axes: tuple[str, ...], cluster: ClusterSpec) -> bool:
    """Whether the group over `axes` of rank 0 spans nodes (cost.comm.group_placement): the one rule the
    quick estimate's pipeline and NIC terms read, per mesh row (`_crosses`) or per candidate (`crosses_s`)."""
    return comm.group_placement(config, axes, cluster.devices_per_node).crosses_nodes


def _crosses(cluster: ClusterSpec, axes: tuple[str, ...]):
    """crosses_nodes of a mesh row (search/pricing.py's `place` form)."""
    return lambda row: crosses_nodes(config_of(row), axes, cluster)


def crosses_s(sizes: Mesh, axes: tuple[str, ...], cluster: ClusterSpec) -> np.ndarray:
    """crosses_nodes per candidate, as floats (1.0 where the group spans nodes), once per quick estimate."""
    return per_mesh(sizes, lambda config: float(crosses_nodes(config, axes, cluster)), (axes, "crosses-nodes"))


def partitioned(c: dict[str, np.ndarray], engine: Engine) -> np.ndarray:
    """cost.p2p.partitioned per candidate: DeepSpeed's PartitionedTensor over tp > 1 without sp."""
    return engine.pp_partitioned_tensors & (c["tp"] > 1) & (c["sp"] == 0)


def collective_p2p(out_bytes: np.ndarray, sizes: Mesh, cluster: ClusterSpec) -> np.ndarray:
    """cost.comm.p2p_s of the activation a pipeline cut sends, on the link the pp group crosses (each
    distinct (mesh, bytes) priced once)."""
    return price_rows(sizes, np.round(out_bytes), _crosses(cluster, ("pp",)), lambda b, cross: comm.p2p_s(b, cross, cluster),
                      ("pp-crosses", "p2p"), skip_nonpositive=False)


def _tp_gather(whole: np.ndarray, sizes: Mesh, cluster: ClusterSpec) -> np.ndarray:
    """comm.all_gather_s of `whole` bytes over each candidate's tp group (collectives.collective_s's prices)."""
    def place(row: tuple[int, ...]) -> Any:
        return comm.group_placement(config_of(row), ("tp",), cluster.devices_per_node)
    return price_rows(sizes, np.round(whole), place, lambda b, group: comm.all_gather_s(b, group, cluster),
                      (("tp",), "ag"))


def _recv_gather(out_bytes: np.ndarray, c: dict[str, np.ndarray], cluster: ClusterSpec, sizes: Mesh,
                 engine: Engine) -> np.ndarray:
    """cost.p2p.pp_recv_gather_s per candidate: the tp all-gather (and the copy out of a list gather)
    that re-assembles each pipeline receive; one per hop on each side, as the p2p itself."""
    if not engine.pp_recv_all_gather:
        return np.zeros(len(out_bytes))
    whole = np.asarray(out_bytes, dtype=float) * c["tp"]
    t = _tp_gather(whole, sizes, cluster)
    if engine.pp_recv_gather_copy:
        t = t + memory_time_s(cluster.device, 2.0 * whole)
    return np.where((c["tp"] > 1) & (c["sp"] == 0) & (whole > 0), t, 0.0)


def pipeline_hops(extra: dict[str, Any], c: dict[str, np.ndarray], cluster: ClusterSpec, sizes: Mesh,
                  engine: Engine, p2p: np.ndarray | None, v: int = 1) -> tuple[Any, Any]:
    """(each rank's per-microbatch pipeline communication in its slot [n, p], the part only the steady state
    pays [n, p]), as cost.p2p.add_hop: each cut's p2p (`p2p`, cut_p2p's; None without a pipeline) and
    re-assembly on both sides, with DeepSpeed's PartitionedTensor its roles' work, and for an unbatched
    pipeline each receive again, steady only; an overlapped p2p (cost.p2p.p2p_overlapped: interleaved rows
    at v > 1) is taken off the steady state instead (a negative steady part: cost.p2p.overlapped_p2p_saving_s)."""
    if p2p is None:
        return 0.0, 0.0
    out_bytes = np.asarray(extra["out_bytes"], dtype=float)
    hops = extra["hops"] * (p2p + _recv_gather(out_bytes, c, cluster, sizes, engine))[:, None]
    steady = extra["hops"] * p2p[:, None] if not engine.pp_p2p_batched else 0.0
    if p2p_overlapped(engine, Schedule.INTERLEAVED, v):
        steady = _overlapped_steady(extra, c, cluster, sizes, p2p, steady)
    if engine.pp_partitioned_tensors:
        part = partitioned(c, engine)
        gather, cpu = _tp_gather(out_bytes * c["tp"], sizes, cluster), bool(cluster.device.cpu_cores)
        role = lambda r: partitioned_role_s(r, out_bytes, c["tp"], gather, cluster.device, cpu)
        send = np.where(part, role(PARTITION_SEND_FWD) + role(PARTITION_SEND_BWD), 0.0)
        recv = np.where(part, role(PARTITION_RECV_FWD) + role(PARTITION_RECV_BWD), 0.0)
        hops = hops + extra["act_sends"] * send[:, None] + extra["act_recvs"] * recv[:, None]
    return hops, steady


def _overlapped_steady(extra: dict[str, Any], c: dict[str, np.ndarray], cluster: ClusterSpec, sizes: Mesh,
                       p2p: np.ndarray, steady: Any) -> Any:
    """pipeline_hops' steady part where the engine overlaps the p2p (cost.p2p.add_hop's overlapped branch): on
    interleaved rows each hop's overlapped_p2p_saving_s at the pp communicator's contention_fraction comes off,
    in place of an unbatched pipeline's receives, capped by the chunk beside the cut (cost.p2p.chunk_slots_s:
    the sending chunk's backward, the receiving chunk's forward) from the chunk tables [n, v, p]. Without
    them (search/surrogate.py builds them for Engine.grad_sync_per_chunk / param_gather_per_chunk, which every
    shipped engine with pp_p2p_overlap has) the saving is uncapped."""
    per_node = cluster.devices_per_node
    frac = per_mesh(sizes, lambda config: contention_fraction(
        cluster, comm.group_placement(config, ("pp",), per_node)), "pp-contention")
    rows = (c["schedule"] == SCHEDULES.index(Schedule.INTERLEAVED))[:, None]
    if "chunk_fwd" not in extra:
        return np.where(rows, -extra["hops"] * overlapped_p2p_saving_s(p2p, frac, np.inf)[:, None], steady)
    fwd = extra["chunk_fwd"]
    v, pp = fwd.shape[1], fwd.shape[2]
    stage = np.arange(v * pp).reshape(v, pp)  # chunk c of rank r: stage c p + r (interleaved: stage_ranks)
    sends, recvs = (stage + 1 < v * pp).astype(float), (stage > 0).astype(float)  # every cut crosses ranks
    hop, share = p2p[:, None, None], frac[:, None, None]
    saved = (sends * overlapped_p2p_saving_s(hop, share, extra["chunk_bwd"])
             + recvs * overlapped_p2p_saving_s(hop, share, fwd)).sum(axis=1)
    return np.where(rows, -saved, steady)


def cut_p2p(extra: dict[str, Any], c: dict[str, np.ndarray], sizes: Mesh, cluster: ClusterSpec, engine: Engine,
            pp: int) -> np.ndarray | None:
    """A cut's transfers per candidate (cost.p2p.add_hop's `hop`), once per quick-estimate piece for
    pipeline_hops and nic_hops: the activation's p2p and, with DeepSpeed's PartitionedTensor, its meta
    tensor's; None without a pipeline."""
    if pp == 1:
        return None
    p2p = collective_p2p(np.asarray(extra["out_bytes"], dtype=float), sizes, cluster)
    if engine.pp_partitioned_tensors:
        meta = collective_p2p(partition_meta_bytes(c["tp"]).astype(float), sizes, cluster)
        p2p = p2p + np.where(partitioned(c, engine), meta, 0.0)
    return p2p


def nic_hops(extra: dict[str, Any], p2p: np.ndarray | None, sizes: Mesh, cluster: ClusterSpec) -> Any:
    """Each rank's per-microbatch pipeline p2p that crosses nodes [n, p] (cost.p2p.add_hop's Rank.pp_nic): the
    hops' transfers (cut_p2p's `p2p`; None without a pipeline) where the pp group crosses nodes."""
    if p2p is None:
        return 0.0
    return extra["hops"] * (p2p * crosses_s(sizes, ("pp",), cluster))[:, None]


def nic_shared(reduce: np.ndarray, f: dict[str, np.ndarray], extra: dict[str, np.ndarray], p2p: np.ndarray | None,
               cluster: ClusterSpec, sizes: Mesh) -> tuple[np.ndarray, np.ndarray]:
    """cost.dataparallel._nic_shared (pipeline.nic_shared_reduce_s) per [candidate, rank]: where the dense data-parallel group crosses nodes,
    the CP exchange (where the cp group crosses them too) and the pipeline hops across nodes (nic_hops of
    cut_p2p's `p2p`) share its NIC."""
    dp = crosses_s(sizes, DENSE_DP, cluster)[:, None]
    nic_in = f["cp"] * crosses_s(sizes, ("cp",), cluster)[:, None] * dp
    nic_out = nic_hops(extra, p2p, sizes, cluster) * dp
    return nic_shared_reduce_s(reduce, f["time"], nic_in, nic_out)


def tied_reduce(extra: dict[str, Any], c: dict[str, np.ndarray], cluster: ClusterSpec, sizes: Mesh, wire: float,
                pp: int) -> np.ndarray:
    """cost.estimate.tied_grad_reduce_s per candidate: the tied head's V/tp x h gradient all-reduced between
    the first and the last stage (a 2-rank group across nodes when the pp group crosses them), when they run
    on different ranks (extra["last_rank"], the last stage's rank, is not 0)."""
    tied = float(extra.get("tied", 0))
    if not tied or pp == 1 or int(extra.get("last_rank", pp - 1)) == 0:
        return np.zeros(len(c["tp"]))
    crosses = _crosses(cluster, ("pp",))
    return price_rows(sizes, tied / c["tp"] * wire, lambda row: tied_pair(crosses(row)),
                      lambda b, g: comm.all_reduce_s(b, g, cluster), ("tied-pair", "ar"))


def tied_tail(per_rank: np.ndarray, offsets: np.ndarray, tied: np.ndarray, last: int, before_dp: bool) -> np.ndarray:
    """cost.estimate.step_tail_s over [n, p]: the latest end past the pipeline, rank r's reduction per_rank[r]
    starting offsets[r] early, the tied all-reduce joining rank 0 and rank `last` before or after theirs."""
    ends = per_rank - offsets
    if last > 0 and np.any(tied > 0):
        if before_dp:
            start = np.maximum(-offsets[:, 0], -offsets[:, last]) + tied
            first_end, last_end = start + per_rank[:, 0], start + per_rank[:, last]
        else:
            first_end = last_end = np.maximum(ends[:, 0], ends[:, last]) + tied
        ends[:, 0] = np.where(tied > 0, first_end, ends[:, 0])
        ends[:, last] = np.where(tied > 0, last_end, ends[:, last])
    return np.maximum(ends.max(axis=1), 0.0)
