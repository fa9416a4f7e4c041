"""autoplan.graph.capture on the reference presets, against analytic FLOP counts (Narayanan et al. SC'21),
Korthikanti et al.'s activation inventory, the module tree, FlopCounterMode and a full (no reuse) capture.

Captures are cached at module scope: each preset is traced once."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from autoplan.graph import LayerGraph, LayerRole, capture
from autoplan.models import PRESETS, Transformer, TransformerConfig, preset

SEQ = 256  # differs from every preset's head_dim and hidden size


@functools.cache
def graph_of(name: str, seq_len: int = SEQ, microbatch: int = 1) -> tuple[Transformer, LayerGraph]:
    with torch.device("meta"):
        model = preset(name)
    return model, capture(model, seq_len=seq_len, microbatch=microbatch)


def block_flops(c: TransformerConfig, index: int, tokens: int, seq: int, b: int) -> tuple[float, float]:
    """(matmul, attention) forward FLOPs of block `index` by hand: 2 m n k per projection."""
    h, d = c.hidden_size, c.hidden_size // c.num_heads
    attn_proj = 2 * tokens * (2 * h * c.num_heads * d + 2 * h * c.num_kv_heads * d)
    mats = 3 if c.family == "llama" else 2
    if c.num_experts and index >= c.num_dense_layers:
        ffn = 2 * tokens * h * c.num_experts  # router
        ffn += 2 * tokens * c.top_k * mats * h * c.expert_ffn_hidden_size
        ffn += 2 * tokens * mats * h * c.num_shared_experts * c.expert_ffn_hidden_size
    else:
        ffn = 2 * tokens * mats * h * c.ffn_hidden_size
    return attn_proj + ffn, 4.0 * b * seq * seq * c.num_heads * d


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_captures_with_exact_structure_params_and_flops(name: str) -> None:
    model, g = graph_of(name)
    c = PRESETS[name]
    assert [layer.name for layer in g.layers] == [
        "embed",
        *(f"layers.{i}" for i in range(c.num_layers)),
        "head",
    ]
    assert [layer.index for layer in g.layers] == list(range(c.num_layers + 2))
    assert g.layers[0].role is LayerRole.EMBEDDING and g.layers[-1].role is LayerRole.HEAD
    assert g.layers[-1].module_paths == ("norm", "head")
    for layer in g.layers:
        expected = sum(
            p.numel() for path in layer.module_paths for p in model.get_submodule(path).parameters()
        )
        assert layer.num_params == expected, layer.name
        assert layer.param_bytes == 2 * expected
    assert g.num_params == sum(p.numel() for p in model.parameters())
    assert g.vocab_size == c.vocab_size
    for i, block in enumerate(g.blocks):
        matmul, attention = block_flops(c, i, SEQ, SEQ, 1)
        assert block.fwd_matmul_flops == pytest.approx(matmul, rel=1e-12), block.name
        assert block.fwd_attention_flops == pytest.approx(attention, rel=1e-12)
        moe = bool(c.num_experts) and i >= c.num_dense_layers
        ffn = c.expert_ffn_hidden_size if moe else c.ffn_hidden_size
        assert (block.hidden_size, block.num_heads, block.num_kv_heads, block.ffn_hidden_size) == (
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            ffn,
        )
        assert (block.num_experts, block.top_k, block.num_shared_experts) == (
            (c.num_experts, c.top_k, c.num_shared_experts) if moe else (0, 0, 0)
        )
        if moe:
            mats = 3 if c.family == "llama" else 2
            assert block.expert_params == c.num_experts * mats * c.hidden_size * c.expert_ffn_hidden_size
            assert (
                block.fwd_expert_flops == 2 * SEQ * c.top_k * mats * c.hidden_size * c.expert_ffn_hidden_size
            )
        assert block.attention_activation_bytes == 0  # SDPA: flash-style, no s x s scores kept
    dense_kinds = {b.kind for i, b in enumerate(g.blocks) if not b.is_moe}
    moe_kinds = {b.kind for b in g.blocks if b.is_moe}
    assert len(dense_kinds) <= 1 and len(moe_kinds) <= 1


def test_gpt3_175b_training_flops_match_megatron_within_3_percent() -> None:
    # Narayanan et al. SC'21, appendix: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per iteration (fwd + bwd)
    b, s = 2, 2048
    _, g = graph_of("gpt3-175b", seq_len=s, microbatch=b)
    c = PRESETS["gpt3-175b"]
    l, h, v = c.num_layers, c.hidden_size, c.vocab_size
    megatron = 72 * b * s * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h))
    counted = 3 * g.fwd_flops  # backward = 2 x forward
    assert abs(counted / megatron - 1) < 0.03
    # the matmul + attention part is the formula's exact content
    assert 3 * sum(x.fwd_matmul_flops + x.fwd_attention_flops for x in g.layers) == pytest.approx(megatron)


def test_gpt_block_activations_match_korthikanti_inventory() -> None:
    # Korthikanti et al. 2022, section 4.1, without dropout and with flash-style attention (no 5 a s/h):
    # bf16 tensors of s b h elements: LN1 input, LN1 output (shared by q, k, v), q, k, v, attention output,
    # its [b, s, h] copy fed to the output projection, LN2 input, LN2 output = 9 x 2 bytes; GELU input and
    # output (4h each) = 2 x 8 bytes: 34 s b h. Plus fp32 LayerNorm mean/rstd (2 x 2 x 4 b s) and the
    # attention's fp32 log-sum-exp (4 b a s).
    b, s = 2, 2048
    _, g = graph_of("gpt3-175b", seq_len=s, microbatch=b)
    c = PRESETS["gpt3-175b"]
    h, a = c.hidden_size, c.num_heads
    for block in g.blocks:
        assert block.activation_bytes == 34 * s * b * h + 16 * b * s + 4 * b * a * s
        assert block.input_bytes == block.output_bytes == 2 * b * s * h


def test_llama3_70b_parameter_count_is_70_6_billion() -> None:
    _, g = graph_of("llama3-70b")
    assert abs(g.num_params / 70.6e9 - 1) < 0.01  # Llama 3 model card: 70.6 B


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-moe"])
def test_block_reuse_equals_a_full_capture(name: str) -> None:
    model, reused = graph_of(name)
    full = capture(model, seq_len=SEQ, reuse_blocks=False)
    assert reused.layers == full.layers
    assert reused.num_nodes == full.num_nodes


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama", "tiny-moe"])
def test_capture_in_place_equals_a_capture_of_a_copy(name: str) -> None:
    """copy_model=False (the path for presets built only to be captured) gives the very same graph; the
    model is left on meta in the capture dtype, tied weights still tied."""
    _, copied = graph_of(name)
    with torch.device("meta"):
        model = preset(name)
    in_place = capture(model, seq_len=SEQ, copy_model=False)
    assert in_place == copied
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert len(list(model.parameters())) == len(list(graph_of(name)[0].parameters()))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe"])
def test_matmul_and_attention_flops_agree_with_flop_counter_mode(name: str) -> None:
    model, g = graph_of(name)
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(ids)
    assert sum(x.fwd_matmul_flops + x.fwd_attention_flops for x in g.layers) == counter.get_total_flops()


def test_flops_and_activations_scale_linearly_with_microbatch() -> None:
    _, one = graph_of("tiny-llama")
    _, three = graph_of("tiny-llama", microbatch=3)
    for a, b in zip(one.layers, three.layers):
        assert b.fwd_matmul_flops == 3 * a.fwd_matmul_flops
        assert b.activation_bytes == pytest.approx(3 * a.activation_bytes, rel=1e-9)
        assert b.kind.split("/")[:2] == a.kind.split("/")[:2]


def test_real_weights_are_neither_moved_nor_changed() -> None:
    torch.manual_seed(0)
    model = preset("tiny-gpt")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = capture(model, seq_len=SEQ)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert g.layers == graph_of("tiny-gpt")[1].layers


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt", "tiny-moe"])
def test_preset_blocks_are_causal_and_nothing_else(name: str) -> None:
    """The reference model calls SDPA with is_causal=True (autoplan/models/transformer.py)."""
    _, g = graph_of(name)
    assert [layer.causal_attention for layer in g.layers] == [layer.role is LayerRole.BLOCK for layer in g.layers]
