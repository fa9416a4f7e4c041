"""Memory-bound passes some engines' code adds around a block's GEMMs and attention core, beyond the
fused elementwise kernels of elementwise.block_elementwise_bytes: separate bias adds, bias-gradient
reductions, the copies of Megatron's [s, b, np, hn] attention layout, the repeated K / V of grouped-query
attention and an RMSNorm run eagerly in fp32. Each is switched on by its own
Engine field (sources in engines/*.yaml) and priced as bytes read + written at streaming bandwidth
(kernels.memory_time_s), like the other elementwise kernels.

Symbols, per microbatch on one device: T tokens (after the cp split), t = tp, q = h + 2 h g / a (the QKV
output width, BlockShape.qkv_out_width), f the dense MLP width, m the dense MLPs per block
(BlockShape.dense_mlps), d bytes per element, and T_h = T / t with sequence parallelism, else T (the
tokens of the row-parallel outputs and the residual stream on this device). Only a block with biases
(BlockShape.biased) has bias terms.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autoplan.plan.engine import Engine

if TYPE_CHECKING:
    from autoplan.cost.compute import BlockShape
    from autoplan.plan.types import ParallelConfig


# torchtitan's RMSNorm (torchtitan/models/norms.py RMSNorm, the norm_type "rmsnorm" default of
# torchtitan/config_manager.py): `self._norm(x.float()).type_as(x) * self.weight` with `_norm(x) =
# x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`, each an eager kernel. (read, write) bytes per
# element, x in d bytes and the intermediates in fp32 (4); the casts are no-ops when d is 4:
# forward: x.float() (d, 4), pow (4, 4), mean (4, 0), * rstd (4, 4), type_as (4, d), * weight (d, d);
# backward (autograd's formulas, tools/autograd/derivatives.yaml): * weight's input gradient (d, d) and
# weight gradient (grad * output (2d, d), then its sum over the tokens (d, 0)), type_as's cast (d, 4),
# * rstd's input gradient (4, 4) and rstd gradient (grad * x (8, 4), sum (4, 0)), mean's expanded
# gradient / N (0, 4), pow's pow_backward grad * (2 * x.pow(1)) (x.pow(1) (4, 4), * 2 (4, 4), * grad
# (8, 4)), the sum of x's two gradients (8, 4), x.float()'s cast (4, d). A check, not a fit: torchtitan
# PR #181 (2024-03, "Add FusedRMSNorm (Triton kernel, +15% eager)") measured +15 % MFU on a 7B FSDP2 run
# going from this norm to its fused kernel; these counts put that change at +15 % on an 8-GPU H100 node
# (+10 % on A100) for the llama_7b.toml of the time (batch 8, sequence 2048, op-level checkpointing).


def fp32_rmsnorm_bytes(d: float) -> tuple[float, float]:
    """(forward, backward) bytes per element of one eager fp32 RMSNorm (the count above)."""
    casts = 0.0 if d == 4 else 1.0
    fwd = casts * (d + 4) + 8 + 4 + 8 + casts * (4 + d) + 2 * d
    bwd = 2 * d + 3 * d + d + casts * (d + 4) + 8 + 12 + 4 + 4 + 8 + 8 + 12 + 12 + casts * (4 + d)
    return fwd, bwd


@dataclass(frozen=True, slots=True, kw_only=True)
class PassBytes:
    """Bytes of the engine's extra passes in one block, one microbatch: forward, backward, and the part of
    the forward inside the attention core (what selective recompute re-runs)."""

    fwd: float = 0.0
    bwd: float = 0.0
    attention_fwd: float = 0.0
    # an eager fp32 RMSNorm's whole traffic, forward and backward (not in fwd / bwd): priced at the profile's
    # eager-norm rates (kernels.eager_norm_time_s)
    norm_fwd: float = 0.0
    norm_bwd: float = 0.0


def extra_pass_bytes(shape: BlockShape | None, tokens: float, tp: int, sp: bool, dtype_bytes: int, engine: Engine) -> PassBytes:
    """The bytes each switched-on mechanism moves (compute.BlockShape `shape`):

    - separate_qkv_bias_add (forward): `output + bias` read and written once, 2 T q / t d;
    - separate_fc2_bias_add (forward): the MLP output projection's `output_ + bias`, 2 T_h h m d;
    - bias_grad_reduction (backward): each biased linear's bias gradient reads its output gradient once
      (the [n] result is negligible): QKV T q / t, fc1 T f m / t, the attention and MLP output
      projections T_h h (1 + m), times d;
    - attention_layout_copies: forward, the context's permute(2, 0, 1, 3).contiguous(), 2 T h / t d (inside
      the attention core); backward, torch.split's backward (at::cat of the Q, K, V gradients into the
      QKV output's layout), 2 T q / t d;
    - attention_grad_scale (backward): baddbmm(alpha = 1 / norm_factor)'s derivative multiplies the dQ and
      dK products by alpha in passes of their own, 2 x 2 T h / t d;
    - attention_saves_repeated_kv with grouped-query attention (g < a kv heads): the forward copies K and
      V to the query heads (repeat_interleave; torchtitan's repeat_kv, expand + reshape), reading
      h g / a and writing h elements per token each, 2 T (h + h g / a) / t d; the backward sums the
      copies' gradients back (expand's backward), the same bytes;
    - separate_qkv_projections (backward): x feeds three linears (wq, wk, wv), so autograd sums their
      three input gradients (torch/csrc/autograd/input_buffer.cpp InputBuffer::add: one add per extra
      gradient), two adds of [T, h] each reading two and writing one: 2 x 3 T h d;
    - rmsnorm 'eager_fp32' (a Llama-style block, without fused_elementwise): both norms' kernels
      (fp32_rmsnorm_bytes) on 2 T_h h elements, whole, in norm_fwd / norm_bwd (elementwise.block_elementwise_bytes
      then counts no norm traffic of its own)."""
    if shape is None:
        return PassBytes()
    d, q_t, h_t = float(dtype_bytes), shape.qkv_out_width / tp, shape.h / tp
    t_h = tokens / tp if sp else tokens
    m = float(shape.dense_mlps)
    fwd = bwd = attention = norm_fwd = norm_bwd = 0.0
    if shape.biased and engine.separate_qkv_bias_add:
        fwd += 2.0 * tokens * q_t * d
    if shape.biased and engine.separate_fc2_bias_add:
        fwd += 2.0 * t_h * shape.h * m * d
    if shape.biased and engine.bias_grad_reduction:
        bwd += (tokens * (q_t + m * shape.f / tp) + t_h * shape.h * (1.0 + m)) * d
    if engine.attention_layout_copies:
        attention += 2.0 * tokens * h_t * d
        bwd += 2.0 * tokens * q_t * d
    if engine.attention_grad_scale:
        bwd += 4.0 * tokens * h_t * d
    if engine.attention_saves_repeated_kv and shape.g < shape.a:
        repeat = 2.0 * tokens * (shape.h + shape.h * shape.g / shape.a) / tp * d
        fwd, bwd = fwd + repeat, bwd + repeat
    if engine.separate_qkv_projections:
        bwd += 2.0 * 3.0 * tokens * shape.h * d
    if shape.n_mlp == 3 and not engine.fused_elementwise and engine.rmsnorm == "eager_fp32":
        norm_f, norm_b = fp32_rmsnorm_bytes(d)
        norm_fwd, norm_bwd = 2.0 * t_h * shape.h * norm_f, 2.0 * t_h * shape.h * norm_b
    return PassBytes(fwd=fwd + attention, bwd=bwd, attention_fwd=attention, norm_fwd=norm_fwd, norm_bwd=norm_bwd)


# Megatron's torch fallback for the fused scale-mask-softmax (megatron/model/fused_softmax.py,
# FusedScaleMaskSoftmax.forward_torch_softmax, Megatron-DeepSpeed c08e2cc2), softmax in fp32 (CoreAttention
# forces attention_softmax_in_fp32 under the default apply_query_key_layer_scaling): input.float(), input *
# scale, mask_func's masked_fill_ (in place; the s x s bool mask is shared by the batch), torch Softmax,
# probs.half(): bytes per score (d the training dtype's) 2 d + 28 against the fused kernel's read + write
# 2 d; backward (the autograd of each: to d, softmax backward reading gradient and output, masked_fill,
# mul, to fp32) 2 d + 36 against the fused backward's 3 d (read gradient and output, write). Host: five
# ops (and a module call) for the fused kernel's one, four more in the backward.
SOFTMAX_FALLBACK_FWD_BYTES = 28.0
SOFTMAX_FALLBACK_BWD_BYTES = 36.0
SOFTMAX_FALLBACK_FWD_OPS = 5
SOFTMAX_FALLBACK_BWD_OPS = 4


def fused_softmax_available(batch_heads: float, s_q: float, s_k: float, max_keys: int) -> bool:
    """Megatron's FusedScaleMaskSoftmax.is_kernel_available (fused_softmax.py, causal mask): 16 < s_k <=
    max_keys (the engine's fused_softmax_max_keys), s_q and s_k multiples of 4, b * np (`batch_heads`, the
    microbatch times the heads on this tp rank) a multiple of 4 and of get_batch_per_block's batches per
    128-thread block: (128 / warp) x (2 if next_pow2(s_k) <= 128 else 1), warp = min(next_pow2(s_k), 32)."""
    if max_keys <= 0:
        return True  # the engine's softmax has no such constraints
    if not (16 < s_k <= max_keys and s_q % 4 == 0 and s_k % 4 == 0 and batch_heads % 4 == 0):
        return False
    pow2 = 1 << max(int(s_k) - 1, 0).bit_length()
    per_block = (128 // min(pow2, 32)) * (2 if pow2 <= 128 else 1)
    return batch_heads % per_block == 0


def softmax_fallback_bytes(shape: BlockShape | None, batch_heads: float, s_q: float, s_k: float,
                           dtype_bytes: int, engine: Engine) -> PassBytes:
    """Extra traffic of Megatron's torch softmax fallback over its fused kernel when the engine materialises
    the scores (attention 'unfused') and fused_softmax_available says no: batch_heads x s_q x s_k scores,
    SOFTMAX_FALLBACK_FWD_BYTES forward (inside the attention core), SOFTMAX_FALLBACK_BWD_BYTES - d backward."""
    if (shape is None or engine.attention != "unfused"
            or fused_softmax_available(batch_heads, s_q, s_k, engine.fused_softmax_max_keys)):
        return PassBytes()
    scores = batch_heads * s_q * s_k
    fwd = scores * SOFTMAX_FALLBACK_FWD_BYTES
    return PassBytes(fwd=fwd, bwd=scores * (SOFTMAX_FALLBACK_BWD_BYTES - dtype_bytes), attention_fwd=fwd)


def score_bias_bytes(batch_heads: float, s_q: float, s_k: float, dtype_bytes: int, engine: Engine) -> float:
    """Forward bytes Engine.score_bias_input adds inside the attention core: BLOOM's ALiBi enters as the input
    of the score GEMM (bigscience-workshop/Megatron-DeepSpeed megatron/model/transformer.py
    ParallelAttention.forward: `matmul_result = alibi[:b * np, :, :sk]`, a [b np, 1, sk] bias, then
    torch.baddbmm(matmul_result, Q, K^T, beta=beta, alpha=1 / norm_factor) with beta 1 or 1 / layer_number,
    where the plain path passes torch.empty and beta=0.0). PyTorch's CUDA baddbmm (aten/src/ATen/native/cuda/
    Blas.cpp baddbmm_out_cuda, 1.x: expand_size(self, {b np, sq, sk}) into baddbmm_out_cuda_impl) copies the
    expanded bias into the result before cuBLAS's bgemm, which reads it back as C because beta != 0: a write
    and a read of the batch_heads x s_q x s_k scores in the training dtype. The bias needs no gradient (built
    once, no requires_grad), so the backward is unchanged."""
    if not engine.score_bias_input:
        return 0.0
    return 2.0 * batch_heads * s_q * s_k * dtype_bytes


def block_pass_bytes(shape: BlockShape | None, tokens: float, config: ParallelConfig, seq_len: int,
                     dtype_bytes: int, engine: Engine, scores_materialised: bool) -> tuple[PassBytes, bool]:
    """All of a block's engine passes (extra_pass_bytes, plus softmax_fallback_bytes and score_bias_bytes when
    its scores are materialised: config.microbatch x heads / tp score matrices of seq_len / cp x seq_len),
    and whether the softmax fell back to torch."""
    extra = extra_pass_bytes(shape, tokens, config.tp, config.sp, dtype_bytes, engine)
    if shape is None or not scores_materialised:
        return extra, False
    batch_heads, s_q = config.microbatch * shape.a / config.tp, seq_len / config.cp
    fallback = softmax_fallback_bytes(shape, batch_heads, s_q, seq_len, dtype_bytes, engine)
    bias = score_bias_bytes(batch_heads, s_q, seq_len, dtype_bytes, engine)
    return dataclasses.replace(extra, fwd=extra.fwd + fallback.fwd + bias, bwd=extra.bwd + fallback.bwd,
                               attention_fwd=extra.attention_fwd + fallback.attention_fwd + bias), fallback.fwd > 0

