"""Time of one kernel on one device: GEMMs by shape (tiles in waves over the SMs), FlashAttention by
sequence length and head dimension, unfused attention as batched GEMMs, memory-bound passes.

Pure functions of a DeviceSpec and shapes. Efficiencies are the profile's named fields; the shape
dependence comes from how the kernels are scheduled, each with its source below.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

from autoplan.cluster.types import DeviceSpec

# cuBLAS output tiles (NVIDIA "Matrix Multiplication Background User's Guide", 2023, section 2.3 "Typical
# Tile Dimensions in cuBLAS and Performance": 256x128 and 128x256 are the most efficient, 64x64 the least;
# larger tiles reuse more data). Each tile's rate relative to 256x128 is its arithmetic intensity
# Mt Nt / (Mt + Nt) (FLOPs per operand byte loaded, same guide section 2.1) over that of 256x128.
GEMM_TILES = ((256, 128), (128, 128), (64, 64))
_BEST_INTENSITY = 256 * 128 / (256 + 128)

# FlashAttention-2 (Dao 2023, arXiv 2307.08691): thread blocks of 128 query rows, each looping over 128-key
# blocks (section 3.3: block sizes 64 or 128; 128 for d = 128 on A100), parallel over batch, heads and
# query blocks (section 3.2). Per score element the forward does 4 d matmul FLOPs (Q K^T, P V) and the
# backward 10 d (recomputed S, dV, dP, dQ, dK), against about 4 + 5 non-matmul FP32 operations (scale,
# max, exp, sum; recomputed exp, dS = P (dP - D), ...), which run on the FP32 units at a 16th of the
# tensor-core rate on A100 (section 3.1: 19.5 vs 312 TFLOP/s). The profile's attention_efficiency is the
# kernel's fraction of peak at d = 128 and long sequences; other d scale by this matmul / non-matmul split.
FA_BLOCK = 128
FA_MATMUL_FLOPS_PER_D = 14.0
FA_NONMATMUL_OPS = 9.0
FA_REFERENCE_HEAD_DIM = 128

# Attention dropout inside a fused kernel (Engine.attention_dropout > 0 on a block with dropout): the
# forward draws a Philox random number per score and masks P in registers, the backward regenerates the
# same mask from the saved seed and offset (no s x s mask in memory; FlashAttention-2 csrc/flash_attn/src/
# dropout.h, cuDNN's SDPA dropout node, TE fused_attn_f16_arbitrary_seqlen.cu). Its time, measured on the
# kernel TE runs on Hopper (cuDNN: TE 1.7 and 1.8 pytorch/attention.py DotProductAttention prefer it over
# FlashAttention on sm90, dropout or not): forward + backward of one DotProductAttention, bf16, sbhd,
# 4 x 1024 tokens, 16 heads, head dim 128, fused backend forced, median of 50, H200: 0.594 ms at p = 0.0,
# 0.614 ms at p = 0.1, x 1.034 (NVIDIA/TransformerEngine issue #3312, 2026-08, TE 2.15). FlashAttention-2
# (the sm80 kernel) measured x 1.047 in the same setting on GB200 (0.695 -> 0.728 ms, thd; TE PR #3313).
# No public A100 / H100 figure of either at 2024 versions was found; the cost does not depend on p (one
# random number per score whatever p is).
FUSED_DROPOUT_SLOWDOWN = 1.034


def memory_time_s(device: DeviceSpec, nbytes: Any) -> Any:
    """Memory-bound kernel: bytes / (HBM bandwidth * mem_bw_efficiency) (numbers or numpy arrays)."""
    rate = device.mem_bw_bytes_per_s * device.mem_bw_efficiency
    return (nbytes if not isinstance(nbytes, (int, float)) else max(nbytes, 0.0)) / rate


def eager_norm_time_s(device: DeviceSpec, nbytes: float, *, backward: bool) -> float:
    """An eager fp32-upcast RMSNorm's kernels (passes.fp32_rmsnorm_bytes), forward or backward: bytes / (HBM
    bandwidth x the profile's eager_norm_fwd_bw_efficiency or eager_norm_bwd_bw_efficiency, what that op
    sequence reaches as a whole: its broadcast multiplies, dtype casts and row reduction run below a
    streaming kernel's rate); memory_time_s where the profile gives none (0)."""
    eff = device.eager_norm_bwd_bw_efficiency if backward else device.eager_norm_fwd_bw_efficiency
    if eff <= 0:
        return memory_time_s(device, nbytes)
    return max(nbytes, 0.0) / (device.mem_bw_bytes_per_s * eff)


def _waves_utilisation(blocks: float, sms: int) -> float:
    """Fraction of SM time busy when `blocks` equal blocks run in waves of `sms` (wave quantization)."""
    waves = math.ceil(blocks / sms)
    return blocks / (waves * sms) if waves else 0.0


def _tiling(m: float, n: float, batch: float, sms: int) -> tuple[float, int]:
    """(rate, waves) of the best cuBLAS tile for an m x n output (`batch` of them) on `sms` SMs: rate is
    (tile rate relative to 256x128) x (useful output / output computed) x (busy share of the waves)."""
    best, best_waves = 0.0, 0
    for tm, tn in GEMM_TILES:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        useful = batch * m * n / (tiles * tm * tn)
        rate = (tm * tn / (tm + tn)) / _BEST_INTENSITY * useful * _waves_utilisation(tiles, sms)
        if rate > best:
            best, best_waves = rate, math.ceil(tiles / sms)
    return best, best_waves


def gemm_efficiency(device: DeviceSpec, m: float, n: float, k: float, *, batch: float = 1.0,
                    sms: int | None = None) -> float:
    """Fraction of peak a GEMM with an m x n output (`batch` of them in one batched call) reaches.

    On a GPU profile (num_sms > 0): matmul_efficiency (the large-GEMM rate) x the best over the cuBLAS
    tiles of (tile rate relative to 256x128) x (useful output / output computed), where the output is
    cut into Mt x Nt tiles (tile quantization) that run in waves of one tile per SM (wave quantization:
    a partial last wave leaves SMs idle). Both effects are sections 3.1-3.2 of NVIDIA's "Matrix
    Multiplication Background User's Guide" (A100: 108 SMs; H100: 132). `sms` overrides the SM count
    (the SMs left while an NCCL kernel occupies some). Without SMs (a CPU profile), the saturating
    curve of matmul_efficiency(device, 2 m n k batch) applies."""
    sms = device.num_sms if sms is None else sms
    if m <= 0 or n <= 0:
        return device.matmul_efficiency
    if device.num_sms <= 0 or sms <= 0:
        return matmul_efficiency(device, 2.0 * m * n * k * batch)
    return device.matmul_efficiency * _tiling(m, n, batch, sms)[0]


def gemm_fill_s(device: DeviceSpec, m: float, n: float, *, batch: float = 1.0) -> float:
    """Pipeline fill of one GEMM: gemm_tile_fill_s per wave of its output tiles (the tiling
    gemm_efficiency picks). CUTLASS 2.x's multistage mainloop (include/cutlass/gemm/threadblock/
    mma_multistage.h, operator(): "Prologue / Issue several complete stages", then
    cp_async_wait<kStages - 2> and __syncthreads before the first MMA) starts loading a tile's A and B
    only when the tile starts, so each tile waits one global-memory round trip with its tensor cores
    idle; one tile runs per SM at a time, so a GEMM pays it once per wave. Over k / k_block mainloop
    iterations it weighs most on small-k GEMMs (attention's Q K^T at k = head_dim)."""
    if device.num_sms <= 0 or device.gemm_tile_fill_s <= 0 or m <= 0 or n <= 0:
        return 0.0
    return device.gemm_tile_fill_s * _tiling(m, n, batch, device.num_sms)[1]


def matmul_efficiency(device: DeviceSpec, flops: float) -> float:
    """Fraction of peak one matmul of `flops` FLOPs reaches on a profile without SMs:
    matmul_efficiency * f / (f + f_half), a saturating curve through half the large-GEMM efficiency at
    f_half (profile field matmul_half_size_flops)."""
    if flops <= 0:
        return device.matmul_efficiency
    return device.matmul_efficiency * flops / (flops + device.matmul_half_size_flops)


@lru_cache(maxsize=1 << 16)  # a pure function of hashable numbers; the search asks for the same shapes again and again
def gemm_pass_s(device: DeviceSpec, peak_flops: float, m: float, k: float, n: float, count: float,
                dtype_bytes: int, *, out_bytes: float | None = None, batch: float = 1.0) -> float:
    """Roofline time of `count` GEMMs [m x k] @ [k x n] (each a batch of `batch`): max(FLOPs / (peak *
    gemm_efficiency) + gemm_fill_s, bytes / (HBM bw * mem_bw_efficiency)) (Williams et al., "Roofline", CACM 2009;
    NVIDIA "Matrix Multiplication Background User's Guide": arithmetic intensity 2 m n k / (bytes of A,
    B and C)). Bytes: read A (m k) and B (k n), write C (m n) in the training dtype, or `out_bytes` per C
    element when C is accumulated into (a weight gradient). A GEMM with few rows m (few tokens on this
    device) reads its whole weight for little work and turns memory-bound."""
    if m <= 0 or k <= 0 or n <= 0 or count <= 0:
        return 0.0
    flops = 2.0 * m * k * n * batch
    c_bytes = (dtype_bytes if out_bytes is None else out_bytes) * m * n * batch
    operand_bytes = (m * k + k * n) * dtype_bytes * batch
    rate = peak_flops * gemm_efficiency(device, m, n, k, batch=batch)
    compute_s = flops / rate + gemm_fill_s(device, m, n, batch=batch)
    if device.num_sms > 0 and not device.gemm_epilogue_overlap:
        # each tile's mainloop streams A and B, then its epilogue writes (or accumulates into) C; in a
        # non-persistent kernel one CTA per SM does both in turn, so the C traffic adds to the mainloop
        # (CUTLASS "Efficient GEMM in CUDA": mainloop, then epilogue, per threadblock tile). Measured on H100 as
        # on A100: at a fixed output, time = C write + k-linear mainloop (profiles' gemm_epilogue_overlap notes)
        return count * (max(compute_s, memory_time_s(device, operand_bytes)) + memory_time_s(device, c_bytes))
    return count * max(compute_s, memory_time_s(device, operand_bytes + c_bytes))


def flash_efficiency(device: DeviceSpec, *, batch_heads: float, s_q: float, s_k: float, head_dim: float,
                     causal: bool, nonmatmul_ratio: float) -> float:
    """Fraction of peak FlashAttention-2 reaches (forward + backward) for batch_heads x s_q queries
    against s_k keys of head_dim d (constants above):

    attention_efficiency x (waves of the batch_heads x ceil(s_q / 128) thread blocks over the SMs) x
    kv / (kv + 1), kv the 128-key blocks a query block visits (s_k / 128, half when causal): each block
    also loads its Q tile and writes its O tile, about one K/V block of traffic, amortised over the loop
    x (1 + r c / (14 d_ref)) / (1 + r c / (14 d)), the non-matmul share at head dim d relative to d_ref =
    128, with c = 9 non-matmul operations per score and r = `nonmatmul_ratio` (tensor-core peak over the
    FP32 peak of the device)."""
    eff = device.attention_efficiency
    if device.num_sms > 0:
        eff *= _waves_utilisation(batch_heads * math.ceil(max(s_q, 1.0) / FA_BLOCK), device.num_sms)
    kv = max(s_k / FA_BLOCK * (0.5 if causal else 1.0), 0.5)
    eff *= kv / (kv + 1.0)
    share = nonmatmul_ratio * FA_NONMATMUL_OPS / FA_MATMUL_FLOPS_PER_D
    d = max(head_dim, 1.0)
    return eff * (1.0 + share / FA_REFERENCE_HEAD_DIM) / (1.0 + share / d)


def unfused_attention_s(device: DeviceSpec, peak_flops: float, *, batch_heads: float, s_q: float, s_k: float,
                        head_dim: float, dtype_bytes: int) -> tuple[float, float]:
    """(forward, backward) of Megatron-LM's unfused attention core as its batched GEMMs
    (megatron/model/transformer.py CoreAttention): S = Q K^T ([s_q x d] @ [d x s_k], the scores written
    to memory), then O = P V ([s_q x s_k] @ [s_k x d], the probabilities read back), batch_heads of each
    in one strided-batched call; the whole square, masked or not. Backward: dP = dO V^T and dV = P^T dO,
    then dQ = dS K and dK = dS^T Q: two GEMMs per forward GEMM. The softmax and dropout passes over the
    scores are elementwise traffic (elementwise.block_elementwise_bytes)."""
    g = {"count": 1.0, "batch": batch_heads}
    qk = gemm_pass_s(device, peak_flops, s_q, head_dim, s_k, dtype_bytes=dtype_bytes, **g)
    pv = gemm_pass_s(device, peak_flops, s_q, s_k, head_dim, dtype_bytes=dtype_bytes, **g)
    dp = gemm_pass_s(device, peak_flops, s_q, head_dim, s_k, dtype_bytes=dtype_bytes, **g)  # dO V^T: scores out
    dv = gemm_pass_s(device, peak_flops, s_k, s_q, head_dim, dtype_bytes=dtype_bytes, **g)  # P^T dO
    dq = gemm_pass_s(device, peak_flops, s_q, s_k, head_dim, dtype_bytes=dtype_bytes, **g)  # dS K
    dk = gemm_pass_s(device, peak_flops, s_k, s_q, head_dim, dtype_bytes=dtype_bytes, **g)  # dS^T Q
    return qk + pv, dp + dv + dq + dk
