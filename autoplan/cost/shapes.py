"""The transformer-block shape the cost model reads off a captured Layer: BlockShape (hidden, heads, kv heads,
FFN width, matmuls per MLP, experts) and block_shape, shared by cost/compute.py, memory.py and the search."""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.graph.types import Layer, LayerRole

__all__ = ["BlockShape", "block_shape"]


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
    def dropout(self) -> bool:
        """Whether the block trains with dropout (attention and hidden dropout masks): a GPT-style (GELU)
        block as Megatron's GPT runs it (--attention-dropout 0.1 --hidden-dropout 0.1 by default,
        megatron/arguments.py; Korthikanti et al. 2022 count the masks); a Llama-style (SwiGLU) block
        trains without (Touvron et al. 2023; Dubey et al. 2024; Hugging Face LlamaConfig attention_dropout
        0.0), as this model's other Llama-isms (RMSNorm, RoPE) are keyed on the SwiGLU MLP."""
        return self.n_mlp == 2

    @property
    def biased(self) -> bool:
        """Whether the block's linears carry biases: a GPT-style (GELU) block as Megatron's GPT builds it
        (megatron/mpu/layers.py ColumnParallelLinear / RowParallelLinear bias=True; autoplan's gpt family,
        models/transformer.py); a Llama-style (SwiGLU) block has none (Touvron et al. 2023), keyed on the
        MLP as `dropout` is."""
        return self.n_mlp == 2

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
