"""The reference decoder-only transformer (GPT, Llama and MoE families) and its named presets.

with torch.device("meta"):
    model = autoplan.models.preset("llama3-405b")   # shapes only, no memory

The names below are loaded on first use (PEP 562 module __getattr__): `autoplan.models.specs`, which tells a
preset name from a model file or directory without torch, can be imported without importing torch, so a
warm plan of a preset never imports it.
"""

from __future__ import annotations

from autoplan._lazy import lazy_names

_HOME = {
    "TransformerConfig": "config",
    "MLP": "moe", "Experts": "moe", "MoE": "moe",
    "PRESETS": "presets", "preset": "presets", "preset_config": "presets",
    "Attention": "transformer", "AttentionCore": "transformer", "Block": "transformer",
    "TokenEmbedding": "transformer", "Transformer": "transformer", "loss_fn": "transformer",
}

__all__ = ["MLP", "PRESETS", "Attention", "AttentionCore", "Block", "Experts", "MoE", "TokenEmbedding",
           "Transformer", "TransformerConfig", "loss_fn", "preset", "preset_config"]

__getattr__, __dir__ = lazy_names(__name__, _HOME, globals())
