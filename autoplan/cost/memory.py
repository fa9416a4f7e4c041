"""Memory per device: activations per layer (Korthikanti et al. 2022), model states under mixed-precision
Adam and ZeRO (Rajbhandari et al. 2020), and the parameters each device holds after the tp / ep split.
"""

from __future__ import annotations

from typing import Any

from autoplan.cluster.types import ClusterSpec
from autoplan.cost import comm
from autoplan.cost.compute import BlockShape
from autoplan.cost.experts import expert_dp_placement
from autoplan.cost.overlap import nccl_channels
from autoplan.cost.pipeline import in_flight_microbatches
from autoplan.cost.reserve import block_hidden, runtime_buffer_bytes
from autoplan.graph.types import Layer, LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.layout import ZeroLayout, expert_tp_split, zero_layout
from autoplan.plan.types import DENSE_DP, MemoryBreakdown, ParallelConfig, Recompute

# Mixed-precision Adam, bytes per parameter (Rajbhandari et al., ZeRO, SC'20, section 3.1): 16-bit
# weights (2) and gradients (2); fp32 master weights, momentum and variance (4 + 4 + 4 = 12). We keep
# 16-bit gradients (PyTorch DDP / FSDP with a 16-bit reduce dtype, Megatron's fp16 default); Megatron's
# fp32 gradient accumulation (--accumulate-allreduce-grads-in-fp32, default for bf16) would add 2 more.
WEIGHT_BYTES_PER_PARAM = 2
GRAD_BYTES_PER_PARAM = 2
OPTIMIZER_BYTES_PER_PARAM = 12
# NCCL's staging buffers, per side of a connection: every connection gets one buffer per protocol (NCCL
# src/init.cc computeBuffSizes): SIMPLE DEFAULT_BUFFSIZE 1 << 22 = 4 MiB (NCCL_BUFFSIZE), LL128
# DEFAULT_LL128_BUFFSIZE 120 x 640 x 8 steps x 8 B = 4,915,200 B, LL DEFAULT_LL_BUFFSIZE 8 x 512 x 8 steps x
# 16 B = 512 KiB. src/transport/p2p.cc p2pRecvSetup / p2pSendSetup: under P2P read (NVLink between sm >= 80
# GPUs, the default there) the SIMPLE buffer follows the sender's ncclSendMem and LL + LL128 the receiver's
# ncclRecvMem, each size ALIGN_SIZE'd to CUDA_IPC_MIN = 2 MiB: 6 MiB a side (write mode: 10 MiB received, the
# 2 MiB-aligned ncclSendMem sent: the same 12 MiB a pair). A ring channel (one thread block,
# overlap.nccl_channels) makes a rank the sender of one connection and the receiver of another: 2 x 6 MiB.
# Not counted: the net transport keeps some of them in host memory (a slight over-count across nodes), tree
# connections beside the rings, and NVLS buffers (NCCL >= 2.17 on NVSwitch systems with multicast), which
# depend on NCCL's version and algorithm choice.
NCCL_BUFFER_BYTES = 6 * 2**20


def block_activation_bytes(shape: BlockShape, b: float, s: int, config: ParallelConfig,
                           recompute: Recompute, dtype_bytes: int, scores_materialised: bool, *,
                           selective: str = "attention", expert_div: int | None = None,
                           engine: Engine | None = None) -> tuple[float, float]:
    """(held per microbatch, working extra during its backward) for one transformer block, bytes.

    Korthikanti et al. 2022, section 4.1 / Table 2, 16-bit activations, s tokens (s / cp per CP rank),
    microbatch b, hidden h, heads a: per layer s b h (34 + 5 a s / h) with no parallelism;
    s b h (10 + 24/t + 5 a s / (h t)) with tp = t; s b h (34/t + 5 a s / (h t)) with SP. We sum the
    same tensors for general shapes: replicated without SP are the two norms' inputs (4h), the QKV and
    MLP inputs (2h + 2h) and two 1-byte dropout masks (2h) = 10h; split over t are Q, K, V
    (2h + 4hg/a), the projection input (2h), the MLP hidden (GELU 4f: 2 f in + 2 f out; SwiGLU 6f),
    for MoE top_k copies of the expert input and hidden (over `expert_div`, compute.expert_divisor: tp
    unless the engine runs unfolded experts whole on every tp rank); the attention scores 5 a s per token (softmax
    output 2, dropout mask 1, dropout output 2) only when the kernel materialises them
    (FlashAttention does not). MHA with f = 4h gives 10h + 24h/t, as in the paper. A block without
    dropout (BlockShape.dropout: Llama-style) has no masks: 8h replicated, 2 a s of scores.
    Selective recompute drops the 5 a s / h term; full keeps only the block input 2 s b h (/t with SP)
    and re-materialises one block's activations during its backward (the working extra).
    `selective` 'op' is torchtitan's per-op selective checkpointing instead (torchtitan
    parallelisms/parallelize_llama.py, 2024: no_recompute_list = mm, SDPA, reduce_scatter, "except every
    second mm"): the block input (h), the outputs of the 1st, 3rd, 5th and 7th matmuls (Q h, V h g / a,
    the first MLP projection f, the MLP output h) and the SDPA output (h) are kept; the rest is
    recomputed in the backward (the working extra).

    What the engine's autograd keeps (plan.engine.Engine; default autoplan's executor):
    - sp_saves_gathered_input: with SP the QKV and MLP inputs (2h + 2h) are kept all-gathered, over
      the whole sequence (DTensor's ColwiseParallel under PrepareModuleInput saves the gathered input)
      instead of the local shard that Megatron keeps and re-gathers in backward;
    - attention_saves_repeated_kv: with grouped-query attention K and V are kept at the query heads'
      width (4h instead of 4 h g / a: repeat_interleave / repeat_kv before the SDPA call, which saves
      its arguments);
    - cp_saves_gathered_kv: with cp > 1 the attention keeps the all-gathered K and V of the keys it
      attends, on the busiest rank (cp rank 0, whose late chunk attends every key) the whole sequence:
      b s tokens of K and V instead of the local b s / cp (held without recompute; re-gathered inside
      the recomputed core under selective, and re-materialised under full: the working extra);
    - rmsnorm_saves_normalized: each of a Llama-style block's two RMSNorms (keyed, like BlockShape.dropout, on
      the SwiGLU MLP) keeps x * rstd for its weight's gradient beside its input (+2 x 2h per token, over tp
      with SP, where the norms run on the sequence shard): torch's nn.RMSNorm and Hugging Face's
      LlamaRMSNorm run eagerly as x * rsqrt(mean(x^2) + eps) * weight, whose last multiply saves its left
      operand (measured on autoplan's executor: tests/unit/test_cost_saved_tensors.py); rmsnorm 'eager_fp32'
      (torchtitan's RMSNorm, `_norm(x.float())`): the norms' inputs are kept as the fp32 copy, 2 x 4h
      bytes per token instead of 2 x 2h under 16-bit training;
    - swiglu_saves_activation: an eager SwiGLU, w2(silu(w1 x) * w3 x), keeps silu(w1 x) (the multiply's
      operand) beside w1 x (silu's input) and w3 x: 8f per token instead of Korthikanti-style 6f, per
      routed expert copy likewise (a fused swiglu, Megatron-Core's bias_swiglu_impl, keeps only its
      input and recomputes silu in backward)."""
    engine = engine or Engine()
    t, cp = config.tp, config.cp
    tokens = b * s / cp
    h_split = t if config.sp else 1
    # bytes per token at 16 bits, as the paper counts them; without dropout (BlockShape.dropout) no masks:
    # the two norm inputs (2h + 2h), the two dropout masks (h + h), the QKV and MLP inputs (2h + 2h)
    sharded = 6.0 * shape.h if shape.dropout else 4.0 * shape.h
    if engine.rmsnorm_saves_normalized and not shape.dropout:  # x * rstd of both RMSNorms
        sharded += 4.0 * shape.h
    fp32_norm = engine.rmsnorm == "eager_fp32" and not engine.fused_elementwise
    if fp32_norm and not shape.dropout and dtype_bytes < 4:
        # each norm keeps x.float() (pow's and * rstd's operand) in place of x: 4 - d more bytes per element
        sharded += 2.0 * shape.h * (4.0 - dtype_bytes) * 2.0 / dtype_bytes
    mlp_factor = 2.0 * shape.n_mlp + (2.0 if shape.n_mlp == 3 and engine.swiglu_saves_activation else 0.0)
    linear_inputs = 4.0 * shape.h
    linear_split = 1 if engine.sp_saves_gathered_input else h_split
    hidden = mlp_factor * shape.f * shape.dense_mlps
    kv_heads = shape.a if engine.attention_saves_repeated_kv else shape.g
    kv = 4.0 * shape.h * kv_heads / shape.a  # K and V
    split = 2.0 * shape.h + 2.0 * shape.h + hidden
    if shape.num_experts and shape.top_k:
        e_hidden = mlp_factor * shape.f_e
        # folded (etp, eep): a rank holds its tokens / tp routed copies gathered etp-fold, each with
        # 1/etp of the expert hidden: (tokens / t) top_k (2 h etp + e_hidden)
        copies = 2.0 * shape.h * (config.expert_tp if config.folded else 1)
        experts = shape.top_k * (copies + e_hidden) / (expert_div or t)  # compute.expert_divisor
    else:
        experts = 0.0
    # per token at the training dtype; with SP the linear inputs are kept on every token of the sequence
    per_token = (sharded / h_split + (split + kv) / t + experts) * dtype_bytes / 2.0
    linear_bytes = tokens * linear_inputs / linear_split * dtype_bytes / 2.0
    kv_bytes = kv / t * dtype_bytes / 2.0
    gathered_kv = kv_bytes * (b * s - tokens) if cp > 1 and engine.cp_saves_gathered_kv else 0.0
    score_bytes = 5.0 if shape.dropout else 2.0  # softmax output (+ dropout mask and output)
    scores = score_bytes * shape.a * s / t * dtype_bytes / 2.0 if scores_materialised else 0.0
    full = tokens * (per_token + scores) + linear_bytes + gathered_kv
    if recompute is Recompute.NONE:
        return full, 0.0
    if recompute is Recompute.SELECTIVE and selective == "op":
        kept = (2.0 * shape.h / h_split + (2.0 * shape.h + shape.h * shape.g / shape.a + shape.f) / t) * dtype_bytes
        return min(tokens * kept, full), max(full - tokens * kept, 0.0)
    if recompute is Recompute.SELECTIVE:
        return tokens * per_token + linear_bytes, tokens * scores + gathered_kv
    return tokens * 2.0 * shape.h / h_split * dtype_bytes / 2.0, full


def other_activation_bytes(layer: Layer, scale: float, config: ParallelConfig, recompute: Recompute,
                           dtype_ratio: float) -> tuple[float, float]:
    """(held, working extra) for a layer the model does not recognise as a transformer block: its
    captured activation_bytes (autograd's saved tensors) times `scale` (microbatch ratio / cp), split
    over tp for the vocab-parallel head and, with SP, for the rest; recompute applies to BLOCK-role
    layers only (selective drops attention_activation_bytes; full keeps input_bytes)."""
    t = config.tp
    split = t if (config.sp or layer.role is LayerRole.HEAD) else 1
    full = layer.activation_bytes * scale * dtype_ratio / split
    if layer.role is not LayerRole.BLOCK or recompute is Recompute.NONE:
        return full, 0.0
    if recompute is Recompute.SELECTIVE:
        dropped = layer.attention_activation_bytes * scale * dtype_ratio / split
        return max(full - dropped, 0.0), dropped
    kept = (layer.input_bytes or layer.activation_bytes) * scale * dtype_ratio / split
    return min(kept, full), full


def layer_param_counts(layer: Layer, shape: BlockShape | None, config: ParallelConfig,
                       engine: Engine | None = None) -> tuple[int, int, int]:
    """(held, dense, expert) parameters on one device after the tp / ep split, before ZeRO.

    Megatron-style splits (Shoeybi et al. 2019): every weight matrix of a block is split over tp; the
    norms and the row-parallel output biases (6h for a GPT block: 2 LayerNorms with bias, 2 biases)
    are replicated. Routed expert weights are split over ep and over plan.layout.expert_tp_split's ranks:
    etp when folded; unfolded, tp when the engine splits them over tp (Megatron-Core's default expert
    tensor parallelism), else none (autoplan's executor). Embedding and head are vocab-parallel (split
    over tp); other layers (a final norm) are replicated."""
    t = config.tp
    expert = layer.expert_params if layer.num_experts else 0
    dense = max(layer.num_params - expert, 0)
    if shape is not None:
        replicated = min(dense, 6 * shape.h)
        dense_held = (dense - replicated) // t + replicated
    elif layer.role in (LayerRole.EMBEDDING, LayerRole.HEAD):
        dense_held = -(-dense // t)
    else:
        dense_held = dense
    split = expert_tp_split(config, unfolded_over_tp=(engine or Engine()).tp_splits_unfolded_experts)
    expert_held = -(-expert // (config.expert_ep * split)) if expert else 0
    return dense_held + expert_held, dense_held, expert_held


def state_bytes_per_param(dtype: str, engine: Engine | None = None) -> tuple[float, float, float]:
    """(weight, gradient, optimizer) bytes per parameter under mixed-precision Adam (Rajbhandari et al.
    2020, section 3.1): 16-bit weights and gradients, fp32 master weights + momentum + variance (12).
    fp8 recipes keep 16-bit weights (Transformer Engine casts per GEMM); fp32 / tf32 training keeps fp32
    weights and gradients and Adam's two fp32 moments only (the weights are the master copy: 8). An
    engine with main_grads_fp32 accumulates bf16 / fp8 training's gradients in an fp32 buffer (Megatron's
    main_grad: 4 bytes)."""
    if dtype in ("fp32", "tf32"):
        return 4.0, 4.0, 8.0
    grad = 4.0 if engine is not None and engine.main_grads_fp32 and dtype in ("bf16", "fp8") else GRAD_BYTES_PER_PARAM
    return float(WEIGHT_BYTES_PER_PARAM), float(grad), float(OPTIMIZER_BYTES_PER_PARAM)


def model_state_bytes(dense_params: float, expert_params: float, config: ParallelConfig, *,
                      layout: ZeroLayout | None = None, dtype: str = "bf16",
                      engine: Engine | None = None) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) bytes for the parameters a device holds, at the step's peak.

    What is sharded comes from the ZeRO layout of the engine that runs the plan (plan.layout.zero_layout;
    default: its layout for config with the engine's FSDP behaviour): sharded states are divided by the
    data-parallel degree, dense parameters over dp * ep * cp, expert parameters over dp * cp
    (Rajbhandari et al. 2020: ZeRO-1 the optimizer, ZeRO-2 also the gradients, ZeRO-3 also the weights)."""
    engine = engine or Engine()
    if layout is None:
        layout = zero_layout(config, 1, zero3=engine.zero3,
                             pipelined_fsdp_defers_sync=engine.pipelined_fsdp_defers_sync)
    d_dense = config.dp * config.ep * config.cp
    d_expert = config.expert_dp  # dp * cp unfolded (MoE folding: plan.types.ParallelConfig.expert_dp)
    w, g, o = state_bytes_per_param(dtype, engine)

    def held(sharded: bool) -> float:
        if sharded:
            return dense_params / d_dense + expert_params / d_expert
        return dense_params + expert_params

    return w * held(layout.shards_weights), g * held(layout.shards_gradients), o * held(layout.shards_optimizer)


def nccl_buffer_bytes(config: ParallelConfig, cluster: ClusterSpec) -> float:
    """NCCL buffers of the communicators a rank belongs to (NCCL_BUFFER_BYTES per side, two per channel):
    one per mesh axis of size > 1 (tp, cp, ep, pp) and the data-parallel ones (dense over dp * ep * cp,
    experts over their data-parallel group, ParallelConfig.expert_dp, when ep > 1 or folded). A collective
    communicator has its group's channels (overlap.nccl_channels: 24 inside a DGX node, fewer across
    nodes); the pipeline's send / receive communicator is counted at device.nccl_sms (NCCL sizes its p2p
    channels by other rules, not modelled). Zero on a profile without NCCL channels (a CPU profile)."""
    if cluster.device.nccl_sms <= 0:
        return 0.0
    per_node = cluster.devices_per_node
    groups = [comm.group_placement(config, axes, per_node) for axes in (("tp",), ("cp",), ("ep",), DENSE_DP)]
    if config.ep > 1 or config.folded:
        groups.append(expert_dp_placement(config, per_node))
    channels = sum(nccl_channels(g, cluster) for g in groups) + (cluster.device.nccl_sms if config.pp > 1 else 0)
    return 2.0 * channels * NCCL_BUFFER_BYTES


def zero3_working_bytes(rank: Any, layout: ZeroLayout, engine: Engine, dtype: str, wire_bytes: float,
                        deepspeed: bool) -> float:
    """Gathered weights and gradient buffers ZeRO-3 holds beyond the shards, at the backward's peak.

    FSDP2 (torch.distributed.fsdp fully_shard, _fsdp_collectives.py): foreach_all_gather writes each
    block's unsharded parameters into an all-gather output of world x shard elements; the computing block
    and the prefetched one are unsharded at once (2 blocks in the training dtype); foreach_reduce copies a
    block's unsharded gradients (training dtype) into a reduce-scatter input in the reduce dtype.
    DeepSpeed stage 3: the gathered parameter and torch's flattened all_gather output (2 x the largest
    parameter) plus the prefetched one, and the gradient bucket (reduce_bucket_size elements) with its
    flat copy (buffered_reduce_fallback), in the training dtype."""
    w, _, _ = state_bytes_per_param(dtype, engine)
    if deepspeed:
        return 3.0 * rank.max_param_numel * w + 2.0 * engine.zero3_reduce_bucket_numel * w
    if not layout.shards_weights:
        return 0.0
    return rank.max_layer_params * (2.0 * w + w + (wire_bytes if wire_bytes != w else 0.0))


def zero2_reduce_bytes(rank: Any, layout: ZeroLayout, engine: Engine, dtype: str, wire_bytes: float) -> float:
    """The gradient buffers of the layer being reduced when gradients are sharded but the weights are not
    and the reduction runs every microbatch (ZeRO-2: FSDP2 fully_shard(reshard_after_forward=False) with
    gradient sync on, FSDP1 SHARD_GRAD_OP, Llama 3's FSDP "shards optimizer states and gradients", Dubey
    et al. 2024, section 3.3.2): the sharded gradients are all that stays, but each layer's backward first
    writes its unsharded gradients (training dtype) and foreach_reduce copies them into a reduce-scatter
    input in the reduce dtype (torch.distributed.fsdp _fsdp_collectives.py foreach_reduce), for the
    largest layer: the same two buffers zero3_working_bytes counts for ZeRO-3 beside its gathered weights."""
    if not layout.shards_gradients or layout.shards_weights or not layout.reduce_every_microbatch:
        return 0.0
    w, _, _ = state_bytes_per_param(dtype, engine)
    return rank.max_layer_params * (w + (wire_bytes if wire_bytes != w else 0.0))


def rank_memory(rank: Any, index: int, cluster: ClusterSpec, config: ParallelConfig, m: int, *,
                layout: ZeroLayout, engine: Engine, groups: Any, deepspeed: bool,
                graph: Any = None) -> MemoryBreakdown:
    """Peak bytes on pipeline rank `index`: model states (model_state_bytes under the engine's ZeRO
    layout), ZeRO-3's working set (zero3_working_bytes), activations held for in-flight microbatches
    (pipeline.in_flight_microbatches) plus one layer's backward working set (the re-materialised
    activations under recompute), and the reserve: the profile's runtime_reserve_bytes (the CUDA context),
    NCCL's buffers (nccl_buffer_bytes) and the cuBLAS workspaces and engine buffers (cost/reserve.py, for
    the `graph`'s sequences and widest block, as Megatron sizes TE's userbuffers on every rank alike); ZeRO-2's reduce buffers (zero2_reduce_bytes)
    count with the gradients."""
    from autoplan.cost.gradpasses import grad_wire_bytes

    weights, grads, optimizer = model_state_bytes(rank.dense_params, rank.expert_params, config, layout=layout,
                                                  dtype=cluster.dtype, engine=engine)
    wire = grad_wire_bytes(cluster.dtype, engine)
    weights += zero3_working_bytes(rank, layout, engine, cluster.dtype, wire, deepspeed)
    grads += zero2_reduce_bytes(rank, layout, engine, cluster.dtype, wire)
    in_flight = in_flight_microbatches(config.schedule, config.pp, config.virtual_stages, m, index)
    acts = rank.act_bytes * in_flight + rank.work_bytes
    seq_len, hidden = (graph.seq_len, block_hidden(graph.layers)) if graph is not None else (0, 0)
    reserve = reserve_bytes(config, cluster, engine, seq_len=seq_len, hidden=hidden)
    return MemoryBreakdown(weights=int(weights), gradients=int(grads), optimizer=int(optimizer),
                           activations=int(acts), reserve=int(reserve))


def layer_state_bytes(cost: Any, config: ParallelConfig, *, dtype: str, engine: Engine | None = None) -> float:
    """Weights + gradients + optimizer states of one layer's parameters on a device (model_state_bytes
    under the engine's ZeRO layout): the per-layer term the stage split and per-layer recompute solve
    with (search/refine.py)."""
    return sum(model_state_bytes(cost.grad_param_count, cost.expert_param_count, config, dtype=dtype, engine=engine))


def reserve_bytes(config: ParallelConfig, cluster: ClusterSpec, engine: Engine, *, seq_len: int = 0,
                  hidden: int = 0) -> float:
    """The reserve of rank_memory: the profile's runtime_reserve_bytes (the CUDA context), NCCL's buffers
    (nccl_buffer_bytes) and the cuBLAS workspaces and engine buffers (reserve.runtime_buffer_bytes for
    microbatches of config.microbatch sequences of `seq_len` tokens through blocks of `hidden`)."""
    buffers = runtime_buffer_bytes(cluster.device, engine, cluster.dtype, tp=config.tp, sp=config.sp, cp=config.cp,
                                   microbatch=config.microbatch, seq_len=seq_len, hidden=hidden)
    return cluster.device.runtime_reserve_bytes + nccl_buffer_bytes(config, cluster) + float(buffers)


def fixed_memory_bytes(config: ParallelConfig, cluster: ClusterSpec, *, max_layer_params: float,
                       max_param_numel: float, engine: Engine | None = None, seq_len: int = 0,
                       hidden: int = 0) -> float:
    """What every rank holds beyond its layers' states and activations: the reserve (reserve_bytes),
    ZeRO-2's reduce buffers (zero2_reduce_bytes) and ZeRO-3's working set (rank_memory's other terms, for a
    rank whose largest layer has max_layer_params parameters and largest weight max_param_numel)."""
    from autoplan.cost.gradpasses import grad_wire_bytes

    engine = engine or Engine()
    layout = zero_layout(config, 1, zero3=engine.zero3, pipelined_fsdp_defers_sync=engine.pipelined_fsdp_defers_sync)
    deepspeed = config.zero == 3 and engine.zero3 == "deepspeed" and config.dp * config.ep * config.cp > 1
    rank = _Largest(max_layer_params=max_layer_params, max_param_numel=max_param_numel)
    wire = grad_wire_bytes(cluster.dtype, engine)
    working = (zero3_working_bytes(rank, layout, engine, cluster.dtype, wire, deepspeed)
               + zero2_reduce_bytes(rank, layout, engine, cluster.dtype, wire))
    return reserve_bytes(config, cluster, engine, seq_len=seq_len, hidden=hidden) + working


class _Largest:
    """The two maxima zero3_working_bytes reads off a rank."""

    def __init__(self, *, max_layer_params: float, max_param_numel: float) -> None:
        self.max_layer_params = max_layer_params
        self.max_param_numel = max_param_numel
