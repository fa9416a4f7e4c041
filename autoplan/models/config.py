"""TransformerConfig: the shape of the reference decoder-only model (GPT, Llama and MoE families).

A frozen value: every size is a positive int after construction (defaults such as `num_kv_heads`,
`ffn_hidden_size` and `expert_ffn_hidden_size` are resolved in `__post_init__`).
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("gpt", "llama")


def _default_ffn(family: str, hidden_size: int) -> int:
    """GPT: 4h (Megatron-LM). Llama: 2/3 of 4h rounded up to a multiple of 256 (Llama reference code)."""
    if family == "gpt":
        return 4 * hidden_size
    return 256 * ((int(2 * 4 * hidden_size / 3) + 255) // 256)


@dataclass(frozen=True, slots=True, kw_only=True)
class TransformerConfig:
    """Shape of a decoder-only transformer.

    family "gpt": LayerNorm, GELU MLP, learned positions, biases (Megatron-LM GPT).
    family "llama": RMSNorm, SwiGLU MLP, RoPE, grouped-query attention, no biases.
    num_experts > 0 makes every layer after the first `num_dense_layers` a mixture of experts with
    `top_k` routed experts of width `expert_ffn_hidden_size` plus `num_shared_experts` always-on ones.
    """

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    max_seq_len: int
    num_kv_heads: int | None = None  # None: = num_heads (multi-head attention)
    ffn_hidden_size: int | None = None  # None: 4h for gpt, ~8h/3 (multiple of 256) for llama
    num_experts: int = 0  # routed experts per MoE layer; 0 = dense model
    top_k: int = 0  # routed experts per token (>= 1 when num_experts > 0)
    num_shared_experts: int = 0
    expert_ffn_hidden_size: int | None = None  # None: = ffn_hidden_size
    num_dense_layers: int = 0  # leading dense layers of a MoE model
    name: str = "custom"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"TransformerConfig.family={self.family!r}: must be one of {FAMILIES}")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.ffn_hidden_size is None and _is_int(self.hidden_size):
            object.__setattr__(self, "ffn_hidden_size", _default_ffn(self.family, self.hidden_size))
        if self.expert_ffn_hidden_size is None:
            object.__setattr__(self, "expert_ffn_hidden_size", self.ffn_hidden_size)
        for field_name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "ffn_hidden_size",
            "vocab_size",
            "max_seq_len",
            "expert_ffn_hidden_size",
        ):
            _check_size(field_name, getattr(self, field_name), minimum=1)
        for field_name in ("num_experts", "top_k", "num_shared_experts", "num_dense_layers"):
            _check_size(field_name, getattr(self, field_name), minimum=0)
        self._check_attention()
        self._check_experts()
        if not self.norm_eps > 0:
            raise ValueError(f"TransformerConfig.norm_eps={self.norm_eps}: must be > 0")
        if not self.rope_theta > 0:
            raise ValueError(f"TransformerConfig.rope_theta={self.rope_theta}: must be > 0")

    def _check_attention(self) -> None:
        h, a, kv = self.hidden_size, self.num_heads, self.num_kv_heads
        if h % a:
            raise ValueError(
                f"TransformerConfig.num_heads={a} does not divide hidden_size={h}: "
                f"choose num_heads among the divisors of {h}"
            )
        if a % kv:
            raise ValueError(
                f"TransformerConfig.num_kv_heads={kv} does not divide num_heads={a}: "
                f"choose num_kv_heads among the divisors of {a}"
            )
        if self.family == "llama" and (h // a) % 2:
            raise ValueError(
                f"TransformerConfig: head_dim={h // a} (hidden_size={h} / num_heads={a}) "
                f"must be even for RoPE"
            )

    def _check_experts(self) -> None:
        e, k = self.num_experts, self.top_k
        if e == 0:
            if self.num_shared_experts or self.num_dense_layers:
                raise ValueError(
                    f"TransformerConfig: num_shared_experts={self.num_shared_experts} and "
                    f"num_dense_layers={self.num_dense_layers} need num_experts > 0"
                )
            return
        if not 1 <= k <= e:
            raise ValueError(f"TransformerConfig.top_k={k}: must be between 1 and num_experts={e}")
        if self.num_dense_layers > self.num_layers:
            raise ValueError(
                f"TransformerConfig.num_dense_layers={self.num_dense_layers} exceeds "
                f"num_layers={self.num_layers}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether block `index` (0-based) is a mixture-of-experts layer."""
        return self.is_moe and index >= self.num_dense_layers


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_size(field_name: str, value: object, *, minimum: int) -> None:
    if not _is_int(value):
        raise ValueError(f"TransformerConfig.{field_name}={value!r}: must be an integer")
    if value < minimum:  # type: ignore[operator]
        what = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"TransformerConfig.{field_name}={value}: must be {what}")
