"""Memory per device: activations per layer (Korthikanti et al. 2022), model states under mixed-precision
Adam and ZeRO (Rajbhandari et al. 2020), and the parameters each device holds after the tp / ep split.
"""

from __future__ import annotations

from autoplan.cost.compute import BlockShape
from autoplan.graph.types import Layer, LayerRole
from autoplan.plan.types import ParallelConfig, Recompute

# Mixed-precision Adam, bytes per parameter (Rajbhandari et al., ZeRO, SC'20, section 3.1): 16-bit
# weights (2) and gradients (2); fp32 master weights, momentum and variance (4 + 4 + 4 = 12). We keep
# 16-bit gradients (PyTorch DDP / FSDP with a 16-bit reduce dtype, Megatron's fp16 default); Megatron's
# fp32 gradient accumulation (--accumulate-allreduce-grads-in-fp32, default for bf16) would add 2 more.
WEIGHT_BYTES_PER_PARAM = 2
GRAD_BYTES_PER_PARAM = 2
OPTIMIZER_BYTES_PER_PARAM = 12


def block_activation_bytes(shape: BlockShape, b: float, s: int, config: ParallelConfig,
                           recompute: Recompute, dtype_bytes: int, scores_materialised: bool) -> tuple[float, float]:
    """(held per microbatch, working extra during its backward) for one transformer block, bytes.

    Korthikanti et al. 2022, section 4.1 / Table 2, 16-bit activations, s tokens (s / cp per CP rank),
    microbatch b, hidden h, heads a: per layer s b h (34 + 5 a s / h) with no parallelism;
    s b h (10 + 24/t + 5 a s / (h t)) with tp = t; s b h (34/t + 5 a s / (h t)) with SP. We sum the
    same tensors for general shapes: replicated without SP are the two norms' inputs (4h), the QKV and
    MLP inputs (2h + 2h) and two 1-byte dropout masks (2h) = 10h; split over t are Q, K, V
    (2h + 4hg/a), the projection input (2h), the MLP hidden (GELU 4f: 2 f in + 2 f out; SwiGLU 6f),
    for MoE top_k copies of the expert input and hidden; the attention scores 5 a s per token (softmax
    output 2, dropout mask 1, dropout output 2) only when the kernel materialises them
    (FlashAttention does not). MHA with f = 4h gives 10h + 24h/t, as in the paper.
    Selective recompute drops the 5 a s / h term; full keeps only the block input 2 s b h (/t with SP)
    and re-materialises one block's activations during its backward (the working extra)."""
    t, cp = config.tp, config.cp
    tokens = b * s / cp
    h_split = t if config.sp else 1
    replicated = 10.0 * shape.h  # bytes per token at 16 bits, as the paper counts them
    hidden = (4.0 if shape.n_mlp == 2 else 6.0) * shape.f * shape.dense_mlps
    split = 2.0 * shape.h + 4.0 * shape.h * shape.g / shape.a + 2.0 * shape.h + hidden
    if shape.num_experts and shape.top_k:
        e_hidden = (4.0 if shape.n_mlp == 2 else 6.0) * shape.f_e
        # folded (etp, eep): a rank holds its tokens / tp routed copies gathered etp-fold, each with
        # 1/etp of the expert hidden: (tokens / t) top_k (2 h etp + e_hidden)
        copies = 2.0 * shape.h * (config.expert_tp if config.folded else 1)
        split += shape.top_k * (copies + e_hidden)
    per_token = (replicated / h_split + split / t) * dtype_bytes / 2.0
    scores = 5.0 * shape.a * s / t * dtype_bytes / 2.0 if scores_materialised else 0.0
    full = tokens * (per_token + scores)
    if recompute is Recompute.NONE:
        return full, 0.0
    if recompute is Recompute.SELECTIVE:
        return tokens * per_token, tokens * scores
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


def layer_param_counts(layer: Layer, shape: BlockShape | None, config: ParallelConfig) -> tuple[int, int, int]:
    """(held, dense, expert) parameters on one device after the tp / ep split, before ZeRO.

    Megatron-style splits (Shoeybi et al. 2019): every weight matrix of a block is split over tp; the
    norms and the row-parallel output biases (6h for a GPT block: 2 LayerNorms with bias, 2 biases)
    are replicated. Routed expert weights are split over ep and, like Megatron-core's default expert
    tensor parallelism, over tp; folded, over eep and etp. Embedding and head are vocab-parallel (split over tp); other layers
    (a final norm) are replicated."""
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
    expert_held = -(-expert // (config.expert_ep * config.expert_tp)) if expert else 0
    return dense_held + expert_held, dense_held, expert_held


def model_state_bytes(dense_params: float, expert_params: float, config: ParallelConfig) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) bytes for the parameters a device holds.

    ZeRO stage z (Rajbhandari et al. 2020): z >= 1 divides the 12 optimizer bytes by the data-parallel
    degree, z >= 2 also the gradients, z = 3 also the weights. Dense parameters are replicated over
    dp * ep * cp ranks, expert parameters over config.expert_dp (dp * cp unfolded), and ZeRO shards each
    over its own group."""
    d_dense = config.dp * config.ep * config.cp
    d_expert = config.expert_dp

    def shard(stage: int) -> float:
        if config.zero >= stage:
            return dense_params / d_dense + expert_params / d_expert
        return dense_params + expert_params

    return (WEIGHT_BYTES_PER_PARAM * shard(3), GRAD_BYTES_PER_PARAM * shard(2),
            OPTIMIZER_BYTES_PER_PARAM * shard(1))
