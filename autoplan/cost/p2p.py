"""Pipeline point-to-point: what one cut between two pipeline ranks costs each side per microbatch, as the
engine runs it: the p2p transfers (blocking or batched), Megatron's scatter/gather re-assembly over tp, and
DeepSpeed's PartitionedTensor work. Used by cost/estimate.py (exact) and search/pipeline_terms.py (the quick
estimate's arrays).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from autoplan.cluster.types import ClusterSpec, DeviceSpec
from autoplan.cost import comm
from autoplan.cost.compute import sync_copy_s
from autoplan.cost.dataparallel import DpGroups, Rank
from autoplan.cost.hetero import crosses_groups, link_p2p_s
from autoplan.cost.kernels import memory_time_s
from autoplan.cost.overlap import contention_fraction
from autoplan.cost.types import LayerCost
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig, Schedule


@dataclass(slots=True)
class StageEnv:
    """What the ranks of one node group share: the cluster they are priced on, their layers' costs, their
    data-parallel groups and whether the pipeline crosses nodes (one of these when homogeneous)."""

    view: ClusterSpec
    costs: dict[str, LayerCost]
    groups: DpGroups
    pp_cross: bool


# DeepSpeed v0.10.0 deepspeed/runtime/pipe/engine.py with tp > 1 (is_pipe_partitioned = is_grad_partitioned =
# is_model_parallel) sends every activation and gradient as a PartitionedTensor (deepspeed/runtime/utils.py).
# Per pipeline cut and microbatch, each side's work as (passes over the whole activation A, passes over its
# 1/tp chunk c, all-gathers of A over tp, synchronising copies), a pass being a read or a write:
# - the activation's sender, forward: _exec_forward_pass PartitionedTensor(first_output): narrow().clone() of
#   its chunk (2c); to_meta(): torch.LongTensor(meta).to(device), a host-to-device copy that synchronises;
# - its receiver, forward: _exec_recv_activations buffer.clone() (2c), _exec_forward_pass inputs clone() (2c),
#   PartitionedTensor.from_meta: meta.tolist() (a device-to-host copy that synchronises), full(): torch.zeros
#   of A (1A), copy_ of the local chunk (2c), dist.all_gather into a list of views (PyTorch's
#   ProcessGroupNCCL::allgather gathers into a flat buffer and copies each chunk out: 2A), .clone() (2A);
# - the activation's sender, backward: _exec_backward_pass from_meta + full() of its own output (zeroed after
#   the send) and of the received gradient: twice (5A + 2c, 1 gather, 1 sync);
# - its receiver, backward: _exec_send_grads PartitionedTensor(inputs.grad): clone of its chunk, to_meta.
PARTITION_SEND_FWD = (0, 2, 0, 1)
PARTITION_RECV_FWD = (5, 6, 1, 1)
PARTITION_SEND_BWD = (10, 4, 2, 2)
PARTITION_RECV_BWD = (0, 2, 0, 1)


def partition_meta_bytes(tp: int) -> int:
    """PartitionedTensor.to_meta's int64 tensor, sent before each chunk: [ndims, s, b, h, num_parts, rank,
    partition (tp + 1 offsets)]."""
    return 8 * (1 + 3 + 2 + tp + 1)


def partitioned_role_s(role: tuple[int, int, int, int], chunk_bytes: Any, tp: Any, gather_s: Any,
                       device: DeviceSpec, cpu: bool) -> Any:
    """One side's PartitionedTensor work (a PARTITION_* role) for a chunk of chunk_bytes (1/tp of the
    activation): its passes at streaming bandwidth, its all-gathers of the whole (gather_s each) and its
    synchronising copies at compute.sync_copy_s each (none on a CPU profile): the copy's latency and the
    next op's issue on the drained device, also under Engine.launch_blocking, since no host time of the
    role's own ops (clone, zeros, copy_) is counted anywhere, so that issue is not already in series as a
    layer's is (compute._sync_copies_s). Numbers or numpy arrays."""
    whole, chunk, gathers, syncs = role
    sync = 0.0 if cpu else syncs * sync_copy_s(device, issue_counted=False)
    return memory_time_s(device, chunk_bytes * (chunk + whole * tp)) + gathers * gather_s + sync


def pp_recv_gather_s(chunk_bytes: float, config: ParallelConfig, cluster: ClusterSpec, engine: Engine) -> float:
    """What re-assembling one pipeline receive costs its rank under Megatron's scatter/gather (Narayanan et
    al. 2021 section 4.1; engine.pp_recv_all_gather): each tp rank was sent `chunk_bytes`, 1/tp of the
    activation (or its gradient), and all-gathers the whole, tp x chunk_bytes, over its tp group on the
    compute stream before using it (Megatron-LM a8d172b3 megatron/p2p_communication.py _communicate ->
    mpu.gather_split_1d_tensor); with engine.pp_recv_gather_copy the gather lands in a list of chunk views
    (torch.distributed.all_gather), which PyTorch's ProcessGroupNCCL::allgather fills by gathering into a
    flat buffer and copying each chunk out: a read and a write of the whole (Megatron replaced it by
    _all_gather_base in 2022 for that reason: 55ba1f7b mpu/random.py gather_split_1d_tensor's comment).
    Zero without tp or with sequence parallelism (whose activations stay split: 55ba1f7b turns the
    scatter/gather off under --sequence-parallel)."""
    if not engine.pp_recv_all_gather or config.tp == 1 or config.sp or chunk_bytes <= 0:
        return 0.0
    whole = chunk_bytes * config.tp
    group = comm.group_placement(config, ("tp",), cluster.devices_per_node)
    copy = memory_time_s(cluster.device, 2.0 * whole) if engine.pp_recv_gather_copy else 0.0
    return comm.all_gather_s(whole, group, cluster) + copy


def p2p_overlapped(engine: Engine, schedule: Schedule | str, v: int) -> bool:
    """Whether the engine overlaps a pipeline's p2p with its compute under this schedule (Engine.pp_p2p_overlap):
    Megatron-Core's --overlap-p2p-communication (on by default: megatron/training/arguments.py core_r0.8.0
    `--no-overlap-p2p-communication` store_false dest overlap_p2p_comm) exists only in the interleaved schedule:
    validate_args sets args.overlap_p2p_comm = False without --num-layers-per-virtual-pipeline-stage ('non-interleaved
    schedule does not support overlapping p2p communication'), and forward_backward_pipelining_without_interleaving
    raises on it (megatron/core/pipeline_parallel/schedules.py)."""
    return engine.pp_p2p_overlap and Schedule(str(schedule).lower()) is Schedule.INTERLEAVED and v > 1


def overlapped_p2p_saving_s(hop_s: Any, frac: Any, slot_s: Any) -> Any:
    """What an overlapped transfer of hop_s seconds takes off a rank's steady-state slot: the part of it that
    runs beside the compute `slot_s` launched after it, min(hop_s, slot_s), but the compute its NCCL kernel
    slows meanwhile (overlap.hidden_penalty_s's rule, `frac` the pp communicator's contention_fraction).
    Megatron-Core core_r0.8.0 (baf94af3) megatron/core/pipeline_parallel/schedules.py
    forward_backward_pipelining_with_interleaving under overlap_p2p_comm, steady state: after each forward,
    p2p_communication.send_forward_recv_forward(..., overlap_p2p_comm=True) returns the isend / irecv handles
    (p2p_communication._communicate -> _p2p_ops, torch.distributed.isend / irecv on their own NCCL stream),
    then the backward_step_helper runs, and `req.wait()` on fwd_wait_handles comes only before the next
    forward_step_helper; the backward's send / receive likewise (bwd_wait_handles, waited before the next
    backward, the next forward run in between). So a forward's transfer hides behind one backward and a
    backward's behind one forward: a hop longer than that chunk waits out the rest before the next chunk
    (`slot_s`: add_hop's slots). The fill and drain still wait for it along the chain (pipeline_time_s:
    steady_s takes it off X_r only). Numbers or numpy arrays."""
    return np.minimum(hop_s, slot_s) * (1.0 - frac)


def add_hop(ranks: list[Rank], a: int, b: int, env_of: list[StageEnv], out_bytes: float, cluster: ClusterSpec,
             config: ParallelConfig, engine: Engine, slots: tuple[float, float]) -> None:
    """One pipeline cut between ranks a (sender of the activation) and b, per microbatch. Each tp rank sends
    1/t (Narayanan et al. 2021 section 4.1, scatter/gather); between node groups over cluster.inter_group.
    The sender's stream carries each transfer: a's forward the activation, b's backward the gradient. The
    receiver re-assembles what it got over its tp group: b before its forward, a before its backward
    (Engine.pp_recv_all_gather).

    Unbatched p2p (Engine.pp_p2p_batched False): DeepSpeed v0.10.0 deepspeed/runtime/pipe/engine.py issues
    each transfer as a blocking p2p.send / p2p.recv of its own (p2p.py: dist.send / dist.recv), in
    schedule.py TrainSchedule.steps' order: a forward step runs SendGrad(previous microbatch), RecvActivation,
    ForwardPass; a backward step RecvGrad, SendActivation(previous), BackwardPass. An ncclSend / ncclRecv
    outside a group "is blocking for the GPU" until its peer's matching call runs (NCCL user guide, Point To
    Point Communication Functions), and torch.distributed.send / recv wait for it on the compute stream
    (ProcessGroupNCCL Work.wait), so in the steady state
    a rank's slot also holds every transfer it receives: an inner rank 4 transfers per microbatch (2 when
    batched), the end ranks 2. In the fill and drain each receive is the transfer the sender's slot already
    carries along the chain, so the receives are steady-state time only (Rank.recv_wait, pipeline_time_s
    steady_s). A rendezvous simulation of TrainSchedule (tests/unit/test_cost_p2p_unbatched.py) gives
    (m + p - 1)(F + B) + (4m + 2p - 8) T for p >= 3, m >= 2 and uniform stages (T < F, B) and 2mT for
    p = 2; this gives (4m + 2p - 4) T and (2m + 1) T. Batched (a8d172b3 Megatron-LM's 1F1B simulated the
    same way): (2m + 2p - 5) T for p >= 3, m >= 3, and (m + 1) T for p = 2; this gives (2m + 2p - 4) T and
    (m + 1) T.

    Overlapped p2p (p2p_overlapped: Megatron-Core's interleaved schedule): each side's slot keeps the transfer
    for the fill and drain, and Rank.p2p_hidden takes overlapped_p2p_saving_s of it off the steady state, capped
    by `slots` (a's, b's): the compute each side's transfer hides behind, one backward on a (its activation's
    send runs beside the backward after the forward), one forward on b (its gradient's beside the next
    forward). estimate_config passes the chunks beside the cut (chunk_slots_s)."""
    env_a, env_b = env_of[a], env_of[b]
    inter = crosses_groups(cluster, config, a, b)
    part = partitioned(config, engine)
    sizes = (out_bytes, partition_meta_bytes(config.tp)) if part else (out_bytes,)
    hop = sum(link_p2p_s(n, cluster.inter_group) if inter else comm.p2p_s(n, env_a.pp_cross, env_a.view)
              for n in sizes)  # a partitioned transfer: its meta tensor, then the chunk, each a p2p of its own
    if part:
        _add_partitioned(ranks, a, b, env_of, out_bytes, config)
    gather_fwd = pp_recv_gather_s(out_bytes, config, env_b.view, engine)
    gather_bwd = pp_recv_gather_s(out_bytes, config, env_a.view, engine)
    if inter or env_a.pp_cross:  # on the NIC the data-parallel traffic may use too (pipeline.nic_shared_reduce_s)
        ranks[a].pp_nic += hop
        ranks[b].pp_nic += hop
    ranks[a].pp += hop + gather_bwd
    ranks[a].fwd += hop
    ranks[a].bwd += gather_bwd
    ranks[b].pp += hop + gather_fwd
    ranks[b].bwd += hop
    ranks[b].fwd += gather_fwd
    if p2p_overlapped(engine, config.schedule, config.virtual_stages):
        view = env_a.view
        frac = contention_fraction(view, comm.group_placement(config, ("pp",), view.devices_per_node))
        for k, slot in zip((a, b), slots):
            saved = overlapped_p2p_saving_s(hop, frac, slot)
            ranks[k].p2p_hidden += saved
            ranks[k].pp -= saved
    elif not engine.pp_p2p_batched:
        for k in (a, b):
            ranks[k].recv_wait += hop
            ranks[k].pp += hop


def chunk_slots_s(sender: list[LayerCost], receiver: list[LayerCost]) -> tuple[float, float]:
    """add_hop's slots for the cut after the chunk `sender` (on rank a) into the chunk `receiver` (on rank b):
    one microbatch's backward of the sending chunk and forward of the receiving one, as add_layers splits a
    layer's time_s (forward: LayerCost.forward_s). The compute a transfer hides behind is, in the steady state,
    the next chunk the rank runs (overlapped_p2p_saving_s), which cycles through the rank's chunks
    (schedules.py get_model_chunk_id); it is priced as the chunk beside the cut, the same for a model's equal
    middle chunks."""
    return sum(c.time_s - c.forward_s for c in sender), sum(c.forward_s for c in receiver)


def partitioned(config: ParallelConfig, engine: Engine) -> bool:
    return engine.pp_partitioned_tensors and config.tp > 1 and not config.sp


def _add_partitioned(ranks: list[Rank], a: int, b: int, env_of: list[StageEnv], chunk_bytes: float,
                     config: ParallelConfig) -> None:
    """DeepSpeed's PartitionedTensor work around one cut (Engine.pp_partitioned_tensors, PARTITION_* roles):
    a sends the activation and receives its gradient, b the reverse; the gathers over each side's tp group."""
    for k, fwd_role, bwd_role in ((a, PARTITION_SEND_FWD, PARTITION_SEND_BWD), (b, PARTITION_RECV_FWD,
                                                                             PARTITION_RECV_BWD)):
        view = env_of[k].view
        group = comm.group_placement(config, ("tp",), view.devices_per_node)
        gather = comm.all_gather_s(chunk_bytes * config.tp, group, view)
        cpu = bool(view.device.cpu_cores)
        f = partitioned_role_s(fwd_role, chunk_bytes, config.tp, gather, view.device, cpu)
        g = partitioned_role_s(bwd_role, chunk_bytes, config.tp, gather, view.device, cpu)
        ranks[k].fwd += f
        ranks[k].bwd += g
        ranks[k].pp += f + g
