"""estimate_layer: the cost of one layer, one microbatch, on one device (compute, tp / cp / ep
communication, activation memory, parameters held), under a ParallelConfig and a recompute mode.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from autoplan.cluster.types import ClusterSpec, DeviceSpec
from autoplan.cost import comm
from autoplan.cost.compute import BlockShape, ComputeTimes, block_shape, expert_divisor, layer_compute
from autoplan.cost.experts import folded_expert_comm_s
from autoplan.cost.kernels import memory_time_s
from autoplan.cost.memory import block_activation_bytes, layer_param_counts, other_activation_bytes
from autoplan.cost.overlap import contention_fraction
from autoplan.cost.types import LayerCost
from autoplan.cost.userbuffers import comm_contention_s, margin_phases
from autoplan.graph.types import Layer, LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig, Recompute

DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "tf32": 4, "fp32": 4}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of the training dtype (cluster.dtype)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown training dtype {dtype!r}: choose one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def estimate_layer(layer: Layer, cluster: ClusterSpec, config: ParallelConfig, recompute: Recompute | str,
                   *, seq_len: int, graph_microbatch: int = 1, engine: Engine | None = None) -> LayerCost:
    """Cost of `layer` for one microbatch of config.microbatch sequences of seq_len tokens on one device.

    `graph_microbatch` (an additive extension of the contract, default 1) is the microbatch the layer
    was captured at (LayerGraph.microbatch): its FLOPs and bytes scale by
    config.microbatch / graph_microbatch, and by 1 / cp (each CP rank holds s / cp of the tokens and
    attends them to all s keys, so attention FLOPs split over cp too). `engine` (additive, default
    autoplan's executor) says how the layer's kernels run (autoplan.plan.engine.Engine)."""
    if isinstance(recompute, str) and not isinstance(recompute, Recompute):
        recompute = Recompute(recompute)
    return _layer_cost(layer, cluster, config, Recompute(recompute), seq_len, graph_microbatch, engine or _default_engine())


@lru_cache(maxsize=1)
def _default_engine() -> Engine:
    return Engine()  # frozen: one instance serves every call without an engine


@lru_cache(maxsize=65536)
def _layer_cost(layer: Layer, cluster: ClusterSpec, config: ParallelConfig, recompute: Recompute,
                seq_len: int, graph_microbatch: int, engine: Engine) -> LayerCost:
    device = cluster.device
    dbytes = dtype_bytes(cluster.dtype)
    graph_dbytes = layer.param_bytes // layer.num_params if layer.num_params and layer.param_bytes else dbytes
    ratio = dbytes / max(graph_dbytes, 1)
    graph_tokens = float(graph_microbatch * seq_len)
    scale = config.microbatch / graph_microbatch / config.cp
    shape = block_shape(layer, graph_tokens)
    materialised = shape is not None and (engine.attention == "unfused"
                                          or _scores_materialised(layer, shape, graph_microbatch, seq_len))
    times = layer_compute(layer, device, cluster.peak_flops, config, recompute, scale=scale, seq_len=seq_len,
                          graph_tokens=graph_tokens, dtype_bytes=dbytes, scores_materialised=materialised,
                          engine=engine, nonmatmul_ratio=_nonmatmul_ratio(cluster),
                          hp_grads=engine.hp_grads(cluster.dtype))
    tokens = graph_tokens * scale
    if shape is not None:
        held, work = block_activation_bytes(shape, config.microbatch, seq_len, config, recompute, dbytes,
                                            materialised, selective=engine.selective_recompute,
                                            expert_div=expert_divisor(config, engine), engine=engine)
        hidden_bytes = tokens * shape.h * dbytes
    else:
        held, work = other_activation_bytes(layer, scale, config, recompute, ratio)
        hidden_bytes = layer.output_bytes * scale * ratio
    param_count, dense, expert = layer_param_counts(layer, shape, config, engine)
    hp = hp_grad_update_s(dense + expert, device, engine, cluster.dtype)
    times = dataclasses.replace(times, bwd_s=times.bwd_s + hp) if hp else times
    tp_fwd, tp_total = _tp_comm_s(layer, shape, cluster, config, recompute, hidden_bytes, scale * ratio,
                                  times, engine)
    cp_fwd, cp_total = _cp_comm_s(shape, cluster, config, recompute, tokens * config.cp, dbytes,
                                  times.attention_fwd_s, engine)
    ep_fwd, ep_total = _ep_comm_s(shape, cluster, config, recompute, tokens, dbytes)
    serial = bool(cluster.device.cpu_cores) or engine.launch_blocking
    fwd_s, bwd_s, rec_s = _with_host(times, recompute, layer, serial=serial)
    return LayerCost(
        fwd_s=fwd_s, bwd_s=bwd_s, bwd_weight_s=times.bwd_weight_s, recompute_s=rec_s,
        tp_comm_s=tp_total, cp_comm_s=cp_total, ep_comm_s=ep_total,
        act_mem_bytes=int(held), param_count=param_count, grad_param_count=dense, expert_param_count=expert,
        output_bytes=int(hidden_bytes / config.tp), work_mem_bytes=int(work),
        fwd_comm_s=tp_fwd + cp_fwd + ep_fwd, host_s=_host_total(times, recompute, layer),
        fresh_grad_saving_s=_fresh_saving_s(times, recompute, layer, bwd_s, serial=serial),
        device_s=times.fwd_s + times.bwd_s + (times.recompute_s if layer.role is LayerRole.BLOCK else 0.0),
    )


# DeepSpeed's BF16_Optimizer.update_hp_grads (deepspeed/runtime/bf16_optimizer.py, 2022: `hp_grad.data.add_(
# lp.grad.data.to(hp_grad.dtype).view(hp_grad.shape))`) per gradient element: the cast reads the bf16 gradient
# (2) and writes an fp32 copy (4), the add_ reads that copy and the fp32 gradient (4 + 4) and writes it (4)
HP_GRAD_UPDATE_BYTES = 2 + 4 + 4 + 4 + 4


def hp_grad_update_s(numel: float, device: DeviceSpec, engine: Engine, dtype: str) -> float:
    """What Engine.bf16_optimizer_grads adds to each microbatch's backward of a `dtype` plan (only bf16 builds
    the BF16_Optimizer: Engine.hp_grads) on the compute stream: DeepSpeed's
    pipeline engine calls BF16_Optimizer.update_hp_grads after every backward (deepspeed/runtime/pipe/
    engine.py _exec_backward_pass: "manually call because we don't call optimizer.backward()"; the last
    stage's engine.backward -> BF16_Optimizer.backward does the same), a memory-bound pass of
    HP_GRAD_UPDATE_BYTES over the layer's `numel` local gradients. Its clear_lp_grads before the backward
    (`param.grad = None`) makes every microbatch's gradients fresh (estimate.fresh_grad_share). 0 without
    the field or for an fp16 / fp32 plan."""
    if not engine.hp_grads(dtype) or numel <= 0:
        return 0.0
    return memory_time_s(device, HP_GRAD_UPDATE_BYTES * numel)


def _nonmatmul_ratio(cluster: ClusterSpec) -> float:
    """Tensor-core peak over the FP32 (non-matmul) peak: what FlashAttention's softmax work runs at
    (Dao 2023 section 3.1: 312 / 19.5 = 16 on A100); 16 when the profile has no fp32 peak."""
    table = dict(cluster.device.peak_flops)
    return cluster.peak_flops / table["fp32"] if table.get("fp32") else 16.0


def _with_host(times: ComputeTimes, recompute: Recompute, layer: Layer,
               serial: bool = False) -> tuple[float, float, float]:
    """Forward, backward, recompute times: kernels are issued asynchronously, so each phase takes
    max(device time, host time) (H. He, "Making Deep Learning Go Brrrr From First Principles", 2022:
    an overhead-bound model runs at the host's pace), a fully recomputed forward issuing its forward's
    ops again. Small layers at small microbatches are bound by it. `serial` (a CPU rank: the thread that
    issues an op also computes it, torch's CPU kernels run synchronously; or a GPU under Engine.launch_blocking,
    CUDA_LAUNCH_BLOCKING=1: each launch returns only when its kernel has run, so the host prepares the next
    op while the device idles, and the device runs while the host waits): host and device times add.
    The block's device-synchronising copies (times.sync_fwd_s) add to the forward and to a fully
    recomputed forward after that: neither the host nor the device runs during them."""
    combine = (lambda a, b: a + b) if serial else max
    rec = times.recompute_s
    if recompute is Recompute.FULL and layer.role is LayerRole.BLOCK and rec:
        rec = combine(rec, times.host_rec_s) + times.sync_fwd_s
    fwd = combine(times.fwd_s, times.host_fwd_s) + times.sync_fwd_s
    return fwd, combine(times.bwd_s, times.host_bwd_s), rec


def _fresh_saving_s(times: ComputeTimes, recompute: Recompute, layer: Layer, bwd_s: float, *, serial: bool) -> float:
    """What the backward phase (bwd_s, after _with_host) loses when the weight-gradient GEMMs write their
    output once instead of accumulating it (times.fresh_grad_saving_s of device time): none while the host
    bounds the phase."""
    if not times.fresh_grad_saving_s:
        return 0.0
    fresh = dataclasses.replace(times, bwd_s=times.bwd_s - times.fresh_grad_saving_s)
    return bwd_s - _with_host(fresh, recompute, layer, serial=serial)[1]


def _host_total(times: ComputeTimes, recompute: Recompute, layer: Layer) -> float:
    """All host time of the layer in one microbatch (forward, backward, a fully recomputed forward)."""
    return times.host_fwd_s + times.host_rec_s + times.host_bwd_s


def _scores_materialised(layer: Layer, shape: BlockShape, graph_microbatch: int, seq_len: int) -> bool:
    """Whether the captured block stores its a x s x s attention scores itself (a hand-written softmax
    attention): its captured attention activations hold at least one byte per score."""
    return layer.attention_activation_bytes >= graph_microbatch * shape.a * seq_len * seq_len


def _tp_comm_s(layer: Layer, shape: BlockShape | None, cluster: ClusterSpec, config: ParallelConfig,
               recompute: Recompute, hidden_bytes: float, scale: float, times: ComputeTimes,
               engine: Engine) -> tuple[float, float]:
    """Megatron tensor parallelism (Shoeybi et al. 2019; Korthikanti et al. 2022 for SP): a block does
    2 all-reduces of b s h in forward (after attention and after the MLP) and 2 in backward (before
    them); with SP each becomes an all-gather plus a reduce-scatter of the same bytes, costing the
    same on a ring. Full recompute re-runs the forward's 2, less the MLP's reduction (all-reduce, or
    reduce-scatter with SP) when engine.recompute_early_stop ends the recompute before the MLP output
    projection of a dense block (cost/projections.py). The vocab-parallel embedding all-reduces
    its output in forward; the head's column-parallel projection all-reduces its input gradient in
    backward. Exposed in full when issued on the compute stream (Megatron-LM, DTensor TP).

    engine.tp_comm_overlap with SP (Megatron-Core --tp-comm-overlap, Transformer Engine userbuffers:
    the all-gather is split into chunks that overlap the GEMM consuming them, the reduce-scatter the GEMM
    producing them; Megatron requires --sequence-parallel for it): each phase's TP communication hides
    behind that phase's weight GEMMs, exposing max(0, comm - GEMMs), and the GEMMs run slower while the
    communication occupies SMs (overlap.contention_fraction of the tp group's communicator, of the hidden
    part). In a phase (forward, backward) where a TE userbuffers overlap takes a margin
    (engine.tp_overlap_margin_sms, tp_overlap_margin_sms_by_op: cost/userbuffers.py) the communication is
    TE's, not NCCL's: the ring-exchange all-gathers copy on the copy engines and take no SMs, while each
    GEMM beside an overlap with a margin runs on num_sms - its margin SMs throughout (times.margin_fwd_s /
    margin_bwd_s, a dense block's; a full recompute pays the forward's again). With
    engine.tp_overlap_comm_sms_by_op (a dense block) the margin-free overlaps' communication kernels hold their
    own num_sm SMs for their collective's duration (_te_phases_s, userbuffers.comm_contention_s), in place of
    NCCL's channels in every phase; without it a phase with no margin keeps NCCL's channels.

    engine.tp_bwd_overlap (Megatron-LM from 2021-09, megatron/mpu/layers.py
    LinearWithGradAccumulationAndAsyncCommunication.backward: `handle = torch.distributed.all_reduce(
    grad_input, ..., async_op=True)` (with SP `_reduce_scatter_base(..., async_op=True)`), then the
    weight-gradient GEMM, then handle.wait()): the two column-parallel linears' (QKV, the MLP's input
    projection) backward collectives hide behind their own weight-gradient GEMMs, exposing max(0, comm -
    wgrad) each, the hidden part slowing the GEMM by contention_fraction.
    With SP an engine that saves the input shard re-gathers it in backward (sp_regathers): on the compute
    stream, exposed; under tp_bwd_overlap beside the linear's input-gradient GEMM; under tp_comm_overlap one
    more collective of the backward phase. Returns (forward part, total); a block's: _block_tp_comm_s."""
    if config.tp == 1:
        return 0.0, 0.0
    group = comm.group_placement(config, ("tp",), cluster.devices_per_node)
    if shape is not None:
        return _block_tp_comm_s(shape, cluster, config, recompute, hidden_bytes, times, engine, group)
    if layer.role is LayerRole.EMBEDDING:
        one = comm.all_reduce_s(hidden_bytes, group, cluster)
        return one, one
    if layer.role is LayerRole.HEAD:
        return 0.0, comm.all_reduce_s((layer.input_bytes or layer.output_bytes) * scale, group, cluster)
    return 0.0, 0.0


def _block_tp_comm_s(shape: BlockShape, cluster: ClusterSpec, config: ParallelConfig, recompute: Recompute,
                     hidden_bytes: float, times: ComputeTimes, engine: Engine, group) -> tuple[float, float]:
    """_tp_comm_s of a block (forward part, total) on the tp `group`: its 2 + 2 collectives (+ a full
    recompute's), the backward's SP re-gathers (sp_regathers), each exposed or overlapped as _tp_comm_s
    describes."""
    reduce = (comm.reduce_scatter_s if config.sp else comm.all_reduce_s)(hidden_bytes, group, cluster)
    gather = comm.all_gather_s(hidden_bytes, group, cluster) if config.sp else 0.0  # SP's all-gather, priced once
    one = gather + reduce if config.sp else reduce
    fwd, bwd = 2 * one, 2 * one
    # an early-stopping recompute ends before the MLP output projection and its reduction (projections.py)
    skip = reduce if engine.recompute_early_stop and not shape.num_experts else 0.0
    rec = 2 * one - skip if recompute is Recompute.FULL else 0.0
    f = contention_fraction(cluster, group)  # the tp communicator's NCCL channels (overlap.nccl_channels)
    regathers = sp_regathers(shape, config, engine)
    regather = gather if regathers else 0.0  # the same b s h all-gather (sp_regathers is 0 without SP)
    if (engine.tp_comm_overlap and config.sp) or not (engine.tp_bwd_overlap and times.wgrad_column_s):
        # on the compute stream, exposed; or one more collective of the backward phase that TE's GEMMs hide
        bwd += regathers * regather
    if engine.tp_comm_overlap and config.sp and engine.tp_overlap_comm_sms_by_op and not shape.num_experts:
        fwd, bwd, rec = _te_phases_s(engine, cluster, gather, reduce, times, fwd, bwd, rec, skip > 0)
    elif engine.tp_comm_overlap and config.sp:
        # a phase with a TE margin (userbuffers.margin_phases): the margin-narrowed GEMMs run slower whatever
        # the communication's length; one without: NCCL's channels over the hidden time
        te_fwd, te_bwd = margin_phases(engine) if not shape.num_experts else (False, False)
        fwd, bwd, rec = (max(c - g, 0.0) + ((m if c > 0 else 0.0) if te else f * min(c, g)) for c, g, m, te in
                         ((fwd, times.gemm_fwd_s, times.margin_fwd_s, te_fwd),
                          (bwd, times.gemm_bwd_s, times.margin_bwd_s, te_bwd),
                          (rec, times.gemm_fwd_s, times.margin_fwd_s, te_fwd)))
    elif engine.tp_bwd_overlap and times.wgrad_column_s:
        # each column-parallel linear's input-gradient all-reduce (reduce-scatter with SP) runs beside
        # its weight-gradient GEMM; the row-parallel ones' (SP: all-gathers) stay on the compute stream
        grad = reduce  # the reduce-scatter with SP, else the all-reduce (= one)
        bwd = bwd - 2 * grad + sum(max(grad - w, 0.0) + f * min(grad, w) for w in times.wgrad_column_s)
        # each re-gathered input beside its linear's input-gradient GEMM, which has the weight-gradient
        # GEMM's FLOPs (dY W against dY^T X): its time is taken as that GEMM's
        bwd += sum(max(regather - w, 0.0) + f * min(regather, w) for w in times.wgrad_column_s[:regathers])
    return fwd, fwd + bwd + rec


def sp_regathers(shape: BlockShape, config: ParallelConfig, engine: Engine) -> int:
    """How many column-parallel linears of a block all-gather their sequence-parallel input AGAIN in backward,
    for their weight gradient: with SP an engine that saves the input shard (engine.sp_saves_gathered_input
    false) re-gathers it. Megatron-LM / Megatron-Core (megatron/core/tensor_parallel/layers.py
    LinearWithGradAccumulationAndAsyncCommunication.backward: `if ctx.sequence_parallel: handle =
    dist_all_gather_func(all_gather_buffer, input, ..., async_op=True)`, 'we rely on
    CUDA_DEVICE_MAX_CONNECTIONS=1 to ensure that the gather is scheduled before the input gradient
    computation', `grad_input = grad_output.matmul(weight)`, then `handle.wait()`) and Transformer Engine's
    LayerNormLinear (its ln_out re-gathered in backward; under userbuffers the bulk qkv_dgrad / fc1_dgrad
    all-gathers beside the dgrad GEMM) do it for the QKV projection and the MLP's input projection: 2 in a
    dense block. A routed-expert block counts the QKV projection and, with shared experts, their MLP's input
    projection (megatron/core/transformer/moe/shared_experts.py SharedExpertMLP(MLP): one MLP of
    moe_shared_expert_intermediate_size, all the shared experts' width, its linear_fc1 column-parallel under
    the config's sequence_parallel, fed the sequence-sharded hidden states by MoELayer.forward); its routed
    experts' inputs come through the token dispatcher (cost/experts.py). 0 without SP, with tp 1, or where
    the gathered input is kept (DTensor's ColwiseParallel: autoplan's executor, torchtitan)."""
    if config.tp == 1 or not config.sp or engine.sp_saves_gathered_input:
        return 0
    return 1 + min(shape.dense_mlps, 1)  # QKV; the dense MLP's, or the shared experts' (dense_mlps: 1 / num_shared)


def _te_phases_s(engine: Engine, cluster: ClusterSpec, ag: float, rs: float, times: ComputeTimes,
                 fwd: float, bwd: float, rec: float, early_stop: bool) -> tuple[float, float, float]:
    """A dense block's (forward, backward, recompute) TP seconds under TE userbuffers with
    engine.tp_overlap_comm_sms_by_op: each phase exposes max(0, comm - GEMMs), pays its margin-narrowed GEMMs'
    loss (times.margin_*_s, where the phase communicates) and the SMs its margin-free overlaps' communication
    kernels hold (userbuffers.comm_contention_s: num_sm / num_sms of each one's all-gather or reduce-scatter),
    of the part the GEMMs hide (min(comm, GEMMs) / comm), in place of NCCL's channels. An early-stopping
    recompute (`early_stop`: it ends before the MLP output projection) runs no fc2_fprop reduce-scatter.
    `ag`, `rs`: the block's b s h all-gather and reduce-scatter on the tp group (_block_tp_comm_s prices them)."""
    held_fwd, held_bwd = comm_contention_s(engine, cluster.device.num_sms, ag, rs)
    held_rec = comm_contention_s(engine, cluster.device.num_sms, ag, rs, ("fc2_fprop",))[0] if early_stop else held_fwd
    return tuple(max(c - g, 0.0) + ((m + held * min(c, g) / c) if c > 0 else 0.0) for c, g, m, held in
                 ((fwd, times.gemm_fwd_s, times.margin_fwd_s, held_fwd),
                  (bwd, times.gemm_bwd_s, times.margin_bwd_s, held_bwd),
                  (rec, times.gemm_fwd_s, times.margin_fwd_s, held_rec)))


def _cp_comm_s(shape: BlockShape | None, cluster: ClusterSpec, config: ParallelConfig, recompute: Recompute,
               seq_tokens: float, dbytes: int, attention_fwd_s: float, engine: Engine) -> tuple[float, float]:
    """Context parallelism: forward all-gathers K and V of the whole sequence for this tp rank's kv heads,
    S = 2 b s h g / (a t) elements; backward gathers them again (unless engine.cp_saves_gathered_kv kept
    them) and reduce-scatters dK, dV (2 S). Full recompute repeats the forward exchange; selective
    recompute re-gathers inside the recomputed core when the gathered K / V were not kept.
    Returns (forward part, total).

    engine.cp_comm_overlap (Megatron-core CP / ring attention, Liu et al. 2023: TE AttnFuncWithCPAndKVP2P
    sends the next K / V block while the current one's attention runs): the exchange hides behind the
    attention core (forward 1 x, backward 2 x the forward core time); exposed is what the core does not
    hide. Without it the K / V are all-gathered before the core and dK / dV reduce-scattered after it, on
    the critical path in full: Llama 3's CP ("we first all-gather the key (K) and value (V) tensors, and
    then compute attention output for the local query (Q) tensor chunk ... the all-gather communication
    latency is exposed in the critical path", Dubey et al. 2024, section 3.3.2) and autoplan's executor
    (execute/context.py: a functional all-gather waited on before the attention core).

    Load balance: attention FLOPs split evenly over cp, as in the load-balanced split of the published
    runtimes (rank i holds chunks i and 2cp-1-i of 2cp: Megatron-core CP; Llama 3, Dubey et al. 2024,
    section 3.3.2; torchtitan's context_parallel). autoplan's own executor (execute/context.py) uses the
    same split and exchanges only the kv heads (the bytes above).

    engine.cp_separate_kv_collectives (the exposed exchange only): K and V are all-gathered, and dK and dV
    reduce-scattered, by a collective each, so each exchange pays two collectives' latency on half the
    bytes: Transformer Engine's all-gather CP, written after Llama 3's section 3.3.2
    (transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py
    AttnFuncWithCPAndKVAllGather: forward `gather_along_first_dim(k, cp_group)` then `(v, cp_group)`,
    backward the same two again, then `reduce_scatter_along_first_dim(dk, ...)` and `(dv, ...)`), and
    autoplan's executor (execute/context.py ContextParallelCore: gather_sequence of K, then of V, whose
    autograd backwards reduce-scatter each)."""
    if config.cp == 1 or shape is None:
        return 0.0, 0.0
    group = comm.group_placement(config, ("cp",), cluster.devices_per_node)
    kv_bytes = 2.0 * seq_tokens * shape.h * shape.g / shape.a / config.tp * dbytes
    gather = comm.all_gather_s(kv_bytes, group, cluster)
    if engine.cp_comm_overlap:
        fwd = max(gather - attention_fwd_s, 0.0)
        bwd = max(2.0 * gather - 2.0 * attention_fwd_s, 0.0)
        return fwd, fwd + bwd + (fwd if recompute is Recompute.FULL else 0.0)
    pieces = 2 if engine.cp_separate_kv_collectives else 1
    gather = pieces * comm.all_gather_s(kv_bytes / pieces, group, cluster)
    regather = 0.0 if engine.cp_saves_gathered_kv else gather
    bwd = regather + pieces * comm.reduce_scatter_s(kv_bytes / pieces, group, cluster)
    again = recompute is Recompute.FULL or (recompute is Recompute.SELECTIVE and not engine.cp_saves_gathered_kv)
    return gather, gather + bwd + (gather if again else 0.0)


def _ep_comm_s(shape: BlockShape | None, cluster: ClusterSpec, config: ParallelConfig, recompute: Recompute,
               tokens: float, dbytes: int) -> tuple[float, float]:
    """Expert parallelism (GShard, Lepikhin et al. 2021; DeepSpeed-MoE): all-to-all dispatch and combine
    of tokens * top_k * h elements each, in forward and again in backward (4 all-to-alls; 6 with full
    recompute), over the ep group; tokens are split over tp ranks with SP. Exposed in full.
    Returns (forward part, total). Folded expert layouts: cost.experts.folded_expert_comm_s."""
    if config.folded:
        return folded_expert_comm_s(shape, cluster, config, recompute, tokens, dbytes)
    if config.ep == 1 or shape is None or not shape.num_experts:
        return 0.0, 0.0
    group = comm.group_placement(config, ("ep",), cluster.devices_per_node)
    local_tokens = tokens / (config.tp if config.sp else 1)
    one = comm.all_to_all_s(local_tokens * shape.top_k * shape.h * dbytes, group, cluster)
    return 2 * one, (4 + (2 if recompute is Recompute.FULL else 0)) * one
