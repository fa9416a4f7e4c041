"""Hugging Face LlamaForCausalLM / MixtralForCausalLM (built from a config on meta: no weights, no hub)
captured like the matching autoplan.models configuration: per-block FLOPs within 2 %, same parameters."""

from __future__ import annotations

import functools

import pytest
import torch

from autoplan.graph import LayerGraph, LayerRole, capture
from autoplan.models import preset, preset_config

transformers = pytest.importorskip("transformers")

SEQ = 128
LAYERS = 2


@functools.cache
def ours(name: str) -> LayerGraph:
    with torch.device("meta"):
        return capture(preset(name, num_layers=LAYERS), seq_len=SEQ)


@functools.cache
def hf(name: str) -> LayerGraph:
    c = preset_config(name)
    common = {
        "hidden_size": c.hidden_size,
        "intermediate_size": c.ffn_hidden_size,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": False,
    }
    if c.num_experts:
        config = transformers.MixtralConfig(
            **common, num_local_experts=c.num_experts, num_experts_per_tok=c.top_k
        )
        config.intermediate_size = c.expert_ffn_hidden_size
        cls = transformers.MixtralForCausalLM
    else:
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    with torch.device("meta"):
        return capture(cls(config), seq_len=SEQ)


@pytest.mark.parametrize("name", ["llama3-8b", "mixtral-8x7b"])
def test_hf_block_flops_match_the_autoplan_model_within_2_percent(name: str) -> None:
    theirs, mine = hf(name), ours(name)
    assert len(theirs.blocks) == len(mine.blocks) == LAYERS
    for a, b in zip(theirs.blocks, mine.blocks):
        assert a.fwd_flops == pytest.approx(b.fwd_flops, rel=0.02)
        assert a.fwd_matmul_flops == pytest.approx(b.fwd_matmul_flops, rel=0.02)
        assert a.fwd_attention_flops == pytest.approx(b.fwd_attention_flops, rel=0.02)
        assert a.num_params == b.num_params
        shape = (
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "ffn_hidden_size",
            "num_experts",
            "top_k",
            "expert_params",
            "fwd_expert_flops",
        )
        assert [getattr(a, f) for f in shape] == [getattr(b, f) for f in shape]
    assert theirs.num_params == mine.num_params


@pytest.mark.parametrize("name", ["llama3-8b", "mixtral-8x7b"])
def test_hf_layers_follow_the_module_tree(name: str) -> None:
    g = hf(name)
    assert [layer.name for layer in g.layers] == [
        "model.embed_tokens",
        *(f"model.layers.{i}" for i in range(LAYERS)),
        "lm_head",
    ]
    assert g.layers[0].role is LayerRole.EMBEDDING and g.layers[-1].role is LayerRole.HEAD
    assert g.layers[-1].module_paths == ("model.norm", "lm_head")
    assert "model.rotary_emb" in g.layers[0].module_paths  # parameterless: folded where it runs
    assert len({layer.kind for layer in g.blocks}) == 1
    assert g.layers[-1].fwd_matmul_flops == ours(name).layers[-1].fwd_matmul_flops


def test_mixtral_expert_flops_are_tokens_times_top_k_applications() -> None:
    # transformers 5 routes through grouped_mm over the T * k sorted token copies; count it analytically
    c = preset_config("mixtral-8x7b")
    for block in hf("mixtral-8x7b").blocks:
        assert block.is_moe and (block.num_experts, block.top_k) == (8, 2)
        assert block.fwd_expert_flops == 2 * SEQ * c.top_k * 3 * c.hidden_size * c.expert_ffn_hidden_size
        assert block.expert_params == 8 * 3 * c.hidden_size * c.expert_ffn_hidden_size


@pytest.mark.parametrize("name", ["llama3-8b", "mixtral-8x7b"])
def test_hf_lower_triangular_mask_is_recognised_as_causal(name: str) -> None:
    """transformers 5 under torch.export passes an explicit boolean mask built from arange comparisons."""
    g = hf(name)
    assert [layer.causal_attention for layer in g.layers] == [layer.role is LayerRole.BLOCK for layer in g.layers]
