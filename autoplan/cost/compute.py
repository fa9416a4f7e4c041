"""Compute time of one layer on one device: matmuls at a size-dependent efficiency, the attention
core at the fused-kernel efficiency, elementwise ops as memory-bound traffic.

Also the transformer-block shape the cost model reads off a Layer (BlockShape), shared with memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cluster.types import DeviceSpec
from autoplan.graph.types import Layer, LayerRole
from autoplan.plan.types import ParallelConfig, Recompute

# Bytes of the gradient accumulator per weight element, read once and written once by each weight-gradient
# pass: 4 (Megatron-LM's fp32 main_grad under --gradient-accumulation-fusion; PyTorch's 16-bit .grad plus
# the wgrad output it adds in, 2 + 2). See layer_compute.
GRAD_ACCUMULATE_BYTES = 4

# Share of the full s x s attention square a fused causal kernel computes: FlashAttention skips the
# blocks above the diagonal, and its reported efficiencies (the profiles' attention_efficiency) count
# causal FLOPs as half the square (Dao 2023, arXiv 2307.08691, sections 3.1 and 4.1). Layer FLOPs keep
# Megatron's full-square convention for MFU (Narayanan et al. 2021).
FUSED_CAUSAL_FRACTION = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockShape:
    """A recognised transformer block: h hidden, a heads, g kv heads, f dense FFN width, n_mlp weight
    matmuls in each MLP (2: GELU, 3: SwiGLU), and for MoE f_e the routed experts' width."""

    h: int
    a: int
    g: int
    f: int
    n_mlp: int
    num_experts: int = 0
    top_k: int = 0
    f_e: float = 0.0
    num_shared: int = 0

    @property
    def dense_mlps(self) -> int:
        """Dense MLPs of width f run on every token: 1 in a dense block, the shared experts in a MoE one."""
        return self.num_shared if self.num_experts else 1

    @property
    def qkv_out_width(self) -> int:
        """Output width of the fused QKV projection: h + 2 h g / a (grouped-query attention)."""
        return self.h + 2 * self.h * self.g // self.a

    def attn_proj_flops_per_token(self) -> float:
        """Forward matmul FLOPs per token of QKV + output projection: 2 h (h + 2hg/a) + 2 h^2."""
        return 2.0 * self.h * self.qkv_out_width + 2.0 * self.h * self.h


def block_shape(layer: Layer, graph_tokens: float) -> BlockShape | None:
    """The block's shape if `layer` is a recognised transformer block (hidden_size, num_heads and
    ffn_hidden_size set), else None. n_mlp is read off the captured FLOPs: the dense matmul FLOPs per
    token left after the attention projections, divided by 2 h f (Narayanan et al. 2021 appendix: 2 per
    multiply-add), rounded to 2 (GELU, 4h) or 3 (SwiGLU, Touvron et al. 2023); MoE experts' width from
    fwd_expert_flops = tokens * top_k * 2 n_mlp h f_e. A MoE block without a dense MLP to read n_mlp
    from is taken as SwiGLU when it uses grouped-query attention (Llama / Mixtral), else GELU."""
    h, a = layer.hidden_size, layer.num_heads
    if layer.role is not LayerRole.BLOCK or h <= 0 or a <= 0 or layer.ffn_hidden_size <= 0:
        return None
    g = layer.num_kv_heads or a
    f = layer.ffn_hidden_size
    base = BlockShape(h=h, a=a, g=g, f=f, n_mlp=2)
    dense_per_token = (layer.fwd_matmul_flops - layer.fwd_expert_flops) / max(graph_tokens, 1.0)
    mlp_per_token = dense_per_token - base.attn_proj_flops_per_token()
    if mlp_per_token >= 2.5 * 2 * h * f:
        n_mlp = 3
    elif mlp_per_token >= 1.5 * 2 * h * f:
        n_mlp = 2
    else:  # MoE without a dense MLP to read it from: SwiGLU with GQA (Llama / Mixtral), else GELU
        n_mlp = 3 if g != a else 2
    f_e = 0.0
    if layer.num_experts > 0 and layer.top_k > 0 and layer.fwd_expert_flops > 0:
        f_e = layer.fwd_expert_flops / (graph_tokens * layer.top_k * 2 * n_mlp * h)
    return BlockShape(h=h, a=a, g=g, f=f, n_mlp=n_mlp, num_experts=layer.num_experts,
                      top_k=layer.top_k, f_e=f_e, num_shared=layer.num_shared_experts)


def matmul_efficiency(device: DeviceSpec, flops: float) -> float:
    """Fraction of peak one matmul of `flops` FLOPs reaches: matmul_efficiency * f / (f + f_half), a
    saturating curve through half the large-GEMM efficiency at f_half (profile field
    matmul_half_size_flops): narrow matmuls of a TP split or a small microbatch do not fill the GPU."""
    if flops <= 0:
        return device.matmul_efficiency
    return device.matmul_efficiency * flops / (flops + device.matmul_half_size_flops)


def matmul_time_s(device: DeviceSpec, peak_flops: float, total_flops: float, per_matmul_flops: float) -> float:
    """Time of `total_flops` spent in matmuls of `per_matmul_flops` each."""
    if total_flops <= 0:
        return 0.0
    return total_flops / (peak_flops * matmul_efficiency(device, per_matmul_flops))


def gemm_pass_s(device: DeviceSpec, peak_flops: float, m: float, k: float, n: float, count: float,
                dtype_bytes: int, *, out_bytes: float | None = None) -> float:
    """Roofline time of `count` GEMMs [m x k] @ [k x n]: max(FLOPs / (peak * matmul_efficiency(size)),
    bytes / (HBM bw * mem_bw_efficiency)) (Williams et al., "Roofline", CACM 2009; NVIDIA "Matrix
    Multiplication Background User's Guide": arithmetic intensity 2 m n k / (bytes of A, B and C)).
    Bytes: read A (m k) and B (k n), write C (m n) in the training dtype, or `out_bytes` per C element
    when C is accumulated into (a weight gradient). A GEMM with few rows m (few tokens on this device:
    a small microbatch split over cp) reads its whole weight for little work and turns memory-bound."""
    if m <= 0 or k <= 0 or n <= 0 or count <= 0:
        return 0.0
    flops = 2.0 * m * k * n
    c_bytes = dtype_bytes if out_bytes is None else out_bytes
    nbytes = (m * k + k * n) * dtype_bytes + m * n * c_bytes
    return count * max(flops / (peak_flops * matmul_efficiency(device, flops)), memory_time_s(device, nbytes))


def memory_time_s(device: DeviceSpec, nbytes: float) -> float:
    """Memory-bound kernel: bytes / (HBM bandwidth * mem_bw_efficiency)."""
    return max(nbytes, 0.0) / (device.mem_bw_bytes_per_s * device.mem_bw_efficiency)


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeTimes:
    fwd_s: float
    bwd_s: float
    bwd_weight_s: float
    recompute_s: float
    attention_fwd_s: float  # attention core (+ its score traffic) forward: what CP overlaps with


def block_elementwise_bytes(shape: BlockShape, tokens: float, seq_len: int, config: ParallelConfig,
                            dtype_bytes: int, scores_materialised: bool) -> tuple[float, float]:
    """Forward memory traffic of a block's elementwise kernels, (total, attention-score part), bytes,
    counting each fused kernel's reads + writes (the kernels of Megatron-LM; Korthikanti et al. 2022
    section 4.1 lists the same tensors):
    - 2 norms: read h, write h each; 2 bias-dropout-residual adds: read 2h, write h, 1-byte mask h;
      replicated over tp ranks without SP, split with SP;
    - MLP activation: n_mlp * f elements (GELU: read f, write f; SwiGLU: read 2f, write f), split
      over tp;
    - MoE: permute + unpermute copies of top_k * h per token (read and write), and the activation
      of the top_k routed experts (n_mlp * f_e each) in place of the dense MLP's (shared experts keep
      theirs);
    - unfused attention scores (when materialised), a s per token split over tp: the Q K^T batched
      matmul writes them, the fused scale-mask-softmax reads and writes them, dropout reads and writes
      them plus a 1-byte mask, the scores x V matmul reads them: 6 accesses + 1 byte."""
    t = config.tp
    h_split = t if config.sp else 1
    elements = 10.0 * shape.h / h_split + shape.dense_mlps * shape.n_mlp * shape.f / t
    if shape.num_experts:
        # folded: each tp rank permutes its own tokens / tp, and etp times as many rows after the gather
        permute = (4.0 * shape.top_k * shape.h * config.expert_tp / t if config.folded
                   else 4.0 * shape.top_k * shape.h / h_split)
        elements += permute + shape.top_k * shape.n_mlp * shape.f_e / t
    mask_bytes = 2.0 * shape.h / h_split
    total = tokens * (elements * dtype_bytes + mask_bytes)
    scores = 0.0
    if scores_materialised:
        scores = tokens * shape.a * seq_len / t * (6.0 * dtype_bytes + 1.0)
    return total + scores, scores


def layer_compute(layer: Layer, device: DeviceSpec, peak_flops: float, config: ParallelConfig,
                  recompute: Recompute, *, scale: float, seq_len: int, graph_tokens: float,
                  dtype_bytes: int, scores_materialised: bool) -> ComputeTimes:
    """Forward, backward, weight-gradient and recompute time of one microbatch on one device.

    `scale` = (config microbatch / captured microbatch) / cp: the layer's captured quantities times
    `scale` are this device's share before the tp split. Matmul FLOPs are split over tp (Megatron
    column/row parallel, Shoeybi et al. 2019); each group of matmuls runs at the efficiency of its own
    size: QKV 2 T h (h + 2hg/a) / t, output projection 2 T h^2 / t, MLP 2 T h f / t each, routed
    experts 2 (T k ep / E) h f_e / t (tokens per expert on a device; ep shards experts, not tokens).
    Non-block layers run their matmul total as one matmul (the head's vocab-parallel projection).
    Backward = 2 x forward for matmuls and attention (Narayanan et al. 2021: input + weight gradient),
    the weight-gradient part equal to the forward matmul time; elementwise backward = 1.5 x the forward
    traffic (it reads the output gradient and the saved input and writes one gradient: 3 accesses for
    the forward's 2). Recompute: full re-runs the block's forward; selective re-runs the attention core
    and its score kernels (Korthikanti et al. 2022, section 5).

    Attention core: fwd_attention_flops (the full s x s square) at attention_efficiency, times
    FUSED_CAUSAL_FRACTION when the layer's attention is causal and fused (scores not materialised): the
    kernel skips the masked half, and attention_efficiency counts only the unmasked half (Dao 2023).
    Unfused attention (Megatron-LM 2021) computes the whole square and masks it: full cost.

    Host-bound floor: kernels are issued asynchronously, so a phase takes max(device time, host time)
    with host time = the layer's forward op count (Layer.num_nodes) x device.op_overhead_s, twice that
    for the backward (about two ops per forward op: input and weight gradients), once more for a
    fully recomputed forward. Small layers at small microbatches are bound by it.

    Block matmuls are timed per pass on the roofline (gemm_pass_s), with T tokens on this device:
    forward Y = X W ([T x k] @ [k x n]), input gradient dX = dY W^T ([T x n] @ [n x k]) and weight
    gradient dW = X^T dY ([k x T] @ [T x n]) accumulated into the gradient buffer: read + write of the
    accumulator, 2 x GRAD_ACCUMULATE_BYTES per weight element (PyTorch AccumulateGrad adds each
    microbatch's 16-bit .grad into the buffer; Megatron-LM's --gradient-accumulation-fusion has the wgrad
    GEMM read and write the fp32 main_grad directly: both move about 8 bytes per weight element). At
    thousands of tokens per device every pass is compute-bound and this is FLOPs / rate as before; with
    a few hundred (large cp, microbatch 1) the weight traffic sets the time."""
    t = config.tp
    tokens = graph_tokens * scale  # tokens this device processes (before the tp split of the matmuls)
    total_mm = layer.fwd_matmul_flops * scale / t
    expert_mm = layer.fwd_expert_flops * scale / t
    shape = block_shape(layer, graph_tokens)
    if shape is None:
        mm_s = matmul_time_s(device, peak_flops, total_mm, total_mm)
        dx_s = dw_s = mm_s
        elementwise_bytes = _fallback_bytes(layer, dtype_bytes) * scale / (t if layer.role is LayerRole.HEAD else 1)
        score_bytes = 0.0
    else:
        qkv = 2.0 * tokens * shape.h * shape.qkv_out_width / t
        proj = 2.0 * tokens * shape.h * shape.h / t
        dense_mm = max(total_mm - expert_mm, 0.0)
        attn_proj = min(qkv + proj, dense_mm)
        mlp = max(dense_mm - attn_proj, 0.0)
        # (m, k, n, count) of each weight matmul, tp-split; counts carry the captured FLOPs exactly
        groups = [(tokens, shape.h, shape.qkv_out_width / t, attn_proj * qkv / (qkv + proj) / qkv if qkv else 0.0),
                  (tokens, shape.h / t, shape.h, attn_proj * proj / (qkv + proj) / proj if proj else 0.0),
                  (tokens, shape.h, shape.f / t, mlp / (2.0 * tokens * shape.h * shape.f / t))]
        if expert_mm > 0:
            per_expert_tokens, width = _expert_gemm(shape, config, tokens)
            one = 2.0 * per_expert_tokens * shape.h * width
            groups.append((per_expert_tokens, shape.h, width, expert_mm / one))
        acc = 2.0 * GRAD_ACCUMULATE_BYTES
        mm_s = sum(gemm_pass_s(device, peak_flops, m, k, n, c, dtype_bytes) for m, k, n, c in groups)
        dx_s = sum(gemm_pass_s(device, peak_flops, m, n, k, c, dtype_bytes) for m, k, n, c in groups)
        dw_s = sum(gemm_pass_s(device, peak_flops, k, m, n, c, dtype_bytes, out_bytes=acc) for m, k, n, c in groups)
        elementwise_bytes, score_bytes = block_elementwise_bytes(
            shape, tokens, seq_len, config, dtype_bytes, scores_materialised)
    attn_flops = layer.fwd_attention_flops * scale / t
    if layer.causal_attention and not scores_materialised:
        attn_flops *= FUSED_CAUSAL_FRACTION
    attn_s = attn_flops / (peak_flops * device.attention_efficiency)
    elem_s = memory_time_s(device, elementwise_bytes)
    fwd = mm_s + attn_s + elem_s
    bwd = dx_s + dw_s + 2.0 * attn_s + 1.5 * elem_s
    attention_fwd = attn_s + memory_time_s(device, score_bytes)
    if layer.role is not LayerRole.BLOCK or recompute is Recompute.NONE:
        rec = 0.0
    elif recompute is Recompute.FULL:
        rec = fwd
    else:
        rec = attention_fwd
    host = getattr(layer, "num_nodes", 0) * device.op_overhead_s
    return ComputeTimes(fwd_s=max(fwd, host), bwd_s=max(bwd, 2.0 * host), bwd_weight_s=dw_s,
                        recompute_s=max(rec, host) if recompute is Recompute.FULL and rec else rec,
                        attention_fwd_s=attention_fwd)


def _expert_gemm(shape: BlockShape, config: ParallelConfig, tokens: float) -> tuple[float, float]:
    """(rows, output width) of one routed expert's GEMM on a device, balanced routing. Unfolded: the tp
    group's tokens, experts sharded over ep and split over tp: tokens top_k ep / E rows of width f_e / t.
    Folded (etp, eep): each tp rank routes tokens / tp of them, an expert receives the copies of the
    eep * etp ranks of its expert group, split over etp: (tokens / tp) etp eep top_k / E rows of width
    f_e / etp (Megatron-Core's alltoall dispatcher with expert tensor parallelism). The FLOPs per device
    are the same, tokens top_k 2 n_mlp h f_e / tp, in both."""
    experts = max(shape.num_experts, 1)
    if not config.folded:
        return tokens * shape.top_k * config.ep / experts, shape.f_e / config.tp
    rows = tokens / config.tp * config.expert_tp * config.expert_ep * shape.top_k / experts
    return rows, shape.f_e / config.expert_tp


def _fallback_bytes(layer: Layer, dtype_bytes: int) -> float:
    """Elementwise traffic of a layer the model does not recognise: its captured bytes_moved (every
    op's reads + writes: an upper bound, it includes the matmul operands), else one access of
    dtype_bytes per elementwise FLOP."""
    if layer.bytes_moved > 0:
        return float(layer.bytes_moved)
    return layer.fwd_elementwise_flops * dtype_bytes
