"""The reference decoder-only Transformer: embed -> layers ("0".."L-1" Blocks) -> norm -> head.

Module names are part of the interface: they are the layer graph's module paths and the pipeline
cut points, and tensor/context/expert parallelism swap submodules by these names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.models.config import TransformerConfig
from autoplan.models.moe import MLP, Experts, MoE

INIT_STD = 0.02  # normal init of every weight matrix (GPT-2 / Megatron-LM default)


class TokenEmbedding(nn.Module):
    """Token embedding `tok` (V, h), plus learned positions `pos` (max_seq_len, h) for the gpt family."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos = nn.Embedding(config.max_seq_len, config.hidden_size) if config.family == "gpt" else None
        self.position_offset = 0  # global position of this rank's first token (context parallelism)
        self.positions: torch.Tensor | None = None  # or this rank's global positions, when not contiguous

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        if self.pos is not None:
            positions = self.positions
            if positions is None:
                positions = torch.arange(tokens.shape[-1], device=tokens.device) + self.position_offset
            x = x + self.pos(positions)
        return x


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, head_dim] for rotary embeddings (Su et al. 2021), half-split layout (as in HF Llama)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, heads, head_dim] by position: x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return x * cos + rotated * sin


class AttentionCore(nn.Module):
    """Causal softmax attention: q, k, v [B, heads, S, head_dim] -> [B, heads, S, head_dim].

    A separate module so context parallelism can replace it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Self-attention with projections `wq`, `wk`, `wv`, `wo` and the core `core`.

    Head counts are read from the projections' outputs (`.view(B, S, -1, head_dim)`), so tensor
    parallelism can shard heads; kv heads are repeated to the local q heads (grouped-query attention)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        bias = config.family == "gpt"
        self.head_dim = d
        self.use_rope = config.family == "llama"
        self.rope_theta = config.rope_theta
        self.position_offset = 0  # global position of this rank's first token (context parallelism)
        self.positions: torch.Tensor | None = None  # or this rank's global positions, when not contiguous
        self.wq = nn.Linear(h, config.num_heads * d, bias=bias)
        self.wk = nn.Linear(h, config.num_kv_heads * d, bias=bias)
        self.wv = nn.Linear(h, config.num_kv_heads * d, bias=bias)
        self.wo = nn.Linear(config.num_heads * d, h, bias=bias)
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.use_rope:
            positions = self.positions
            if positions is None:
                positions = torch.arange(s, device=x.device) + self.position_offset
            cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def make_norm(config: TransformerConfig) -> nn.Module:
    """LayerNorm (with bias) for gpt, RMSNorm for llama."""
    if config.family == "gpt":
        return nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
    return nn.RMSNorm(config.hidden_size, eps=config.norm_eps)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(attn_norm(x)), then + mlp(mlp_norm(x)); mlp is MLP or MoE."""

    def __init__(self, config: TransformerConfig, index: int) -> None:
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attn = Attention(config)
        self.mlp_norm = make_norm(config)
        self.mlp: nn.Module = (
            MoE(config) if config.is_moe_layer(index) else MLP(config, config.ffn_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Decoder-only transformer: `embed`, `layers` (ModuleDict "0".."L-1"), `norm`, `head` (untied).

    forward(tokens [B, S]) -> logits [B, S, V]. A pipeline stage sets any of embed / norm / head to
    None and deletes blocks from `layers`; it then takes and/or returns hidden states [B, S, h].
    Built on the current default device; weights are drawn from the global RNG, so
    `torch.manual_seed(s)` before building gives the same model (see `init_weights`)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed: TokenEmbedding | None = TokenEmbedding(config)
        self.layers = nn.ModuleDict({str(i): Block(config, i) for i in range(config.num_layers)})
        self.norm: nn.Module | None = make_norm(config)
        self.head: nn.Linear | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) if self.embed is not None else tokens
        for block in self.layers.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Weights ~ N(0, 0.02), biases 0, norm scales 1; meta tensors are left alone.

        seed None draws from the global RNG of each parameter's device; an int seed draws from a
        private CPU generator in `named_parameters()` order, so the values are the same on any device
        and leave the global RNG untouched."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        norms = (nn.LayerNorm, nn.RMSNorm)
        for module_name, module in self.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                if param.is_meta:
                    continue
                if isinstance(module, norms) and param_name == "weight":
                    param.fill_(1.0)
                elif param_name == "bias":
                    param.zero_()
                elif generator is None:
                    param.normal_(0.0, INIT_STD)
                else:
                    param.copy_(torch.empty(param.shape).normal_(0.0, INIT_STD, generator=generator))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: logits [B, S, V] predict tokens shifted by one."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


__all__ = [
    "MLP",
    "Attention",
    "AttentionCore",
    "Block",
    "Experts",
    "MoE",
    "TokenEmbedding",
    "Transformer",
    "apply_rope",
    "loss_fn",
    "rope_cos_sin",
]
