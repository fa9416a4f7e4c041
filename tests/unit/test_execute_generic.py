"""The pieces the executor uses on models that are not presets, in one process: module roles found on the traced
graph, the seeded per-shard init, reading shards (and Mixtral's per-expert layout) from safetensors, the
fingerprint, the pipeline chain check, and the one-line refusals of what cannot be parallelised."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from autoplan.execute.runner import check_chain
from autoplan.execute.source import model_spec, params_on_meta, skeleton_of
from autoplan.execute.support import unsupported
from autoplan.execute.weights import (
    CHUNK_ELEMENTS,
    WeightFiles,
    init_shard,
    materialise,
    param_kind,
    save_weights,
)
from autoplan.graph.fingerprint import model_fingerprint
from autoplan.graph.roles import model_roles
from autoplan.plan.types import ParallelConfig

transformers = pytest.importorskip("transformers")
BLOCK_MODEL = str(Path(__file__).parents[1] / "fixtures" / "models" / "block_lm.py") + ":build"


def _tiny(cls: type, config: object) -> nn.Module:
    with torch.device("meta"):
        return cls(config)


def _llama(**extra) -> nn.Module:
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=128, **extra)
    return _tiny(transformers.LlamaForCausalLM, config)


def test_roles_of_hf_llama_by_dataflow() -> None:
    roles = model_roles(_llama())
    block = roles.block("model.layers.1")
    p = "model.layers.1."
    assert block.column == tuple(p + n for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                 "mlp.gate_proj", "mlp.up_proj"))
    assert block.row == (p + "self_attn.o_proj", p + "mlp.down_proj")
    assert (block.attention, block.mlp, block.norms) == (p + "self_attn", p + "mlp",
                                                         (p + "input_layernorm", p + "post_attention_layernorm"))
    assert (block.num_heads, block.num_kv_heads, block.head_dim, block.ffn_hidden_size) == (8, 4, 8, 128)
    assert (roles.embedding, roles.head, roles.final_norm, roles.tied) == ("model.embed_tokens", "lm_head",
                                                                            "model.norm", False)
    assert [u.name for u in roles.layers] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]


def test_roles_of_mixtral_experts_and_gpt2_fused_qkv() -> None:
    mixtral = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=4, vocab_size=128,
                                         num_local_experts=4, num_experts_per_tok=2)
    block = model_roles(_tiny(transformers.MixtralForCausalLM, mixtral)).block("model.layers.0")
    assert (block.experts, block.mlp, block.num_experts) == ("model.layers.0.mlp.experts", "model.layers.0.mlp", 4)
    assert block.row == ("model.layers.0.self_attn.o_proj",)  # router and experts are not tensor parallel
    gpt2 = _tiny(transformers.GPT2LMHeadModel, transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128))
    roles = model_roles(gpt2)  # 1024 learned positions, 128 tokens: the token embedding is the one fed the ids
    assert (roles.embedding, roles.vocab_size, roles.tied) == ("transformer.wte", 128, True)
    assert "transformer.h.0.attn.c_attn: one projection computes q, k and v" in \
        roles.block("transformer.h.0").unsupported[0]


def test_seeded_shards_are_the_rows_and_columns_of_the_full_init() -> None:
    shape = (3 * (CHUNK_ELEMENTS // 512) + 5, 512)  # more than three generator chunks of rows
    full = init_shard("w", shape, (0, 0), shape, kind="normal", seed=7, std=0.02)
    assert full.shape == shape and abs(float(full.std()) - 0.02) < 1e-3
    box = init_shard("w", shape, (2040, 100), (100, 300), kind="normal", seed=7, std=0.02)  # crosses a chunk edge
    torch.testing.assert_close(box, full[2040:2140, 100:400], rtol=0, atol=0)
    other = init_shard("v", shape, (0, 0), (4, 4), kind="normal", seed=7, std=0.02)
    assert not torch.equal(other, full[:4, :4])  # another name, other values
    assert param_kind(nn.LayerNorm(4), "weight", (4,)) == "ones" and param_kind(nn.LayerNorm(4), "bias", (4,)) == "zeros"


def test_weights_read_back_and_mixtral_per_expert_checkpoints_stack(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    save_weights(model, tmp_path / "w.safetensors")
    files = WeightFiles(tmp_path / "w.safetensors")
    files.check(model)
    torch.testing.assert_close(files.read("0.weight", (2, 1), (3, 2), (6, 4)), model[0].weight.detach()[2:5, 1:3])
    gate, up, down = (torch.randn(2, 3, 5) for _ in range(3))
    save_file({f"m.block_sparse_moe.experts.{e}.{n}.weight": t[e].contiguous() for e in range(2)
               for n, t in (("w1", gate), ("w3", up), ("w2", down))}, str(tmp_path / "moe.safetensors"))
    moe = WeightFiles(tmp_path / "moe.safetensors")
    stacked = moe.read("m.mlp.experts.gate_up_proj", (1, 0, 0), (1, 6, 5), (2, 6, 5))
    torch.testing.assert_close(stacked, torch.cat([gate, up], dim=1)[1:2])
    torch.testing.assert_close(moe.read("m.mlp.experts.down_proj", (0, 0, 0), (2, 3, 5), (2, 3, 5)), down)
    with pytest.raises(ValueError, match="hold no tensor 2.weight"):
        files.check(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2), nn.Linear(2, 2)))


def test_meta_skeleton_materialises_the_model_it_came_from(tmp_path: Path) -> None:
    torch.manual_seed(0)
    real = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64))
    save_weights(real, tmp_path / "w.safetensors")
    skeleton = skeleton_of(real)
    assert all(p.is_meta for p in skeleton.parameters()) and not any(b.is_meta for b in skeleton.buffers())
    materialise(skeleton, device=torch.device("cpu"), seed=0, std=0.02, weights=WeightFiles(tmp_path / "w.safetensors"))
    ids = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(skeleton(input_ids=ids).logits, real(input_ids=ids).logits)
    with params_on_meta():
        again = nn.Linear(3, 3)
    assert again.weight.is_meta


def test_fingerprint_is_the_structure_not_the_values_or_the_device() -> None:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    with torch.device("meta"):
        b = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)).to(torch.bfloat16)
    assert model_fingerprint(a) == model_fingerprint(b)
    assert model_fingerprint(a) != model_fingerprint(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)))


class _SkipToHead(nn.Module):
    """The head reads the embedding output as well as the last block's: not a chain of its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x0 = x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x + x0)


def test_pipeline_chain_check() -> None:
    spec, meta = model_spec(BLOCK_MODEL)
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    assert check_chain(meta, spec.roles, ids) is None
    skip = _SkipToHead()
    reason = check_chain(skip, model_roles(skip), ids)
    assert reason == "head is not applied to the output of blocks.1 alone"


@pytest.mark.parametrize("model, config, message", [
    ("gpt2", ParallelConfig(tp=2), "tp=2: transformer.h.0.attn.c_attn: one projection computes q, k and v"),
    ("gpt2", ParallelConfig(pp=2), "pp=2: lm_head.weight is tied to transformer.wte.weight"),
    ("block", ParallelConfig(cp=2), "cp=2: context parallelism needs the model's attention and positions"),
    ("llama-window", ParallelConfig(dp=2), "sliding-window attention (window 8)"),
])
def test_what_cannot_be_parallelised_is_named_with_the_reason(model: str, config: ParallelConfig,
                                                              message: str) -> None:
    if model == "gpt2":
        source = _tiny(transformers.GPT2LMHeadModel, transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4,
                                                                             vocab_size=128))
    elif model == "block":
        source = BLOCK_MODEL
    else:
        source = _tiny(transformers.MistralForCausalLM, transformers.MistralConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
            vocab_size=128, sliding_window=8))
    spec, meta = model_spec(source)
    problem = unsupported(spec, meta, config, seq_len=16)
    assert problem is not None and message in problem and "\n" not in problem
    assert unsupported(spec, meta, ParallelConfig(dp=2), seq_len=8) is None
