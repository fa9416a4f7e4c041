"""Tests of autoplan.models against published parameter counts and independent reference computations."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import autoplan.models.moe as moe_module
from autoplan.models import (
    PRESETS,
    Experts,
    MoE,
    Transformer,
    TransformerConfig,
    loss_fn,
    preset,
    preset_config,
)
from autoplan.models.transformer import apply_rope, rope_cos_sin

TINY = ("tiny-gpt", "tiny-llama", "tiny-moe")


def meta_params(name: str) -> int:
    with torch.device("meta"):
        return preset(name).num_params()


# --- published sizes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("llama3-8b", 8.03e9),  # Llama 3 herd paper / released model card: 8.03 B parameters
        ("llama3-70b", 70.6e9),  # Llama 3 herd paper / released model card: 70.6 B parameters
        ("mixtral-8x7b", 46.7e9),  # Jiang et al. 2024: 47 B total parameters (46.7 B in the released weights)
    ],
)
def test_published_parameter_counts(name: str, published: float) -> None:
    assert abs(meta_params(name) / published - 1) < 0.01


def test_gpt3_175b_parameter_count_matches_narayanan_formula() -> None:
    # Narayanan et al. SC'21, section 5.1: P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)), tied embeddings.
    l, h, v, s = 96, 12288, 51200, 2048
    formula = 12 * l * h**2 * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))
    count = meta_params("gpt3-175b")
    assert abs(count / 175e9 - 1) < 0.02
    # exact: our head is untied (+ V h) and has a final LayerNorm (+ 2 h)
    assert count == round(formula) + v * h + 2 * h


def test_meta_build_of_405b_allocates_nothing() -> None:
    start = time.perf_counter()
    with torch.device("meta"):
        model = preset("llama3-405b")
    elapsed = time.perf_counter() - start
    assert all(p.is_meta for p in model.parameters())
    assert abs(model.num_params() / 405e9 - 1) < 0.01  # Llama 3 paper: 405 B
    assert elapsed < 5.0


def test_presets_match_published_shapes() -> None:
    ds = PRESETS["deepseek-v3"]
    assert (ds.num_layers, ds.hidden_size, ds.num_experts, ds.top_k, ds.num_dense_layers) == (
        61,
        7168,
        256,
        8,
        3,
    )
    big = PRESETS["gpt3-1t"]
    assert (big.num_layers, big.hidden_size, big.num_heads, big.ffn_hidden_size) == (
        128,
        25600,
        160,
        4 * 25600,
    )
    for name in TINY:
        c = PRESETS[name]
        for size in (
            c.num_heads,
            c.num_kv_heads,
            c.ffn_hidden_size,
            c.vocab_size,
            c.max_seq_len,
            c.expert_ffn_hidden_size,
            c.num_experts or 4,
        ):
            assert size % 4 == 0, (name, size)


# --- structure -----------------------------------------------------------------------------------------


def test_module_names_and_shapes() -> None:
    gpt, moe = preset("tiny-gpt"), preset("tiny-moe")
    c = moe.config
    assert gpt.embed.pos.weight.shape == (64, 64) and preset("tiny-llama").embed.pos is None
    assert list(gpt.layers) == ["0", "1", "2", "3"]
    assert isinstance(gpt.layers["0"].attn.wq.bias, nn.Parameter) and moe.layers["0"].attn.wq.bias is None
    assert isinstance(moe.layers["0"].mlp, moe_module.MLP) and isinstance(moe.layers["1"].mlp, MoE)
    experts = moe.layers["1"].mlp.experts
    e, f, h = c.num_experts, c.expert_ffn_hidden_size, c.hidden_size
    assert experts.w1.shape == (e, f, h) and experts.w2.shape == (e, h, f) and experts.w3.shape == (e, f, h)
    assert moe.layers["1"].mlp.shared.w1.weight.shape == (c.num_shared_experts * f, h)
    assert gpt.head.weight.data_ptr() != gpt.embed.tok.weight.data_ptr()


@pytest.mark.parametrize("name", TINY)
def test_output_shapes(name: str) -> None:
    model = preset(name)
    tokens = torch.randint(0, 128, (3, 10))
    assert model(tokens).shape == (3, 10, 128)
    model.embed, model.norm, model.head = None, None, None
    assert model(torch.randn(3, 10, 64)).shape == (3, 10, 64)


def test_pipeline_stages_compose_to_the_full_model() -> None:
    torch.manual_seed(0)
    full = preset("tiny-moe")
    first, second = copy.deepcopy(full), copy.deepcopy(full)
    first.norm, first.head = None, None
    del first.layers["2"], first.layers["3"]
    second.embed = None
    del second.layers["0"], second.layers["1"]
    tokens = torch.randint(0, 128, (2, 12))
    torch.testing.assert_close(second(first(tokens)), full(tokens))


def test_position_offset_shards_the_sequence() -> None:
    torch.manual_seed(0)
    gpt = preset("tiny-gpt")
    tokens = torch.randint(0, 128, (2, 16))
    gpt.embed.position_offset = 8
    torch.testing.assert_close(
        gpt.embed(tokens[:, 8:]), gpt.embed.tok(tokens[:, 8:]) + gpt.embed.pos.weight[8:16]
    )
    attn = preset("tiny-llama").layers["0"].attn
    seen: list[torch.Tensor] = []
    attn.core.forward = lambda q, k, v: (seen.append(q), v)[1]  # record the rotated queries
    x = torch.randn(2, 16, 64)
    attn(x)
    attn.position_offset = 8
    attn(x[:, 8:])
    torch.testing.assert_close(seen[1], seen[0][:, :, 8:])


# --- numerics --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_train(name: str) -> None:
    torch.manual_seed(0)
    model = preset(name)
    tokens = torch.randint(0, 128, (4, 16))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = loss_fn(model(tokens), tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - torch.log(torch.tensor(128.0)).item()) < 0.3  # near-uniform at init
    assert losses[-1] < losses[0] - 0.3


def dense_moe_reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token (einsum), then each token's top-k combined by softmax weights."""
    e = layer.experts
    logits = x @ layer.router.weight.t()
    top, idx = logits.topk(layer.top_k, dim=-1)
    weights = torch.zeros_like(logits).scatter(1, idx, torch.softmax(top, dim=-1))  # [T, E]
    if e.w3 is None:  # gpt family: GELU experts, biased shared MLP
        hidden = F.gelu(torch.einsum("th,efh->tef", x, e.w1))
    else:
        hidden = F.silu(torch.einsum("th,efh->tef", x, e.w1)) * torch.einsum("th,efh->tef", x, e.w3)
    per_expert = torch.einsum("tef,ehf->teh", hidden, e.w2)
    routed = torch.einsum("te,teh->th", weights, per_expert)
    shared = layer.shared
    if shared is None:
        return routed
    if e.w3 is None:
        return routed + shared.fc2(F.gelu(shared.fc1(x)))
    return routed + shared.w2(F.silu(shared.w1(x)) * shared.w3(x))


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("tiny-moe", {}),
        ("tiny-moe", {"num_shared_experts": 0, "top_k": 3}),
        ("tiny-gpt", {"num_experts": 4, "top_k": 2, "num_shared_experts": 2, "expert_ffn_hidden_size": 32}),
    ],
)
def test_moe_equals_dense_reference(name: str, overrides: dict) -> None:
    torch.manual_seed(0)
    model = preset(name, **overrides)
    layer = model.layers[str(model.config.num_dense_layers)].mlp
    x = torch.randn(24, 64)
    torch.testing.assert_close(layer(x), dense_moe_reference(layer, x))


def test_moe_gradients_flow_to_every_routed_expert() -> None:
    torch.manual_seed(0)
    layer = preset("tiny-moe").layers["2"].mlp
    layer(torch.randn(64, 64)).sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0
    assert (layer.experts.w1.grad.flatten(1).abs().sum(1) > 0).all()


@pytest.mark.parametrize(("num_tokens", "counts"), [(8, [4, 4, 4, 4]), (5, [3, 3, 2, 2])])
def test_balanced_path_equals_real_path_when_routing_is_balanced(
    num_tokens: int, counts: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    experts: Experts = preset("tiny-moe").layers["1"].mlp.experts
    copies = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    topk_idx = copies[torch.randperm(len(copies))].view(num_tokens, 2)
    x, weight = torch.randn(num_tokens, 64), torch.rand(num_tokens, 2)
    real = experts(x, topk_idx, weight)
    monkeypatch.setattr(moe_module, "_is_tracing", lambda _x: True)
    torch.testing.assert_close(experts(x, topk_idx, weight), real)


@pytest.mark.parametrize("num_tokens", [32, 30])
def test_static_path_applies_exactly_t_times_k_expert_ffns(num_tokens: int) -> None:
    config = preset_config("tiny-moe")
    with torch.device("meta"):
        experts = Experts(config)
        x = torch.randn(num_tokens, 64)
        idx, weight = torch.zeros(num_tokens, 2, dtype=torch.long), torch.rand(num_tokens, 2)
        with FlopCounterMode(display=False) as counter:
            out = experts(x, idx, weight)
    assert out.shape == (num_tokens, 64)
    h, f, k = config.hidden_size, config.expert_ffn_hidden_size, config.top_k
    assert counter.get_total_flops() == num_tokens * k * 3 * 2 * h * f  # w1, w3, w2 matmuls


def test_export_on_meta_device() -> None:
    with torch.device("meta"):
        model = preset("tiny-moe")
        program = torch.export.export(model, (torch.zeros(2, 16, dtype=torch.long),))
    out = next(n for n in program.graph.nodes if n.op == "output").args[0][0]
    assert tuple(out.meta["val"].shape) == (2, 16, 128)


def test_gqa_equals_mha_with_repeated_kv_weights() -> None:
    torch.manual_seed(0)
    gqa = preset("tiny-llama").layers["0"].attn
    config = preset_config("tiny-llama")
    mha = (
        Transformer(
            TransformerConfig(
                family="llama",
                num_layers=1,
                hidden_size=64,
                num_heads=8,
                num_kv_heads=8,
                vocab_size=128,
                max_seq_len=64,
                ffn_hidden_size=128,
            )
        )
        .layers["0"]
        .attn
    )
    group, d = config.num_heads // config.num_kv_heads, config.head_dim
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for name in ("wk", "wv"):
            w = getattr(gqa, name).weight.view(config.num_kv_heads, d, 64)
            getattr(mha, name).weight.copy_(w.repeat_interleave(group, dim=0).reshape(-1, 64))
    x = torch.randn(2, 12, 64)
    torch.testing.assert_close(gqa(x), mha(x))


def test_rope_matches_complex_rotation_and_is_relative() -> None:
    d, theta = 16, 10000.0
    x = torch.randn(1, 20, 1, d, dtype=torch.float64)
    positions = torch.arange(20)
    cos, sin = rope_cos_sin(positions, d, theta)
    rotated = apply_rope(x, cos.double(), sin.double())
    # independent reference: pair (i, i + d/2) as a complex number rotated by pos * theta^(-2i/d)
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = (
        torch.complex(x[..., : d // 2], x[..., d // 2 :])
        * torch.polar(torch.ones(20, d // 2, dtype=torch.float64), positions[:, None] * freqs)[
            None, :, None, :
        ]
    )
    torch.testing.assert_close(rotated, torch.cat([z.real, z.imag], dim=-1), rtol=1e-5, atol=1e-5)
    # scores <R(m) q, R(n) k> depend only on m - n
    q, k = torch.randn(d), torch.randn(d)

    def score(m: int, n: int) -> torch.Tensor:
        c, s = rope_cos_sin(torch.tensor([m, n]), d, theta)
        rq = apply_rope(q.view(1, 1, 1, d).expand(1, 2, 1, d), c, s)[0, 0, 0]
        rk = apply_rope(k.view(1, 1, 1, d).expand(1, 2, 1, d), c, s)[0, 1, 0]
        return rq @ rk

    torch.testing.assert_close(score(3, 1), score(40, 38), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(score(3, 1), score(3, 2), atol=1e-3)


# --- determinism and init --------------------------------------------------------------------------------


def test_same_seed_same_model() -> None:
    torch.manual_seed(7)
    a = preset("tiny-moe")
    torch.manual_seed(7)
    b = preset("tiny-moe")
    c = preset("tiny-moe")
    c.init_weights(seed=3)
    d = preset("tiny-moe")
    d.init_weights(seed=3)
    for (name, pa), pb, pc, pd in zip(a.named_parameters(), b.parameters(), c.parameters(), d.parameters()):
        assert torch.equal(pa, pb) and torch.equal(pc, pd), name
    assert not torch.equal(a.head.weight, c.head.weight)


def test_init_values() -> None:
    model = preset("tiny-gpt")
    model.init_weights(seed=0)
    block = model.layers["0"]
    assert torch.equal(block.attn_norm.weight, torch.ones(64)) and torch.equal(
        block.mlp.fc1.bias, torch.zeros(256)
    )
    assert abs(model.head.weight.std().item() - 0.02) < 0.002


# --- errors ----------------------------------------------------------------------------------------------

BASE = {
    "family": "llama",
    "num_layers": 2,
    "hidden_size": 64,
    "num_heads": 4,
    "vocab_size": 128,
    "max_seq_len": 64,
}


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"hidden_size": 0}, r"hidden_size=0: must be positive"),
        ({"num_layers": 2.5}, r"num_layers=2\.5: must be an integer"),
        ({"vocab_size": True}, r"vocab_size=True: must be an integer"),
        ({"num_heads": 5}, r"num_heads=5 does not divide hidden_size=64"),
        ({"num_kv_heads": 3}, r"num_kv_heads=3 does not divide num_heads=4"),
        ({"num_experts": 4, "top_k": 5}, r"top_k=5: must be between 1 and num_experts=4"),
        ({"family": "bert"}, r"family='bert'"),
        ({"num_experts": -1}, r"num_experts=-1: must be non-negative"),
    ],
)
def test_config_errors_name_the_field(overrides: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        TransformerConfig(**{**BASE, **overrides})


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown model preset 'llama4'.*llama3-70b.*tiny-moe"):
        preset("llama4")
    with pytest.raises(ValueError, match=r"unknown TransformerConfig field\(s\) \['layers'\]"):
        preset("tiny-gpt", layers=3)
    assert preset("tiny-gpt", num_layers=2).config.num_layers == 2
