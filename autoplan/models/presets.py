"""Named model shapes from the papers, and `preset(name)` to build one on the current default device.

`with torch.device("meta"): preset("llama3-405b")` allocates no parameter memory.
"""

from __future__ import annotations

from dataclasses import fields, replace

from autoplan.models.config import TransformerConfig
from autoplan.models.transformer import Transformer


def _gpt3(name: str, num_layers: int, hidden_size: int, num_heads: int) -> TransformerConfig:
    # Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
    # Megatron-LM", SC'21, Table 1: vocabulary 51,200, sequence length 2,048, MLP of 4h.
    return TransformerConfig(
        name=name,
        family="gpt",
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        vocab_size=51200,
        max_seq_len=2048,
    )


def _llama3(name: str, num_layers: int, hidden_size: int, num_heads: int, ffn: int) -> TransformerConfig:
    # Llama Team, "The Llama 3 Herd of Models", 2024, Table 3: 8 kv heads, vocabulary 128,256,
    # RoPE base 500,000; context 8,192 in pre-training (section 3.4). Norm eps from the released configs.
    return TransformerConfig(
        name=name,
        family="llama",
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=8,
        ffn_hidden_size=ffn,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
        norm_eps=1e-5,
    )


def _tiny(name: str, family: str, **moe: int) -> TransformerConfig:
    # For CPU tests with up to 8 ranks: every sharded size (heads, kv heads, ffn, experts, vocab,
    # sequence) divides by 2 and by 4, so tp / cp / ep up to 4 shard evenly.
    heads, kv = (4, 4) if family == "gpt" else (8, 4)
    return TransformerConfig(
        name=name,
        family=family,
        num_layers=4,
        hidden_size=64,
        num_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=256 if family == "gpt" else 128,
        vocab_size=128,
        max_seq_len=64,
        **moe,
    )


def _small(name: str) -> TransformerConfig:
    # For prediction checks on CPU (`autoplan validate`): enough matmul work per step (about 20 MFLOP
    # per token) that compute, not only per-op overhead, shows in the step time, and every sharded size
    # (8 heads, ffn 1024, vocab 512, sequence) divides by 2, 4 and 8.
    return TransformerConfig(name=name, family="gpt", num_layers=4, hidden_size=256, num_heads=8,
                             ffn_hidden_size=1024, vocab_size=512, max_seq_len=128)


_CONFIGS = (
    _gpt3("gpt3-1.7b", 24, 2304, 24),
    _gpt3("gpt3-18b", 40, 6144, 48),
    _gpt3("gpt3-175b", 96, 12288, 96),
    _gpt3("gpt3-530b", 105, 20480, 128),
    _gpt3("gpt3-1t", 128, 25600, 160),
    _llama3("llama3-8b", 32, 4096, 32, 14336),
    _llama3("llama3-70b", 80, 8192, 64, 28672),
    _llama3("llama3-405b", 126, 16384, 128, 53248),
    # Jiang et al., "Mixtral of Experts", 2024, Table 1: dim 4096, 32 layers, 32 heads, 8 kv heads,
    # hidden_dim 14336, 8 experts, top-2, vocab 32000, context 32768; rope_theta 1e6 (released config).
    TransformerConfig(
        name="mixtral-8x7b",
        family="llama",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        ffn_hidden_size=14336,
        vocab_size=32000,
        max_seq_len=32768,
        num_experts=8,
        top_k=2,
        expert_ffn_hidden_size=14336,
        rope_theta=1e6,
    ),
    # DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 4.2: 61 layers, hidden 7168, 128 heads,
    # first 3 layers dense (FFN 18432, released config), then 1 shared + 256 routed experts of width
    # 2048, 8 routed per token; vocab 129,280 (section 4.1); pre-training sequence 4,096.
    # Shaped only: Multi-head Latent Attention is NOT modelled (plain MHA with 128 kv heads of dim 56),
    # nor sigmoid gating or multi-token prediction.
    TransformerConfig(
        name="deepseek-v3",
        family="llama",
        num_layers=61,
        hidden_size=7168,
        num_heads=128,
        num_kv_heads=128,
        ffn_hidden_size=18432,
        vocab_size=129280,
        max_seq_len=4096,
        num_experts=256,
        top_k=8,
        num_shared_experts=1,
        expert_ffn_hidden_size=2048,
        num_dense_layers=3,
        norm_eps=1e-6,
    ),
    _tiny("tiny-gpt", "gpt"),
    _small("small-gpt"),
    _tiny("tiny-llama", "llama"),
    _tiny(
        "tiny-moe",
        "llama",
        num_experts=4,
        top_k=2,
        num_shared_experts=1,
        expert_ffn_hidden_size=64,
        num_dense_layers=1,
    ),
)

PRESETS: dict[str, TransformerConfig] = {config.name: config for config in _CONFIGS}


def preset_config(name: str, **overrides: object) -> TransformerConfig:
    """The config of preset `name`, with any fields replaced by `overrides` (validated again)."""
    config = PRESETS.get(name)
    if config is None:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    if not overrides:
        return config
    known = {f.name for f in fields(TransformerConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown TransformerConfig field(s) {unknown}; fields: {', '.join(sorted(known))}")
    return replace(config, **overrides)


def preset(name: str, **overrides: object) -> Transformer:
    """Build preset `name` (with `overrides` of config fields) on the current default device."""
    return Transformer(preset_config(name, **overrides))
