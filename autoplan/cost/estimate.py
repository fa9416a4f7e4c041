"""estimate_config: one training step of a LayerGraph on a cluster under a ParallelConfig, from the
per-layer costs: the pipeline schedule, data-parallel gradient traffic and its overlap, the optimizer
step, peak memory, MFU, and a breakdown of the step time by cause.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoplan.cluster.types import ClusterSpec
from autoplan.cost import comm
from autoplan.cost.compute import memory_time_s
from autoplan.cost.experts import expert_dp_placement
from autoplan.cost.hetero import crosses_groups, default_split, link_p2p_s, rank_clusters
from autoplan.cost.layer import dtype_bytes, estimate_layer
from autoplan.cost.memory import WEIGHT_BYTES_PER_PARAM, model_state_bytes
from autoplan.cost.overlap import exposed_s
from autoplan.cost.pipeline import in_flight_microbatches, pipeline_time_s
from autoplan.cost.stages import check_config, check_stages
from autoplan.cost.types import LayerCost
from autoplan.graph.types import LayerGraph, LayerRole
from autoplan.plan.layout import stage_ranks
from autoplan.plan.types import Breakdown, Estimate, MemoryBreakdown, ParallelConfig, Recompute

# Adam step per local parameter, memory-bound (Kingma & Ba 2015 update; PyTorch fused / apex multi-tensor
# Adam): read fp32 master weight, momentum, variance (12) and write them (12), read the 16-bit gradient
# twice (global-norm clipping, then the step: 4), write the 16-bit weight copy (2).
ADAM_BYTES_PER_PARAM = 30
# Bytes per gradient element on the wire in the data-parallel reduction, by training dtype. bf16 training
# reduces gradients in fp32 in the runtimes the model is compared with: Megatron-LM turns on
# --accumulate-allreduce-grads-in-fp32 whenever --bf16 is set (megatron/training/arguments.py: "bf16
# requires gradient accumulation and all-reduce to be performed in fp32"); torchtitan's FSDP2
# MixedPrecisionPolicy reduces in fp32 by default (mixed_precision_reduce = "float32"); Llama 3
# reduce-scatters gradients in fp32 across data-parallel workers (Dubey et al. 2024, arXiv 2407.21783,
# section 3.3.4). fp8 recipes run on top of bf16 (Transformer Engine), so they reduce in fp32 too; fp16
# keeps Megatron's default of fp16 gradients. The gradient memory (memory.py) stays 16-bit.
GRAD_REDUCE_BYTES = {"fp8": 4, "bf16": 4, "fp16": 2, "tf32": 4, "fp32": 4}


@dataclass(slots=True)
class _Rank:
    """One pipeline rank's per-microbatch times and its memory, summed over its chunks."""

    compute: float = 0.0
    recompute: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0
    pp: float = 0.0
    dp: float = 0.0  # per-microbatch exposed ZeRO-2/3 traffic
    fwd: float = 0.0
    bwd: float = 0.0
    weight: float = 0.0
    act_bytes: float = 0.0
    work_bytes: float = 0.0
    dense_params: float = 0.0
    expert_params: float = 0.0
    max_layer_params: float = 0.0
    dp_tail: float = 0.0  # gradient reduction after the last microbatch, not hidden by the backward

    @property
    def slot(self) -> float:
        return self.fwd + self.bwd


def estimate_config(graph: LayerGraph, cluster: ClusterSpec, config: ParallelConfig, *, global_batch: int,
                    stages: tuple[tuple[str, ...], ...] | None = None,
                    layer_recompute: Mapping[str, Recompute] | None = None,
                    overlap_dp: bool = True) -> Estimate:
    """Predicted step of `global_batch` sequences of graph.seq_len tokens.

    `overlap_dp` (an additive extension of the contract, default True): whether the data-parallel
    gradient reduction overlaps the backward (PyTorch DDP / FSDP buckets, Megatron's
    --overlap-grad-reduce); False models Megatron's "local" DDP, which all-reduces the whole gradient
    buffer after the pipeline schedule returns. Step time = pipeline time (see pipeline_time_s) +
    exposed gradient reduction after the last microbatch + ZeRO-1/2 parameter all-gather + optimizer."""
    m = check_config(graph, cluster, config, global_batch)
    p, v = config.pp, config.virtual_stages
    views = rank_clusters(cluster, config)  # each pipeline rank's own node group when heterogeneous
    stages = (default_split(graph, cluster, config, global_batch) if stages is None
              else check_stages(graph, stages, p * v))
    placement = stage_ranks(config)  # the executor places stages with the same function
    overrides = {k: Recompute(r) for k, r in (layer_recompute or {}).items()}
    envs = {id(view): _env(graph, view, config, overrides) for view in views}
    ranks = [_Rank() for _ in range(p)]
    dbytes = dtype_bytes(cluster.dtype)
    for i, names in enumerate(stages):
        rank, env = ranks[placement[i]], envs[id(views[placement[i]])]
        _add_stage(rank, [env.costs[n] for n in names], env.view, config, env.dense_group, env.expert_group,
                   dbytes, overlap_dp)
        # Narayanan et al. 2021 section 4.1: each tp rank sends 1/t (scatter/gather); consecutive stages
        # on one rank (the V's turn) hand over locally; between node groups over cluster.inter_group
        if i + 1 < len(stages) and placement[i + 1] != placement[i]:
            out_bytes = env.costs[names[-1]].output_bytes
            hop = (link_p2p_s(out_bytes, cluster.inter_group)
                   if crosses_groups(cluster, config, placement[i], placement[i + 1])
                   else comm.p2p_s(out_bytes, env.pp_cross, env.view))
            rank.pp += hop
            rank.fwd += hop
            ranks[placement[i + 1]].pp += hop
            ranks[placement[i + 1]].bwd += hop
    pipe = pipeline_time_s(config.schedule, p, v, m, [r.fwd for r in ranks], [r.bwd for r in ranks],
                           [r.weight for r in ranks])
    offsets = [sum(r.bwd for r in ranks[:k]) for k in range(p)]
    dp_tail = max(0.0, max(r.dp_tail - off for r, off in zip(ranks, offsets)))
    param_gather = max(_param_gather_s(r, envs[id(view)].view, config, envs[id(view)].dense_group,
                                       envs[id(view)].expert_group, dbytes) for r, view in zip(ranks, views))
    optimizer = max(_optimizer_s(r, view, config) for r, view in zip(ranks, views))
    step = pipe + dp_tail + param_gather + optimizer
    breakdown = _breakdown(ranks, m, pipe, dp_tail + param_gather, optimizer)
    memories = [_memory(r, k, views[k], config, m, dbytes) for k, r in enumerate(ranks)]
    # the most loaded rank against its own device (the same device everywhere when homogeneous)
    k_peak = max(range(p), key=lambda k: memories[k].total_bytes / views[k].device.mem_bytes)
    peak, capacity = memories[k_peak], views[k_peak].device.mem_bytes
    model_flops, hardware_flops = _flops(graph, config, global_batch, overrides)
    peak_flops = cluster.total_peak_flops
    return Estimate(
        step_time_s=step, tokens_per_s=global_batch * graph.seq_len / step,
        mfu=model_flops / (step * peak_flops), peak_mem_bytes=peak.total_bytes,
        mem_capacity_bytes=capacity, fits=peak.total_bytes <= capacity,
        breakdown=breakdown, memory=peak, model_flops=model_flops, hardware_flops=hardware_flops,
    )


@dataclass(slots=True)
class _Env:
    """What the ranks of one node group share: the cluster they are priced on, their layers' costs and
    where their groups sit (one of these for a homogeneous cluster)."""

    view: ClusterSpec
    costs: dict[str, LayerCost]
    pp_cross: bool
    dense_group: comm.GroupPlacement
    expert_group: comm.GroupPlacement


def _env(graph: LayerGraph, view: ClusterSpec, config: ParallelConfig, overrides: Mapping[str, Recompute]) -> _Env:
    costs: dict[str, LayerCost] = {}
    by_kind: dict[tuple[str, Recompute], LayerCost] = {}  # identical layers share a kind (graph.types)
    for layer in graph.layers:
        mode = overrides.get(layer.name, config.recompute)
        key = (layer.kind, mode)
        if key not in by_kind:
            by_kind[key] = estimate_layer(layer, view, config, mode, seq_len=graph.seq_len,
                                          graph_microbatch=graph.microbatch)
        costs[layer.name] = by_kind[key]
    dpn = view.devices_per_node
    return _Env(view=view, costs=costs, pp_cross=comm.group_placement(config, ("pp",), dpn).crosses_nodes,
                dense_group=comm.group_placement(config, ("dp", "ep", "cp"), dpn),
                expert_group=expert_dp_placement(config, dpn))


def _add_stage(rank: _Rank, costs: Sequence[LayerCost], cluster: ClusterSpec, config: ParallelConfig,
               dense_group: comm.GroupPlacement, expert_group: comm.GroupPlacement, dbytes: int,
               overlap_dp: bool) -> None:
    """Add one chunk's layers to its rank: compute, comm, memory, and the data-parallel traffic.

    ZeRO-3 (FSDP) all-gathers each layer's weights before its forward and again before its backward
    and reduce-scatters its gradients after the backward, every microbatch; ZeRO-2 reduce-scatters
    every microbatch (each rank keeps only its gradient shard: DeepSpeed ZeRO-2, FSDP SHARD_GRAD_OP).
    Both are prefetched / bucketed on a second stream (overlapped_s); only what the compute does not
    hide counts, per microbatch. ZeRO-0/1 reduce once per step after the last microbatch (all-reduce,
    or reduce-scatter for ZeRO-1) in per-layer buckets issued as each layer's backward finishes,
    overlapped with the backward of the remaining layers (PyTorch DDP, Li et al. VLDB 2020); the
    exposed part is what is still running when this rank's last backward ends: at least the last
    bucket, the first layer's. Gradients travel at GRAD_REDUCE_BYTES per element (fp32 under bf16)."""
    fwd = [c.fwd_s + c.fwd_comm_s for c in costs]
    bwd = [c.time_s - f for c, f in zip(costs, fwd)]
    none = [0.0] * len(costs)
    memo: dict[tuple[int, str], float] = {}  # layers of one kind share one LayerCost object

    def collective(c: LayerCost, fn, element_bytes: float) -> float:
        key = (id(c), fn.__name__)
        if key not in memo:
            memo[key] = _dp_collective(c, cluster, dense_group, expert_group, fn, element_bytes)
        return memo[key]

    gather = ([collective(c, comm.all_gather_s, WEIGHT_BYTES_PER_PARAM * dbytes / 2) for c in costs]
              if config.zero == 3 else none)
    reduce_fn = comm.reduce_scatter_s if config.zero >= 1 else comm.all_reduce_s
    reduce = [collective(c, reduce_fn, GRAD_REDUCE_BYTES[cluster.dtype]) for c in costs]
    dp_fwd = exposed_s(fwd, gather, none) if config.zero == 3 else 0.0
    if config.zero >= 2:
        pre = gather[::-1] if config.zero == 3 else none
        dp_bwd = exposed_s(bwd[::-1], pre, reduce[::-1])
    else:
        dp_bwd = 0.0
        if overlap_dp:
            rank.dp_tail += exposed_s(bwd[::-1], none, reduce[::-1])
        else:
            rank.dp_tail += _dp_collective_total(costs, cluster, config, dense_group, expert_group)
    rank.compute += sum(c.fwd_s + c.bwd_s for c in costs)
    rank.recompute += sum(c.recompute_s for c in costs)
    rank.tp += sum(c.tp_comm_s for c in costs)
    rank.cp += sum(c.cp_comm_s for c in costs)
    rank.ep += sum(c.ep_comm_s for c in costs)
    rank.dp += dp_fwd + dp_bwd
    rank.fwd += sum(fwd) + dp_fwd
    rank.bwd += sum(bwd) + dp_bwd
    rank.weight += sum(c.bwd_weight_s for c in costs)
    rank.act_bytes += sum(c.act_mem_bytes for c in costs)
    rank.work_bytes = max([rank.work_bytes] + [c.work_mem_bytes for c in costs])
    rank.dense_params += sum(c.grad_param_count for c in costs)
    rank.expert_params += sum(c.expert_param_count for c in costs)
    rank.max_layer_params = max([rank.max_layer_params] + [c.param_count for c in costs])


def _dp_collective(cost: LayerCost, cluster: ClusterSpec, dense_group, expert_group, fn,
                   element_bytes: float) -> float:
    """One layer's data-parallel collective of element_bytes per parameter: dense parameters over
    dp * ep * cp, experts over dp * cp."""
    return (fn(cost.grad_param_count * element_bytes, dense_group, cluster)
            + fn(cost.expert_param_count * element_bytes, expert_group, cluster))


def _dp_collective_total(costs: Sequence[LayerCost], cluster: ClusterSpec, config: ParallelConfig,
                         dense_group, expert_group) -> float:
    """Megatron local DDP: one all-reduce (ZeRO-1: reduce-scatter) of the whole contiguous buffer."""
    fn = comm.reduce_scatter_s if config.zero >= 1 else comm.all_reduce_s
    scale = GRAD_REDUCE_BYTES[cluster.dtype]
    return (fn(sum(c.grad_param_count for c in costs) * scale, dense_group, cluster)
            + fn(sum(c.expert_param_count for c in costs) * scale, expert_group, cluster))


def _param_gather_s(rank: _Rank, cluster: ClusterSpec, config: ParallelConfig, dense_group, expert_group,
                    dbytes: int) -> float:
    """ZeRO-1/2: after the optimizer updates its shard, each rank all-gathers the 16-bit weights
    (Rajbhandari et al. 2020, section 5); counted exposed (before the next step's forward)."""
    if config.zero not in (1, 2):
        return 0.0
    scale = WEIGHT_BYTES_PER_PARAM * dbytes / 2
    return (comm.all_gather_s(rank.dense_params * scale, dense_group, cluster)
            + comm.all_gather_s(rank.expert_params * scale, expert_group, cluster))


def _optimizer_s(rank: _Rank, cluster: ClusterSpec, config: ParallelConfig) -> float:
    """Adam over the local shard (params / d under ZeRO >= 1), memory-bound: ADAM_BYTES_PER_PARAM per
    parameter at the device's streaming bandwidth."""
    d_dense = config.dp * config.ep * config.cp if config.zero >= 1 else 1
    d_expert = config.expert_dp if config.zero >= 1 else 1
    local = rank.dense_params / d_dense + rank.expert_params / d_expert
    return memory_time_s(cluster.device, local * ADAM_BYTES_PER_PARAM)


def _memory(rank: _Rank, index: int, cluster: ClusterSpec, config: ParallelConfig, m: int,
            dbytes: int) -> MemoryBreakdown:
    """Model states (memory.model_state_bytes), ZeRO-3's gathered working copy of two layers (the one
    computing and the one prefetched), activations held for in-flight microbatches
    (pipeline.in_flight_microbatches) plus one layer's backward working set, and the runtime reserve."""
    weights, grads, optimizer = model_state_bytes(rank.dense_params, rank.expert_params, config)
    scale = dbytes / 2
    if config.zero == 3:
        weights += 2 * rank.max_layer_params * WEIGHT_BYTES_PER_PARAM
    in_flight = in_flight_microbatches(config.schedule, config.pp, config.virtual_stages, m, index)
    acts = rank.act_bytes * in_flight + rank.work_bytes
    return MemoryBreakdown(weights=int(weights * scale), gradients=int(grads * scale), optimizer=int(optimizer),
                           activations=int(acts), reserve=cluster.device.runtime_reserve_bytes)


def _breakdown(ranks: Sequence[_Rank], m: int, pipe: float, dp_after: float, optimizer: float) -> Breakdown:
    """Exposed seconds per cause. The slowest rank's per-microbatch slot, times m, is split into its
    causes; the rest of the pipeline time is the bubble; then the step's tail."""
    slow = max(ranks, key=lambda r: r.slot)
    bubble = pipe - m * slow.slot
    if bubble < 1e-12 * pipe:  # a single stage: only rounding is left
        bubble = 0.0
    return Breakdown(
        compute=m * slow.compute, recompute=m * slow.recompute, tp_comm=m * slow.tp, cp_comm=m * slow.cp,
        ep_comm=m * slow.ep, pp_comm=m * slow.pp, dp_comm=m * slow.dp + dp_after,
        pp_bubble=bubble, optimizer=optimizer,
    )


def _flops(graph: LayerGraph, config: ParallelConfig, global_batch: int,
           overrides: Mapping[str, Recompute]) -> tuple[float, float]:
    """(model, hardware) FLOPs per step. Model FLOPs: 3 x the forward matmul + attention FLOPs
    (forward + backward = 2 x forward), no recompute (Chowdhery et al. 2022, appendix B; for GPT this
    is Narayanan et al.'s 72 B s l h^2 (1 + s/(6h) + V/(12 l h))). Hardware FLOPs add the recomputed
    forward: the whole block under full recompute, its attention core under selective."""
    per_seq = global_batch / graph.microbatch
    model = hardware = 0.0
    for layer in graph.layers:
        core = layer.fwd_matmul_flops + layer.fwd_attention_flops
        model += 3.0 * core * per_seq
        mode = overrides.get(layer.name, config.recompute)
        if layer.role is LayerRole.BLOCK and mode is Recompute.FULL:
            hardware += core * per_seq
        elif layer.role is LayerRole.BLOCK and mode is Recompute.SELECTIVE:
            hardware += layer.fwd_attention_flops * per_seq
    return model, model + hardware
