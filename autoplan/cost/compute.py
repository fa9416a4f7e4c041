"""Compute time of one layer on one device: matmuls by shape (cost/kernels.py), the attention core as
the engine runs it (FlashAttention, or Megatron's unfused batched GEMMs), elementwise kernels as
memory-bound traffic (their bytes: cost/elementwise.py), and the host time to issue the layer's ops.

The transformer-block shape the cost model reads off a Layer (BlockShape, block_shape) lives in
cost/shapes.py and is re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cluster.types import DeviceSpec
from autoplan.cost.elementwise import block_elementwise_bytes, score_backward_bytes
from autoplan.cost.kernels import (
    FUSED_DROPOUT_SLOWDOWN,
    eager_norm_time_s,
    flash_efficiency,
    gemm_pass_s,
    matmul_efficiency,
    memory_time_s,
    unfused_attention_s,
)
from autoplan.cost.passes import SOFTMAX_FALLBACK_BWD_OPS, SOFTMAX_FALLBACK_FWD_OPS, block_pass_bytes
from autoplan.cost.projections import early_stop_skip_s, op_selective_recompute_s, split_qkv
from autoplan.cost.shapes import BlockShape, block_shape
from autoplan.cost.userbuffers import margin_extra_s, op_margins
from autoplan.graph.types import Layer, LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.layout import expert_tp_split
from autoplan.plan.types import ParallelConfig, Recompute

__all__ = ["BlockShape", "ComputeTimes", "block_shape", "gemm_pass_s", "layer_compute", "matmul_efficiency",
           "matmul_time_s", "memory_time_s", "sync_copy_s"]

# Bytes of the gradient accumulator per weight element, read once and written once by each weight-gradient
# pass: 4 (Megatron-LM's fp32 main_grad under --gradient-accumulation-fusion; PyTorch's 16-bit .grad plus
# the wgrad output it adds in, 2 + 2). See layer_compute. When the .grad is None instead (after
# optimizer.zero_grad(set_to_none=True), or FSDP2's post_backward `fsdp_param.unsharded_param.grad = None`
# once the gradient is copied into the reduce-scatter input), autograd adopts the GEMM's output as the
# gradient without a copy (torch/csrc/autograd/functions/accumulate_grad.h, accumulateGrad: "we can steal
# new_grad without a deep copy" when it obeys the parameter's layout): the output is written once.
GRAD_ACCUMULATE_BYTES = 4

# Share of the full s x s attention square a fused causal kernel computes: FlashAttention skips the
# blocks above the diagonal, and its reported efficiencies (the profiles' attention_efficiency) count
# causal FLOPs as half the square (Dao 2023, arXiv 2307.08691, sections 3.1 and 4.1). Layer FLOPs keep
# Megatron's full-square convention for MFU (Narayanan et al. 2021).
FUSED_CAUSAL_FRACTION = 0.5
# FlashAttention's backward FLOPs over its forward's (Dao 2023, benchmark convention: 10 d vs 4 d per score).
FA_BACKWARD_FLOPS = 2.5
# Backward kernels issued per forward op (input and weight gradients: about two), for the host time.
BACKWARD_OPS_PER_FORWARD_OP = 2.0
# A device-synchronising host-to-device copy (torch.tensor(x, device=cuda): copy_ with non_blocking=False
# is cudaMemcpyAsync + cudaStreamSynchronize, PyTorch aten/src/ATen/native/cuda/Copy.cu) holds the host
# until the copy has run behind every queued kernel: the copy's own latency, 5-7 us per cudaMemcpyAsync
# of a small chunk (Wu et al., "DualPath", arXiv 2602.21548, section 5.2, measured); the device, its queue
# now empty, then idles while the host issues the next kernel (one op_overhead_s). See layer_compute.
H2D_SYNC_COPY_S = 6.0e-6


def sync_copy_s(device: DeviceSpec, *, issue_counted: bool) -> float:
    """What one device-synchronising copy adds to the work around it: its own latency (H2D_SYNC_COPY_S) and,
    the device's queue drained, the device's idle while the host issues the next op (op_overhead_s), unless
    the caller already counts that issue in series with the device (`issue_counted`: a layer's ops under
    Engine.launch_blocking, cost/layer.py _with_host; see _sync_copies_s). A caller that counts no host time
    for the ops around the copy (cost/p2p.py partitioned_role_s) pays the issue here, launch_blocking or not."""
    return H2D_SYNC_COPY_S + (0.0 if issue_counted else device.op_overhead_s)


def matmul_time_s(device: DeviceSpec, peak_flops: float, total_flops: float, per_matmul_flops: float) -> float:
    """Time of `total_flops` spent in matmuls of `per_matmul_flops` each (a layer without known shapes)."""
    if total_flops <= 0:
        return 0.0
    return total_flops / (peak_flops * matmul_efficiency(device, per_matmul_flops))


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeTimes:
    """Device time (kernels) and host time (issuing them) of one layer, one microbatch."""

    fwd_s: float
    bwd_s: float
    bwd_weight_s: float
    recompute_s: float
    attention_fwd_s: float  # attention core (+ its score traffic) forward: what CP overlaps with
    gemm_fwd_s: float = 0.0  # the block's weight GEMMs in forward: what TP comm overlap hides behind
    gemm_bwd_s: float = 0.0  # ... and in backward
    host_fwd_s: float = 0.0  # host time to issue the forward's ops
    host_bwd_s: float = 0.0  # ... and the backward's
    host_rec_s: float = 0.0  # ... and a fully recomputed forward's (the block's forward ops again)
    # weight-gradient GEMMs of the column-parallel linears whose input gradient is tp-reduced (QKV; the
    # MLP's input projections): what an asynchronous backward TP collective overlaps (Engine.tp_bwd_overlap)
    wgrad_column_s: tuple[float, ...] = ()
    # what the block's device-synchronising copies add to each forward (and to a fully recomputed one,
    # which runs the same code), after max(device, host): the copies' latency and the drained queue's
    # idle device (Engine.block_forward_syncs, H2D_SYNC_COPY_S)
    sync_fwd_s: float = 0.0
    # Engine.tp_overlap_margin_sms(_by_op): the seconds the GEMMs TE's userbuffers narrow lose, forward and
    # backward, each overlap's own margin on its own GEMM (cost/userbuffers.margin_extra_s; zero unless it runs)
    margin_fwd_s: float = 0.0
    margin_bwd_s: float = 0.0
    # the weight-gradient seconds saved when each GEMM's output becomes the gradient as is (written once
    # in the training dtype) instead of being accumulated into it (Engine.grad_freed_after_reduce)
    fresh_grad_saving_s: float = 0.0


def expert_divisor(config: ParallelConfig, engine: Engine | None = None) -> int:
    """What a device's routed-expert work and activations per token of its dense replica are divided by:
    tp when folded (each tp rank routes tokens / tp, gathered etp-fold into 1/etp of each expert), else the
    experts' own tp split (plan.layout.expert_tp_split: tp under an engine that splits unfolded experts
    over tp, 1 under autoplan's executor, which runs them whole on every tp rank)."""
    if config.folded:
        return config.tp
    return expert_tp_split(config, unfolded_over_tp=(engine or Engine()).tp_splits_unfolded_experts)


def _block_gemm_groups(shape: BlockShape, tokens: float, total_mm: float, expert_mm: float,
                       config: ParallelConfig, expert_div: int | None = None) -> list[tuple[float, float, float, float]]:
    """(m, k, n, count) of each weight matmul of a block on this device, tp-split (Megatron column / row
    parallel, Shoeybi et al. 2019): QKV [T x h] @ [h x (h + 2hg/a)/t], projection [T x h/t] @ [h/t x h],
    each MLP matmul [T x h] @ [h x f/t]; routed experts as _expert_gemm says (unfolded: [T k ep / E x h]
    @ [h x f_e / t], tokens per expert on a device). Counts carry the captured FLOPs exactly."""
    t = config.tp
    qkv = 2.0 * tokens * shape.h * shape.qkv_out_width / t
    proj = 2.0 * tokens * shape.h * shape.h / t
    dense_mm = max(total_mm - expert_mm, 0.0)
    attn_proj = min(qkv + proj, dense_mm)
    mlp = max(dense_mm - attn_proj, 0.0)
    groups = [(tokens, shape.h, shape.qkv_out_width / t, attn_proj * qkv / (qkv + proj) / qkv if qkv else 0.0),
              (tokens, shape.h / t, shape.h, attn_proj * proj / (qkv + proj) / proj if proj else 0.0),
              (tokens, shape.h, shape.f / t, mlp / (2.0 * tokens * shape.h * shape.f / t))]
    if expert_mm > 0:
        per_expert_tokens, width = _expert_gemm(shape, config, tokens, expert_div or config.tp)
        one = 2.0 * per_expert_tokens * shape.h * width
        groups.append((per_expert_tokens, shape.h, width, expert_mm / one))
    return groups


def _attention_s(layer: Layer, shape: BlockShape | None, device: DeviceSpec, peak_flops: float,
                 config: ParallelConfig, *, scale: float, seq_len: int, dtype_bytes: int,
                 scores_materialised: bool, nonmatmul_ratio: float, dropout: bool = False) -> tuple[float, float]:
    """(forward, backward) of the attention core on this device (kernels.py): Megatron's unfused
    batched GEMMs when the scores are materialised (their dropout is elementwise traffic,
    block_elementwise_bytes); else FlashAttention at its shape-dependent rate on the captured FLOPs (half
    the square when causal, FUSED_CAUSAL_FRACTION), the backward FA_BACKWARD_FLOPS times the forward (Dao
    2023 counts the backward, recomputation of S included, as 2.5 x the forward's FLOPs, and quotes
    efficiencies on that count), both FUSED_DROPOUT_SLOWDOWN slower when `dropout` (the engine's
    attention_dropout on a block with dropout: Philox and masking inside the kernel). Layers without a
    block shape: attention FLOPs at attention_efficiency, backward 2 x forward."""
    attn_flops = layer.fwd_attention_flops * scale / config.tp
    if attn_flops <= 0:
        return 0.0, 0.0
    if shape is None:
        causal = layer.causal_attention and not scores_materialised
        fwd = attn_flops * (FUSED_CAUSAL_FRACTION if causal else 1.0) / (peak_flops * device.attention_efficiency)
        return fwd, 2.0 * fwd
    b = config.microbatch
    batch_heads = b * shape.a / config.tp
    s_q, d = seq_len / config.cp, shape.h / shape.a
    if scores_materialised:
        return unfused_attention_s(device, peak_flops, batch_heads=batch_heads, s_q=s_q, s_k=seq_len,
                                   head_dim=d, dtype_bytes=dtype_bytes)
    causal = layer.causal_attention
    eff = flash_efficiency(device, batch_heads=batch_heads, s_q=s_q, s_k=seq_len, head_dim=d, causal=causal,
                           nonmatmul_ratio=nonmatmul_ratio)
    fwd = attn_flops * (FUSED_CAUSAL_FRACTION if causal else 1.0) / (peak_flops * eff)
    fwd *= FUSED_DROPOUT_SLOWDOWN if dropout else 1.0
    return fwd, FA_BACKWARD_FLOPS * fwd


def host_ops(layer: Layer, engine: Engine) -> tuple[float, float]:
    """(forward, backward) host-issued operations of the layer: the engine's counts for a transformer
    block when it has them (counted in that engine's code: dispatcher ops, Python module calls and custom
    autograd Function calls, each a Python-level call of about op_overhead_s), else the captured graph's
    nodes with BACKWARD_OPS_PER_FORWARD_OP backward ops per forward op; none under CUDA graphs (PyTorch
    blog "Accelerating PyTorch with CUDA Graphs", 2021: one graph launch replays every kernel)."""
    if engine.cuda_graphs:
        return 0.0, 0.0
    if layer.role is LayerRole.BLOCK and engine.block_forward_ops:
        fwd = float(engine.block_forward_ops)
        return fwd, float(engine.block_backward_ops) or BACKWARD_OPS_PER_FORWARD_OP * fwd
    fwd = float(getattr(layer, "num_nodes", 0))
    return fwd, BACKWARD_OPS_PER_FORWARD_OP * fwd


def layer_compute(layer: Layer, device: DeviceSpec, peak_flops: float, config: ParallelConfig,
                  recompute: Recompute, *, scale: float, seq_len: int, graph_tokens: float,
                  dtype_bytes: int, scores_materialised: bool, engine: Engine | None = None,
                  nonmatmul_ratio: float = 16.0, hp_grads: bool = False) -> ComputeTimes:
    """Forward, backward, weight-gradient and recompute time of one microbatch on one device.

    `scale` = (config microbatch / captured microbatch) / cp: the layer's captured quantities times
    `scale` are this device's share before the tp split. Block matmuls are timed per pass on the
    roofline (kernels.gemm_pass_s) at their own shapes (_block_gemm_groups), with T tokens on this
    device: forward Y = X W, input gradient dX = dY W^T and weight gradient dW = X^T dY accumulated into
    the gradient buffer (read + write, 2 x GRAD_ACCUMULATE_BYTES per weight element: PyTorch
    AccumulateGrad / Megatron's --gradient-accumulation-fusion into main_grad); under
    engine.grad_freed_after_reduce also what those passes save when the gradient is None and autograd adopts
    the GEMM's output (written once, dtype_bytes per element: fresh_grad_saving_s), as under `hp_grads`
    (Engine.hp_grads of the plan's dtype: BF16_Optimizer's clear_lp_grads). Non-block layers run
    their matmul total as one matmul. Attention: _attention_s. Elementwise: block_elementwise_bytes at
    streaming bandwidth, backward 1.5 x forward (it reads the output gradient and the saved input and
    writes one gradient: 3 accesses for the forward's 2; the materialised scores as score_backward_bytes
    says), plus the engine's own extra passes
    (passes.extra_pass_bytes: separate bias adds, bias-gradient reductions, attention layout copies),
    each in the phase it runs in. Recompute: full re-runs the block's forward;
    selective re-runs the attention core and its score kernels (Korthikanti et al. 2022, section 5), or
    under torchtitan's op policy (engine.selective_recompute 'op') the matmuls it does not save
    (projections.op_selective_recompute_s) and every memory-bound op of the forward, the engine's passes
    included; a full recompute under engine.recompute_early_stop skips the MLP output GEMM and the residual
    add after it (projections.early_stop_skip_s). engine.separate_qkv_projections prices Q, K and V as
    three GEMMs (projections.split_qkv). Under engine.tp_comm_overlap with SP and TE userbuffers margins
    (tp_overlap_margin_sms, tp_overlap_margin_sms_by_op: userbuffers.op_margins), a dense block also reports
    what its margin-narrowed GEMMs lose, each overlap's margin on its own GEMM (userbuffers.margin_extra_s;
    layer.py adds it).

    Host: the forward and backward issue host_ops(layer, engine) ops at device.op_overhead_s each, a
    fully recomputed block its forward's again, and the activation-checkpoint wrapper around it
    engine.checkpoint_forward_ops / checkpoint_backward_ops more; kernels are asynchronous, so a phase
    takes max(device, host) (layer.py combines them; on a CPU profile, device.cpu_cores > 0, the rank's
    own thread issues and then runs each op, so they add). Under tp > 1 each op also pays
    device.tp_op_overhead_s (DTensor sharding propagation in front of every op) and, when the layer is
    data parallel (dp * ep * cp > 1), each pass device.dp_layer_overhead_s (FSDP2's pre/post hooks per
    module), twice in the backward; both are measured on CPU profiles and 0 on the shipped GPU ones.
    A block whose forward makes engine.block_forward_syncs device-synchronising host-to-device copies
    pays each one's H2D_SYNC_COPY_S + op_overhead_s per forward (sync_fwd_s; not under CUDA graphs, not
    on a CPU profile, whose ops already run synchronously; under engine.launch_blocking the copy's latency
    only: _sync_copies_s)."""
    engine = engine or Engine()
    t = config.tp
    tokens = graph_tokens * scale  # tokens this device processes (before the tp split of the matmuls)
    expert_div = expert_divisor(config, engine)
    expert_mm = layer.fwd_expert_flops * scale / expert_div
    total_mm = (layer.fwd_matmul_flops - layer.fwd_expert_flops) * scale / t + expert_mm
    shape = block_shape(layer, graph_tokens)
    fresh_s = 0.0
    if shape is None:
        mm_s = matmul_time_s(device, peak_flops, total_mm, total_mm)
        dx_s = dw_s = mm_s
        elementwise_bytes = _fallback_bytes(layer, dtype_bytes) * scale / (t if layer.role is LayerRole.HEAD else 1)
        score_bytes = 0.0
        wgrad_column, margin = (), (0.0, 0.0)
    else:
        groups = _block_gemm_groups(shape, tokens, total_mm, expert_mm, config, expert_div)
        if engine.separate_qkv_projections:  # wq, wk, wv as three GEMMs (cost/projections.py)
            groups = split_qkv(groups, shape, t)
        acc = 2.0 * GRAD_ACCUMULATE_BYTES
        mm_s = sum(gemm_pass_s(device, peak_flops, m, k, n, c, dtype_bytes) for m, k, n, c in groups)
        dx_s = sum(gemm_pass_s(device, peak_flops, m, n, k, c, dtype_bytes) for m, k, n, c in groups)
        dws = [gemm_pass_s(device, peak_flops, k, m, n, c, dtype_bytes, out_bytes=acc) for m, k, n, c in groups]
        dw_s = sum(dws)
        if engine.grad_freed_after_reduce or hp_grads:  # .grad None: the GEMM's output is adopted
            fresh_s = dw_s - sum(gemm_pass_s(device, peak_flops, k, m, n, c, dtype_bytes) for m, k, n, c in groups)
        qkv_dw = dws[0] + (dws[-1] if engine.separate_qkv_projections else 0.0)
        wgrad_column = (qkv_dw, dws[2] * (shape.n_mlp - 1) / shape.n_mlp)  # QKV; fc1 (GELU) or w1, w3 (SwiGLU)
        margin = (margin_extra_s(device, peak_flops, groups, shape.n_mlp, dtype_bytes, op_margins(engine),
                                 acc, engine.separate_qkv_projections)
                  if engine.tp_comm_overlap and config.sp and t > 1 and not shape.num_experts else (0.0, 0.0))
        elementwise_bytes, score_bytes = block_elementwise_bytes(
            shape, tokens, seq_len, config, dtype_bytes, scores_materialised, fused=engine.fused_elementwise,
            expert_div=expert_div, rmsnorm=engine.rmsnorm)
    attn_fwd, attn_bwd = _attention_s(layer, shape, device, peak_flops, config, scale=scale, seq_len=seq_len,
                                      dtype_bytes=dtype_bytes, scores_materialised=scores_materialised,
                                      nonmatmul_ratio=nonmatmul_ratio,
                                      dropout=shape is not None and shape.dropout and engine.attention_dropout > 0)
    elem_s = memory_time_s(device, elementwise_bytes)
    extra, fallback = block_pass_bytes(shape, tokens, config, seq_len, dtype_bytes, engine, scores_materialised)
    norm_f = eager_norm_time_s(device, extra.norm_fwd, backward=False)
    fwd = mm_s + attn_fwd + elem_s + memory_time_s(device, extra.fwd) + norm_f
    elem_bwd_s = memory_time_s(device, 1.5 * (elementwise_bytes - score_bytes)
                               + score_backward_bytes(shape, score_bytes, dtype_bytes))
    bwd = (dx_s + dw_s + attn_bwd + elem_bwd_s + memory_time_s(device, extra.bwd)
           + eager_norm_time_s(device, extra.norm_bwd, backward=True)
           + embedding_grad_add_s(layer, device, t, dtype_bytes, engine))
    attention_fwd = attn_fwd + memory_time_s(device, score_bytes + extra.attention_fwd)
    if layer.role is not LayerRole.BLOCK or recompute is Recompute.NONE:
        rec = 0.0
    elif recompute is Recompute.FULL:  # the forward again, less what an early-stopping checkpoint skips
        early = engine.recompute_early_stop and shape is not None
        rec = fwd - (early_stop_skip_s(device, peak_flops, groups, shape, tokens / (t if config.sp else 1),
                                       dtype_bytes) if early else 0.0)
    elif engine.selective_recompute == "op" and shape is not None:  # every memory-bound op runs again
        rec = (op_selective_recompute_s(device, peak_flops, groups, shape, dtype_bytes,
                                        engine.separate_qkv_projections) + elem_s + memory_time_s(device, extra.fwd)
               + norm_f)
    else:
        rec = attention_fwd
    ops_f, ops_b = host_ops(layer, engine)
    if fallback and not engine.cuda_graphs:  # the torch softmax's ops in place of the fused kernel's one
        ops_f, ops_b = ops_f + SOFTMAX_FALLBACK_FWD_OPS, ops_b + SOFTMAX_FALLBACK_BWD_OPS
    ops_r = ops_f if layer.role is LayerRole.BLOCK and recompute is Recompute.FULL else 0.0
    if ops_r and not engine.cuda_graphs:  # the checkpoint wrapper's own ops around the block
        ops_f, ops_b = ops_f + engine.checkpoint_forward_ops, ops_b + engine.checkpoint_backward_ops
    # the executor's extra host work, measured on a CPU profile (0 elsewhere): DTensor dispatch per op of a
    # tensor-parallel layer, FSDP2's per-module hooks per pass of a data-parallel layer (backward: twice)
    op = device.op_overhead_s + (device.tp_op_overhead_s if t > 1 else 0.0)
    hook = device.dp_layer_overhead_s if config.num_replicas * config.cp > 1 else 0.0
    syncs = engine.block_forward_syncs if layer.role is LayerRole.BLOCK and not engine.cuda_graphs else 0
    sync = _sync_copies_s(syncs, device, engine)
    return ComputeTimes(fwd_s=fwd, bwd_s=bwd, bwd_weight_s=dw_s, recompute_s=rec, attention_fwd_s=attention_fwd,
                        gemm_fwd_s=mm_s, gemm_bwd_s=dx_s + dw_s, host_fwd_s=ops_f * op + hook,
                        host_bwd_s=ops_b * op + 2.0 * hook, host_rec_s=ops_r * op + (hook if ops_r else 0.0),
                        wgrad_column_s=wgrad_column, sync_fwd_s=sync, margin_fwd_s=margin[0],
                        margin_bwd_s=margin[1], fresh_grad_saving_s=fresh_s)


def _sync_copies_s(syncs: int, device: DeviceSpec, engine: Engine) -> float:
    """What a forward's `syncs` device-synchronising host-to-device copies add after max(device, host): each
    copy's H2D_SYNC_COPY_S and the drained device's idle while the host issues the next op (op_overhead_s).
    Under engine.launch_blocking the host and device times already add (cost/layer.py _with_host), the
    next op's issue among them, and the queue is always empty: only the copy's own latency remains. None
    on a CPU profile (a host memcpy, part of the op)."""
    if device.cpu_cores:
        return 0.0
    return syncs * sync_copy_s(device, issue_counted=engine.launch_blocking)


def embedding_grad_add_s(layer: Layer, device: DeviceSpec, tp: int, dtype_bytes: int, engine: Engine) -> float:
    """What an embedding's backward adds under engine.embedding_grad_add: its weight gradient is not fused
    into the main_grad buffer by a GEMM (there is none) but materialised by autograd as a dense .grad of the
    table's shape (torch.nn.functional.embedding, sparse=False), which the DDP's per-parameter hook then adds
    into the fp32 main_grad: read the .grad (dtype_bytes) and read + write the accumulator (2 x
    GRAD_ACCUMULATE_BYTES) per table element, every microbatch. Megatron-Core (NVIDIA/Megatron-LM
    937571cfd49d, r0.8.0): megatron/core/tensor_parallel/layers.py VocabParallelEmbedding.forward
    F.embedding(masked_input, self.weight) (a V / tp x h shard), megatron/core/distributed/
    distributed_data_parallel.py _make_param_hook `param.main_grad.add_(param.grad.data)`. The table is the
    layer's parameters over tp (learned positions, s x h, are replicated, not split: a few % of the
    table). 0 for other layers and without the field."""
    if layer.role is not LayerRole.EMBEDDING or not engine.embedding_grad_add:
        return 0.0
    return memory_time_s(device, layer.num_params / tp * (dtype_bytes + 2.0 * GRAD_ACCUMULATE_BYTES))


def _expert_gemm(shape: BlockShape, config: ParallelConfig, tokens: float, split: int) -> tuple[float, float]:
    """(rows, output width) of one routed expert's GEMM on a device, balanced routing. Unfolded: the tp
    group's tokens, experts sharded over ep and split `split` ways (expert_divisor: tp, or 1 when the
    engine runs them whole on every tp rank): tokens top_k ep / E rows of width f_e / split.
    Folded (etp, eep): each tp rank routes tokens / tp of them, an expert receives the copies of the
    eep * etp ranks of its expert group, split over etp: (tokens / tp) etp eep top_k / E rows of width
    f_e / etp (Megatron-Core's alltoall dispatcher with expert tensor parallelism). The FLOPs per device
    are the same, tokens top_k 2 n_mlp h f_e / tp, in both."""
    experts = max(shape.num_experts, 1)
    if not config.folded:
        return tokens * shape.top_k * config.ep / experts, shape.f_e / split
    rows = tokens / config.tp * config.expert_tp * config.expert_ep * shape.top_k / experts
    return rows, shape.f_e / config.expert_tp


def _fallback_bytes(layer: Layer, dtype_bytes: int) -> float:
    """Elementwise traffic of a layer the model does not recognise: its captured bytes_moved (every
    op's reads + writes: an upper bound, it includes the matmul operands), else one access of
    dtype_bytes per elementwise FLOP."""
    if layer.bytes_moved > 0:
        return float(layer.bytes_moved)
    return layer.fwd_elementwise_flops * dtype_bytes
