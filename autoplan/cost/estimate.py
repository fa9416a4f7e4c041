"""estimate_config: one training step of a LayerGraph on a cluster under a ParallelConfig and an Engine,
from the per-layer costs: the pipeline schedule, data-parallel traffic as the engine runs ZeRO
(plan.layout.zero_layout; DeepSpeed's stage 3 in cost/deepspeed.py), the optimizer step, peak memory
(cost/memory.py), MFU, and a breakdown of the step time by cause.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from autoplan.cluster.types import ClusterSpec
from autoplan.cost import comm
from autoplan.cost.dataparallel import (
    DpGroups,
    Rank,
    add_layers,
    dp_groups,
    rank_dp_times,
)
from autoplan.cost.deepspeedrank import deepspeed_rank
from autoplan.cost.gradpasses import grad_wire_bytes
from autoplan.cost.hetero import default_split, rank_clusters
from autoplan.cost.kernels import memory_time_s
from autoplan.cost.layer import estimate_layer
from autoplan.cost.memory import rank_memory, state_bytes_per_param
from autoplan.cost.p2p import StageEnv, add_hop, chunk_slots_s, p2p_overlapped, pp_recv_gather_s
from autoplan.cost.pipeline import chunks_per_rank, pipeline_time_s, reduce_stream_floor_s
from autoplan.cost.stages import check_config, check_stages
from autoplan.cost.timeline import shared_cores_pipeline_time_s
from autoplan.cost.types import GroupPlacement, LayerCost
from autoplan.graph.types import LayerGraph, LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.layout import stage_ranks, zero_layout
from autoplan.plan.types import Breakdown, Estimate, ParallelConfig, Recompute, Schedule

# The optimizer step per local parameter, memory-bound passes (PyTorch / apex multi-tensor kernels):
# - Adam itself (Kingma & Ba 2015; torch.optim.AdamW, apex FusedAdam): read the fp32 weight, gradient,
#   momentum and variance, write weight, momentum and variance: 28 bytes;
# - global-norm gradient clipping (torch.nn.utils.clip_grad_norm_, Megatron clip_grad_norm_fp32): the norm
#   reads the fp32 gradient, the scale reads and writes it: 12 bytes;
# - mixed precision with a separate fp32 master copy (Megatron Float16OptimizerWithFloat16Params, DeepSpeed):
#   copy the master weights back to the 16-bit model (read 4, write 2); when the gradients live in 16 bits
#   (fp16, no fp32 main_grad) first copy them to fp32 main grads (read 2, write 4);
# - fp16 loss scaling: unscale and check for inf / nan (torch._amp_foreach_non_finite_check_and_unscale_:
#   read and write the fp32 gradient, 8 bytes).
# Megatron-LM fp16: 28 + 12 + 6 + 6 + 8 = 60 bytes; Megatron bf16 with fp32 main grads: 46; FSDP2 (fp32
# sharded parameters cast to bf16 at the all-gather) and fp32 training: 40.
# The 28 bytes are one fused kernel (Engine.fused_adam: apex / DeepSpeed FusedAdam). torch.optim.AdamW
# without fused=True runs each pass as its own kernel over the fp32 tensors (torch/optim/adamw.py
# _single_tensor_adamw, and _multi_tensor_adamw with foreach: the same passes as foreach kernels), (read,
# write) bytes per parameter: weight decay param.mul_ (4, 4), exp_avg.lerp_(grad) (8, 4), exp_avg_sq.mul_
# (4, 4), .addcmul_(grad, grad) (8, 4), exp_avg_sq.sqrt() (4, 4), / bias_correction2_sqrt (4, 4), + eps
# (4, 4), param.addcdiv_(exp_avg, denom) (12, 4): 80 bytes.
ADAM_BYTES_PER_PARAM = 28
UNFUSED_ADAM_BYTES_PER_PARAM = 80
CLIP_BYTES_PER_PARAM = 12
# Bytes per gradient element on the wire, by training dtype, when the engine reduces bf16 / fp8 gradients
# in fp32 (Engine.grad_reduce_fp32): Megatron-LM turns on --accumulate-allreduce-grads-in-fp32 whenever
# --bf16 is set (megatron/training/arguments.py); torchtitan's FSDP2 MixedPrecisionPolicy reduces in fp32;
# Llama 3 reduce-scatters gradients in fp32 (Dubey et al. 2024, arXiv 2407.21783, section 3.3.4). fp16
# keeps 16-bit gradients on the wire (Megatron's and DeepSpeed's default).
GRAD_REDUCE_BYTES = {"fp8": 4, "bf16": 4, "fp16": 2, "tf32": 4, "fp32": 4}


# DeepSpeed's BF16_Optimizer.step (Engine.hp_grads: deepspeed/runtime/bf16_optimizer.py, v0.6.2 = 56c522386 and
# the bigscience branch olruwase/bf16-updates that BLOOM trained with, 0ad7c7d32, the same step) norms and clears
# the fp32 gradients of the whole local model, not the data-parallel shard its Adam updates: get_global_norm_of_tensors(
# get_grads_for_norm()) reads fp32_groups_gradients, every local parameter's (runtime/utils.py: `t.data.float().norm(2)`
# per tensor), 4 bytes; clear_hp_grads zeroes fp32_groups_gradients_flat, the whole local buffer, 4 bytes written.
# clip_tensors_by_global_norm scales them (`t.mul_(clip_coef)`) only when `clip_coef < 1`, i.e. a global norm above
# gradient_clipping: BLOOM's logged steady-state norms are below its 1.0 (grad norm 0.765 at the GBS 16 step,
# 0.132-0.150 at GBS 2048: bigscience tr11-176B-ml README / chronicles), so not priced. Counted on every local
# parameter, though get_grads_for_norm skips a tied copy on all but the first of its stages (pipe/module.py
# _index_tied_modules: ds_pipe_replicated) and, on tensor-parallel ranks but the first, the replicated
# (non-model-parallel) parameters: 4 bytes per tied element on the last stage, which the first stage's
# owner copy matches, so the step's maximum over ranks is the first stage's whenever their layers balance.
HP_GRAD_STEP_BYTES = 4 + 4


def optimizer_bytes(dtype: str, engine: Engine, shard: Any, local: Any) -> Any:
    """Memory traffic of the optimizer step of a rank holding `local` parameters whose optimizer updates `shard`
    of them: adam_bytes_per_param over the shard; under DeepSpeed's BF16_Optimizer (engine.hp_grads(dtype)) its
    global norm over the shard (CLIP_BYTES_PER_PARAM) is replaced by HP_GRAD_STEP_BYTES over every local
    parameter (the norm and clear_hp_grads). Scalars or numpy arrays (the quick estimate)."""
    per = adam_bytes_per_param(dtype, engine)
    if not engine.hp_grads(dtype):
        return shard * per
    return shard * (per - CLIP_BYTES_PER_PARAM) + local * HP_GRAD_STEP_BYTES


def adam_bytes_per_param(dtype: str, engine: Engine) -> float:
    """Memory traffic of the optimizer step per local parameter (the passes above ADAM_BYTES_PER_PARAM).
    The master copy is separate when the engine keeps 16-bit model weights next to fp32 ones (Megatron,
    DeepSpeed: engine.gather_copy_out False, i.e. not FSDP2's cast-at-gather). Adam itself is
    ADAM_BYTES_PER_PARAM fused (engine.fused_adam), else UNFUSED_ADAM_BYTES_PER_PARAM."""
    adam = ADAM_BYTES_PER_PARAM if engine.fused_adam else UNFUSED_ADAM_BYTES_PER_PARAM
    total = float(adam + CLIP_BYTES_PER_PARAM)
    if dtype in ("fp32", "tf32") or engine.gather_copy_out:
        return total
    _, g, _ = state_bytes_per_param(dtype, engine)
    total += 6.0  # master -> 16-bit model copy
    if g < 4.0:
        total += 6.0  # 16-bit gradients -> fp32 main grads
    if dtype == "fp16":
        total += 8.0  # unscale + inf / nan check
    return total


def estimate_config(graph: LayerGraph, cluster: ClusterSpec, config: ParallelConfig, *, global_batch: int,
                    stages: tuple[tuple[str, ...], ...] | None = None,
                    layer_recompute: Mapping[str, Recompute] | None = None,
                    overlap_dp: bool = True, engine: Engine | None = None) -> Estimate:
    """Predicted step of `global_batch` sequences of graph.seq_len tokens under `engine` (additive,
    default autoplan's executor: autoplan.plan.engine.Engine).

    `overlap_dp` (additive, default True): False turns the engine's dp_comm_overlap off (Megatron's
    "local" DDP, which all-reduces the whole gradient buffer after the pipeline schedule returns).
    Step time = pipeline time (pipeline_time_s over the ranks' per-microbatch slots, ZeRO traffic of each
    microbatch included) + the exposed once-per-step gradient reduction + the exposed once-per-step
    weight all-gather + the optimizer step."""
    engine = engine or Engine()
    # a stage or schedule the engine does not run is refused, not priced
    engine.check_zero(config.zero, pp=config.pp, tp=config.tp, dp=config.dp, cp=config.cp, ep=config.ep)
    engine.check_schedule(config.schedule, pp=config.pp)
    if not overlap_dp and engine.dp_comm_overlap:
        engine = dataclasses.replace(engine, dp_comm_overlap=False)
    m = check_config(graph, cluster, config, global_batch, explicit_stages=stages is not None)
    p = config.pp
    views = rank_clusters(cluster, config)  # each pipeline rank's own node group when heterogeneous
    stages = (default_split(graph, cluster, config, global_batch) if stages is None
              else check_stages(graph, stages, p * config.virtual_stages))
    placement = stage_ranks(config)  # the executor places stages with the same function
    layout = zero_layout(config, m, zero3=engine.zero3, pipelined_fsdp_defers_sync=engine.pipelined_fsdp_defers_sync,
                         zero1_all_reduce=engine.zero1_all_reduces(cluster.dtype))
    env_of = _stage_envs(graph, views, config, layer_recompute, engine, fresh_grad_share(
        layout.reduce_every_microbatch, m, engine, cluster.dtype))
    ranks = [Rank(index=k) for k in range(p)]
    _place_stages(ranks, graph, stages, placement, env_of, cluster, config, engine)
    deepspeed = config.zero == 3 and engine.zero3 == "deepspeed" and env_of[0].groups.dense.size > 1
    for rank, env in zip(ranks, env_of):
        if deepspeed:
            deepspeed_rank(rank, graph, env.view, config, engine, env.groups)
        else:
            rank_dp_times(rank, env.view, config, layout, engine, env.groups)
    step, breakdown = _step_s(ranks, env_of, graph, config, layout, engine, placement,
                              _pipeline_s(ranks, cluster, config, m), m)
    memories = [rank_memory(r, k, env_of[k].view, config, m, layout=layout, engine=engine, groups=env_of[k].groups,
                            deepspeed=deepspeed, graph=graph) for k, r in enumerate(ranks)]
    # the most loaded rank against its own device (the same device everywhere when homogeneous)
    k_peak = max(range(p), key=lambda k: memories[k].total_bytes / views[k].device.mem_bytes)
    return _estimate(graph, cluster, config, global_batch, layer_recompute, step, breakdown, memories[k_peak],
                     views[k_peak].device.mem_bytes)


def _stage_envs(graph: LayerGraph, views: list[ClusterSpec], config: ParallelConfig,
                layer_recompute: Mapping[str, Recompute] | None, engine: Engine, share: float
                ) -> list[StageEnv]:
    """Each pipeline rank's StageEnv (its node group's layer costs, the `share` of fresh gradients taken off
    them: with_fresh_grads; its data-parallel groups; whether its pipeline hops cross nodes), built once per
    distinct view (rank_clusters: one shared view when homogeneous)."""
    envs: dict[int, StageEnv] = {}
    for view in views:
        if id(view) not in envs:
            costs = with_fresh_grads(_layer_costs(graph, view, config, layer_recompute, engine), share)
            envs[id(view)] = StageEnv(view=view, costs=costs,
                                  groups=dp_groups(config, view),
                                  pp_cross=comm.group_placement(config, ("pp",), view.devices_per_node).crosses_nodes)
    return [envs[id(view)] for view in views]


def _place_stages(ranks: list[Rank], graph: LayerGraph, stages: tuple[tuple[str, ...], ...], placement: list[int],
                  env_of: list[StageEnv], cluster: ClusterSpec, config: ParallelConfig, engine: Engine) -> None:
    """Each stage's layers onto its rank (add_layers) and each cut between ranks' p2p hop (add_hop; with the
    chunks' slots where the engine overlaps its p2p)."""
    by_name = {layer.name: layer for layer in graph.layers}
    overlapped = p2p_overlapped(engine, config.schedule, config.virtual_stages)
    for i, names in enumerate(stages):
        add_layers(ranks[placement[i]], [env_of[placement[i]].costs[n] for n in names], [by_name[n] for n in names])
        if i + 1 < len(stages) and placement[i + 1] != placement[i]:
            sender, receiver = env_of[placement[i]].costs, env_of[placement[i + 1]].costs
            slots = (chunk_slots_s([sender[n] for n in names], [receiver[n] for n in stages[i + 1]])
                     if overlapped else (0.0, 0.0))  # read by add_hop only where the p2p is overlapped
            add_hop(ranks, placement[i], placement[i + 1], env_of, sender[names[-1]].output_bytes, cluster, config,
                    engine, slots)


def _step_s(ranks: list[Rank], env_of: list[StageEnv], graph: LayerGraph, config: ParallelConfig, layout: Any,
            engine: Engine, placement: list[int], pipe: float, m: int) -> tuple[float, Breakdown]:
    """(step seconds, breakdown): the pipeline time `pipe`, the exposed once-per-step gradient reduction (with
    the tied head's all-reduce: step_tail_s) and weight all-gather, at least the reduce stream's floor, then
    the optimizer step."""
    offsets = [sum(r.bwd for r in ranks[:k]) for k in range(config.pp)]
    tied = (tied_grad_reduce_s(graph, config, env_of[placement[-1]].view, engine, env_of[0].pp_cross)
            if placement[-1] != placement[0] else 0.0)
    dp_tail = step_tail_s([r.dp_tail for r in ranks], offsets, placement[-1], tied, engine.tied_reduce_before_dp)
    param_gather = max(r.param_gather for r in ranks)
    optimizer = max(_optimizer_s(r, env.view, config, layout, engine) for r, env in zip(ranks, env_of))
    head = pipe + dp_tail + param_gather
    floor = float(_reduce_floor(ranks, config, m))
    step = max(head, floor) + optimizer
    return step, _breakdown(ranks, m, pipe, dp_tail + param_gather + max(floor - head, 0.0), optimizer)


def _pipeline_s(ranks: list[Rank], cluster: ClusterSpec, config: ParallelConfig, m: int) -> float:
    """The schedule's time over the ranks' slots (pipeline_time_s); CPU ranks sharing cores: a waiting
    pipeline rank frees its share (shared_cores_pipeline_time_s)."""
    p, v = config.pp, config.virtual_stages
    pipe = pipeline_time_s(config.schedule, p, v, m, [r.fwd for r in ranks], [r.bwd for r in ranks],
                           [r.weight for r in ranks], [r.steady for r in ranks])
    if cluster.device.cpu_cores and p > 1:
        pipe = shared_cores_pipeline_time_s(config, m, [r.fwd + r.steady for r in ranks], [r.bwd for r in ranks],
                                            [r.weight for r in ranks], cores=cluster.device.cpu_cores,
                                            ranks=cluster.devices_per_node,
                                            oversubscribed=cluster.device.cpu_oversubscribed_efficiency)
    return pipe


def _estimate(graph: LayerGraph, cluster: ClusterSpec, config: ParallelConfig, global_batch: int,
              layer_recompute: Mapping[str, Recompute] | None, step: float, breakdown: Breakdown, peak: Any,
              capacity: float) -> Estimate:
    """The Estimate of a step of `step` seconds: throughput, MFU over the cluster's peak, the peak rank's memory."""
    model_flops, hardware_flops = _flops(graph, config, global_batch, layer_recompute)
    return Estimate(
        step_time_s=step, tokens_per_s=global_batch * graph.seq_len / step,
        mfu=model_flops / (step * cluster.total_peak_flops), peak_mem_bytes=peak.total_bytes,
        mem_capacity_bytes=capacity, fits=peak.total_bytes <= capacity,
        breakdown=breakdown, memory=peak, model_flops=model_flops, hardware_flops=hardware_flops,
    )


def tied_grad_reduce_s(graph: LayerGraph, config: ParallelConfig, cluster: ClusterSpec, engine: Engine,
                       crosses_nodes: bool) -> float:
    """The once-per-step all-reduce of a tied head's gradient between the first and the last pipeline stage
    (graph.tied_embedding_params, V x h): each holds the vocab-parallel word embedding, V/tp x h elements
    per tp rank, and sums its gradient with the other over their 2-rank group, in the gradient's reduce
    dtype (grad_wire_bytes). DeepSpeed v0.10.0 deepspeed/runtime/pipe/engine.py _exec_reduce_tied_grads:
    dist.all_reduce(weight.grad, or weight._hp_grad (fp32) under bf16) over module.py _index_tied_modules'
    group of the tied stages (per data and model rank); Megatron-LM a8d172b3 megatron/training.py train_step:
    torch.distributed.all_reduce(word_embeddings_weight.main_grad, group=mpu.get_embedding_group()), the
    first and last stage. The two cross nodes when the pipeline group does. Zero when untied or pp == 1."""
    if not graph.tied_embedding_params or config.pp == 1:
        return 0.0
    nbytes = graph.tied_embedding_params / config.tp * grad_wire_bytes(cluster.dtype, engine)
    return comm.all_reduce_s(nbytes, tied_pair(crosses_nodes), cluster)


def tied_pair(crosses_nodes: bool) -> GroupPlacement:
    """The 2-rank group of the first and the last pipeline stage (one member per node when it crosses)."""
    return GroupPlacement(size=2, num_nodes=2 if crosses_nodes else 1, per_node=1 if crosses_nodes else 2)


def step_tail_s(dp_tails: list[float], offsets: list[float], last: int, tied: float, before_dp: bool) -> float:
    """What the step runs past the pipeline: rank r finishes its last backward offsets[r] before rank 0 (the
    first stage, offset 0), then its exposed gradient reduction dp_tails[r]; the latest end counts. A tied
    all-reduce (`tied` seconds) joins rank 0 and rank `last` (the last stage): before their reductions, it
    starts when both are done with the pipeline (DeepSpeed: TrainSchedule's ReduceTiedGrads, then ReduceGrads),
    else when both are done with their reductions (Megatron's train_step)."""
    ends = [t - off for t, off in zip(dp_tails, offsets)]
    if tied > 0:
        if before_dp:
            start = max(-offsets[0], -offsets[last]) + tied
            ends[0], ends[last] = start + dp_tails[0], start + dp_tails[last]
        else:
            ends[0] = ends[last] = max(ends[0], ends[last]) + tied
    return max(0.0, max(ends))


def fresh_grad_share(reduce_every_microbatch: Any, m: Any, engine: Engine, dtype: str) -> Any:
    """Share of a step's microbatches whose weight gradients land in a freed .grad under
    engine.grad_freed_after_reduce: every one when the layout reduces every microbatch (FSDP2's post_backward
    frees each unsharded gradient after its reduce-scatter), else the step's first of m (the gradients
    accumulate after optimizer.zero_grad(set_to_none=True)); 0 without the engine field. Every one under
    engine.bf16_optimizer_grads for a bf16 plan (Engine.hp_grads: BF16_Optimizer.clear_lp_grads sets each .grad
    to None before every microbatch's backward: layer.hp_grad_update_s). Scalars (the exact model: ZeroLayout.reduce_every_microbatch)
    or numpy arrays of candidates (the quick estimate)."""
    if engine.hp_grads(dtype):
        return 1.0 if np.ndim(reduce_every_microbatch) == 0 and np.ndim(m) == 0 else np.ones(np.broadcast(
            reduce_every_microbatch, m).shape)
    if not engine.grad_freed_after_reduce:
        return 0.0
    if np.ndim(reduce_every_microbatch) == 0 and np.ndim(m) == 0:
        return 1.0 if reduce_every_microbatch else 1.0 / m
    return np.where(reduce_every_microbatch, 1.0, 1.0 / m)


def with_fresh_grads(costs: dict[str, LayerCost], share: float) -> dict[str, LayerCost]:
    """The layer costs with `share` of each layer's fresh_grad_saving_s taken off its backward and its
    weight-gradient time (a microbatch's mean)."""
    if not share:
        return costs
    out: dict[str, LayerCost] = {}
    for name, c in costs.items():
        cut = share * c.fresh_grad_saving_s
        out[name] = c if not cut else dataclasses.replace(c, bwd_s=c.bwd_s - cut, bwd_weight_s=c.bwd_weight_s - cut,
                                                          device_s=c.device_s - cut)
    return out


def _layer_costs(graph: LayerGraph, cluster: ClusterSpec, config: ParallelConfig,
                 layer_recompute: Mapping[str, Recompute] | None, engine: Engine) -> dict[str, LayerCost]:
    """Each layer's cost under its recompute mode; identical layers share a kind (graph.types)."""
    overrides = {k: Recompute(r) for k, r in (layer_recompute or {}).items()}
    costs: dict[str, LayerCost] = {}
    by_kind: dict[tuple[str, Recompute], LayerCost] = {}
    for layer in graph.layers:
        mode = overrides.get(layer.name, config.recompute)
        key = (layer.kind, mode)
        if key not in by_kind:
            by_kind[key] = estimate_layer(layer, cluster, config, mode, seq_len=graph.seq_len,
                                          graph_microbatch=graph.microbatch, engine=engine)
        costs[layer.name] = by_kind[key]
    return costs


def _optimizer_s(rank: Rank, cluster: ClusterSpec, config: ParallelConfig, layout, engine: Engine) -> float:
    """Adam over the local shard (params / d when the optimizer states are sharded), memory-bound:
    optimizer_bytes at the device's streaming bandwidth."""
    groups_dense = config.dp * config.ep * config.cp if layout.shards_optimizer else 1
    groups_expert = config.expert_dp if layout.shards_optimizer else 1  # dp * cp unfolded
    shard = rank.dense_params / groups_dense + rank.expert_params / groups_expert
    local = rank.dense_params + rank.expert_params
    return memory_time_s(cluster.device, optimizer_bytes(cluster.dtype, engine, shard, local))


def _reduce_floor(ranks: list[Rank], config: ParallelConfig, m: int) -> float:
    """pipeline.reduce_stream_floor_s over the ranks' layers (forward with its tp / cp / ep traffic,
    backward the rest; zero bubble's gradient passes its input-gradient part) and asynchronous reductions."""
    if not any(r.async_reduce for r in ranks):
        return 0.0
    fwd = [sum(c.forward_s for c in r.costs) for r in ranks]
    bwd = [sum(c.time_s for c in r.costs) - f for r, f in zip(ranks, fwd)]
    if config.schedule is Schedule.ZERO_BUBBLE:
        bwd = [b - sum(c.bwd_weight_s for c in r.costs) for r, b in zip(ranks, bwd)]
    chunks = chunks_per_rank(config.schedule, config.virtual_stages)
    return reduce_stream_floor_s(fwd, bwd, [r.async_reduce for r in ranks], m, chunks)


def _breakdown(ranks: list[Rank], m: int, pipe: float, dp_after: float, optimizer: float) -> Breakdown:
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
           layer_recompute: Mapping[str, Recompute] | None) -> tuple[float, float]:
    """(model, hardware) FLOPs per step. Model FLOPs: 3 x the forward matmul + attention FLOPs
    (forward + backward = 2 x forward), no recompute (Chowdhery et al. 2022, appendix B; for GPT this
    is Narayanan et al.'s 72 B s l h^2 (1 + s/(6h) + V/(12 l h))). Hardware FLOPs add the recomputed
    forward: the whole block under full recompute, its attention core under selective."""
    overrides = {k: Recompute(r) for k, r in (layer_recompute or {}).items()}
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


__all__ = ["ADAM_BYTES_PER_PARAM", "GRAD_REDUCE_BYTES", "HP_GRAD_STEP_BYTES", "UNFUSED_ADAM_BYTES_PER_PARAM",
           "DpGroups", "adam_bytes_per_param", "estimate_config", "grad_wire_bytes", "optimizer_bytes",
           "pp_recv_gather_s", "step_tail_s", "tied_grad_reduce_s", "tied_pair"]
