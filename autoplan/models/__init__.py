"""The reference decoder-only transformer (GPT, Llama and MoE families) and its named presets.

with torch.device("meta"):
    model = autoplan.models.preset("llama3-405b")   # shapes only, no memory
"""

from __future__ import annotations

from autoplan.models.config import TransformerConfig
from autoplan.models.moe import MLP, Experts, MoE
from autoplan.models.presets import PRESETS, preset, preset_config
from autoplan.models.transformer import (
    Attention,
    AttentionCore,
    Block,
    TokenEmbedding,
    Transformer,
    loss_fn,
)

__all__ = [
    "MLP",
    "PRESETS",
    "Attention",
    "AttentionCore",
    "Block",
    "Experts",
    "MoE",
    "TokenEmbedding",
    "Transformer",
    "TransformerConfig",
    "loss_fn",
    "preset",
    "preset_config",
]
