"""Forward and backward memory traffic of a transformer block's elementwise kernels (norms, bias-dropout-
residual adds, the MLP activation, MoE permutes, RoPE, the materialised attention scores), fused or eager,
in bytes: what cost/compute.py prices at streaming bandwidth.
"""

from __future__ import annotations

from autoplan.cost.shapes import BlockShape
from autoplan.plan.types import ParallelConfig

# Eager (unfused) elementwise kernels re-read and re-write their tensors once per op. RMSNorm in eager
# PyTorch (x.pow(2).mean(-1), rsqrt, x * rstd, * weight: torch.nn.RMSNorm's composite path) reads the
# input 4 times and writes 3 against 1 + 1 for a fused kernel; SwiGLU (silu(a), then * b) reads 3 f and
# writes 2 f against 2 f + f fused. LayerNorm (native kernel) and GELU are single kernels either way.
EAGER_RMSNORM_TRAFFIC = 3.5
EAGER_SWIGLU_TRAFFIC = 5.0 / 3.0
# Rotary embeddings on Q and K (Su et al. 2021) in a Llama-style (SwiGLU) block: a fused kernel reads and
# writes them once (Transformer Engine's fused RoPE, 2 + 2 bytes per element); the eager half-split form
# (x * cos + rotate_half(x) * sin: cat of two slices, two multiplies, an add) reads about 10 and writes 8
# bytes per element: 4.5 times the fused traffic.
EAGER_ROPE_TRAFFIC = 4.5


def block_elementwise_bytes(shape: BlockShape, tokens: float, seq_len: int, config: ParallelConfig,
                            dtype_bytes: int, scores_materialised: bool, *,
                            fused: bool = True, expert_div: int | None = None,
                            rmsnorm: str = "eager") -> tuple[float, float]:
    """Forward memory traffic of a block's elementwise kernels, (total, attention-score part), bytes,
    counting each kernel's reads + writes (the fused kernels of Megatron-LM; Korthikanti et al. 2022
    section 4.1 lists the same tensors):
    - 2 norms: read h, write h each; 2 bias-dropout-residual adds: read 2h, write h, 1-byte mask h (no
      mask in a block without dropout, BlockShape.dropout); replicated over tp ranks without SP, split
      with SP;
    - MLP activation: n_mlp * f elements (GELU: read f, write f; SwiGLU: read 2f, write f), split
      over tp;
    - MoE: permute + unpermute copies of top_k * h per token (read and write), and the activation
      of the top_k routed experts (n_mlp * f_e each, over `expert_div`: expert_divisor, tp by default)
      in place of the dense MLP's (shared experts keep theirs);
    - unfused attention scores (when materialised), a s per token split over tp: the fused
      scale-mask-softmax reads and writes them, dropout reads and writes them plus a 1-byte mask
      (4 accesses + 1 byte; 2 accesses without dropout; the Q K^T GEMM's write and the P V GEMM's read
      are in their rooflines).
    - a SwiGLU (Llama-style) block's rotary embedding of Q and K: read and write h + h g / a per token.
    `fused` False (eager kernels): a SwiGLU block's norms (RMSNorm), its SwiGLU and its RoPE move
    EAGER_RMSNORM_TRAFFIC, EAGER_SWIGLU_TRAFFIC and EAGER_ROPE_TRAFFIC times their fused traffic; the
    norms only when `rmsnorm` (Engine.rmsnorm) is 'eager': a 'fused' RMSNorm moves the fused traffic, and
    an 'eager_fp32' one none here: passes.extra_pass_bytes counts its kernels whole (PassBytes.norm_fwd)."""
    t = config.tp
    h_split = t if config.sp else 1
    rms = 1.0 if fused or shape.n_mlp != 3 else {"eager": EAGER_RMSNORM_TRAFFIC, "eager_fp32": 0.0}.get(rmsnorm, 1.0)
    act = 1.0 if fused or shape.n_mlp != 3 else EAGER_SWIGLU_TRAFFIC
    norms, residual = 4.0 * shape.h * rms, 6.0 * shape.h
    elements = (norms + residual) / h_split + act * shape.dense_mlps * shape.n_mlp * shape.f / t
    if shape.n_mlp == 3:  # Llama-style block: RoPE on Q and K (h + h g / a per token, split over tp)
        rope = 1.0 if fused else EAGER_ROPE_TRAFFIC
        elements += rope * 2.0 * (shape.h + shape.h * shape.g / shape.a) / t
    if shape.num_experts:
        # folded: each tp rank permutes its own tokens / tp, and etp times as many rows after the gather
        permute = (4.0 * shape.top_k * shape.h * config.expert_tp / t if config.folded
                   else 4.0 * shape.top_k * shape.h / h_split)
        elements += permute + act * shape.top_k * shape.n_mlp * shape.f_e / (expert_div or t)
    mask_bytes = 2.0 * shape.h / h_split if shape.dropout else 0.0
    total = tokens * (elements * dtype_bytes + mask_bytes)
    scores = 0.0
    if scores_materialised:  # softmax read + write; dropout read + write + its 1-byte mask
        scores = tokens * shape.a * seq_len / t * ((4.0 * dtype_bytes + 1.0) if shape.dropout else 2.0 * dtype_bytes)
    return total + scores, scores


def score_backward_bytes(shape: BlockShape | None, score_bytes: float, dtype_bytes: int) -> float:
    """Backward memory traffic of the materialised scores whose forward moved `score_bytes`
    (block_elementwise_bytes' score part): the fused softmax's backward reads the gradient and the saved
    probabilities and writes the gradient in place (3 d per score for the forward's 2 d: Megatron
    fused_kernels/scaled_upper_triang_masked_softmax_cuda.cu bwd_cuda, a8d172b3); with dropout first
    torch.nn.Dropout's backward (aten native_dropout_backward: grad * mask * scale) reads the gradient and
    the 1-byte mask and writes one, 2 d + 1 for the forward's 2 d + 1 (read, write, mask): 5 d + 1 per
    score in all, not 1.5 x the forward's 4 d + 1, since the dropout's backward reads no saved input."""
    if shape is None or not shape.dropout:
        return 1.5 * score_bytes
    d = float(dtype_bytes)
    return score_bytes * (5.0 * d + 1.0) / (4.0 * d + 1.0)
