"""autoplan.graph.capture on plain user modules: an MLP stack, a small ViT, an untraceable model, bad sizes.

Expected values are computed by hand from the module shapes (2 m n k per matmul)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoplan.graph import CaptureError, LayerRole, capture

# --- an MLP stack ----------------------------------------------------------------------------------------

WIDTHS = (32, 64, 64, 64, 10)


def mlp_stack() -> nn.Sequential:
    mods: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(WIDTHS)):
        mods.append(nn.Linear(a, b))
        if i < len(WIDTHS) - 2:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


@functools.cache
def mlp_graph():
    return capture(mlp_stack(), seq_len=8, microbatch=3, dtype=torch.float32)


def test_mlp_stack_layers_params_and_matmul_flops() -> None:
    g = mlp_graph()
    tokens = 3 * 8
    pairs = list(itertools.pairwise(WIDTHS))
    assert [layer.name for layer in g.layers] == ["0", "2", "4", "6"]  # each ReLU folds into its Linear
    assert g.layers[0].module_paths == ("0", "1")
    assert all(layer.role is LayerRole.BLOCK for layer in g.layers)
    for layer, (a, b) in zip(g.layers, pairs):
        assert layer.num_params == a * b + b
        assert layer.param_bytes == 4 * (a * b + b)
        assert layer.fwd_matmul_flops == 2 * tokens * a * b
        assert layer.fwd_attention_flops == 0
    # bias add (one per output) plus ReLU (one per output) on the hidden layers
    assert g.layers[0].fwd_elementwise_flops == 2 * tokens * 64
    assert g.layers[-1].fwd_elementwise_flops == tokens * 10
    assert g.layers[1].kind == g.layers[2].kind != g.layers[0].kind  # the two 64 -> 64 blocks
    assert g.num_params == sum(p.numel() for p in mlp_stack().parameters())
    assert g.layers[0].input_bytes == tokens * 32 * 4 and g.layers[-1].output_bytes == tokens * 10 * 4


def test_mlp_activation_bytes_are_what_autograd_saves() -> None:
    # Linear saves its input, ReLU its output (which is also the next Linear's input, same storage).
    g = mlp_graph()
    tokens = 3 * 8
    assert g.layers[0].activation_bytes == 4 * tokens * (32 + 64)
    assert g.layers[-1].activation_bytes == 4 * tokens * 64


# --- a small ViT with explicit attention ------------------------------------------------------------------

D, HEADS, PATCH, SIDE, CLASSES, DEPTH, MB = 32, 4, 4, 4, 10, 3, 2
N = SIDE * SIDE  # patches; the sequence is N + 1 with the class token


class ViTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        attn = torch.softmax((q @ k.transpose(-2, -1)) * (D // HEADS) ** -0.5, dim=-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, s, D))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, D, kernel_size=PATCH, stride=PATCH)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D))
        self.pos_embed = nn.Parameter(torch.zeros(1, N + 1, D))
        self.blocks = nn.ModuleList(ViTBlock() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


@functools.cache
def vit_graph():
    return capture(ViT(), seq_len=N, microbatch=MB, dtype=torch.bfloat16)


def test_vit_layers_and_parameter_counts() -> None:
    g = vit_graph()
    assert [layer.name for layer in g.layers] == ["patch_embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert [layer.role for layer in g.layers] == [LayerRole.EMBEDDING] + [LayerRole.BLOCK] * DEPTH + [
        LayerRole.HEAD
    ]
    assert g.layers[-1].module_paths == ("norm", "head")
    embed_params = 3 * PATCH * PATCH * D + D + D + (N + 1) * D  # conv, its bias, class token, positions
    block_params = 2 * 2 * D + (D * 3 * D + 3 * D) + (D * D + D) + (D * 4 * D + 4 * D) + (4 * D * D + D)
    assert g.layers[0].num_params == embed_params
    assert all(layer.num_params == block_params for layer in g.blocks)
    assert g.layers[-1].num_params == 2 * D + D * CLASSES + CLASSES
    assert g.num_params == sum(p.numel() for p in ViT().parameters())
    assert g.layers[1].param_bytes == 2 * block_params
    assert len({layer.kind for layer in g.blocks}) == 1


def test_vit_flops_by_hand() -> None:
    g = vit_graph()
    s = N + 1
    assert g.layers[0].fwd_matmul_flops == 2 * MB * N * D * (3 * PATCH * PATCH)
    for block in g.blocks:
        assert block.fwd_matmul_flops == 2 * MB * s * (D * 3 * D + D * D + 2 * D * 4 * D)
        # Q K^T and attn x V: 2 b a s s d each
        assert block.fwd_attention_flops == 2 * 2 * MB * HEADS * s * s * (D // HEADS)
        assert (block.hidden_size, block.num_heads, block.num_kv_heads, block.ffn_hidden_size) == (
            D,
            HEADS,
            HEADS,
            4 * D,
        )
    assert g.layers[-1].fwd_matmul_flops == 2 * MB * D * CLASSES  # the head sees the class token only


def test_vit_explicit_attention_scores_are_the_selective_recompute_part() -> None:
    # softmax saves its output [b, a, s, s] (bf16), which the scores x V matmul also saves: counted once
    s = N + 1
    for block in vit_graph().blocks:
        assert block.attention_activation_bytes == MB * HEADS * s * s * 2
        assert block.activation_bytes > block.attention_activation_bytes


def test_vit_bidirectional_attention_is_not_causal() -> None:
    assert not any(layer.causal_attention for layer in vit_graph().layers)


# --- errors -----------------------------------------------------------------------------------------------


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return x


def test_untraceable_model_gives_one_line_naming_module_and_op() -> None:
    model = nn.Sequential(nn.Linear(8, 8), Branchy(), nn.Linear(8, 8))
    with pytest.raises(CaptureError) as info:
        capture(model, seq_len=4)
    message = str(info.value)
    assert "\n" not in message
    assert "module '1' (Branchy)" in message
    assert "if x.sum() > 0:" in message
    assert "torch.where" in message
    assert isinstance(info.value, ValueError)


def test_an_input_too_small_for_a_batchnorm_says_to_raise_seq_len() -> None:
    # a stride-2 conv then BatchNorm: seq_len 1 traces one 2 x 2 image, one value per channel after the conv
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(CaptureError) as info:
        capture(model, seq_len=1)
    message = str(info.value)
    assert "\n" not in message and "module '1' (BatchNorm2d)" in message
    assert "pass a larger seq_len (--seq-len" in message
    assert capture(model, seq_len=4).layers  # 4 patches: 2 x 2 values per channel, traced


@pytest.mark.parametrize("field", ["seq_len", "microbatch"])
@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8", None])
def test_non_positive_or_non_integer_sizes_are_rejected(field: str, bad: object) -> None:
    sizes = {"seq_len": 4, "microbatch": 1, field: bad}
    with pytest.raises(ValueError, match=f"{field} must be a positive integer, got {bad!r}"):
        capture(mlp_stack(), **sizes)  # type: ignore[arg-type]


def test_model_without_recognisable_input_asks_for_example_inputs() -> None:
    with pytest.raises(ValueError, match="example_inputs"):
        capture(nn.Sequential(nn.ReLU(), nn.ReLU()), seq_len=4)


def test_example_inputs_override_the_inferred_input() -> None:
    g = capture(mlp_stack(), seq_len=8, microbatch=3, example_inputs=(torch.zeros(5, 32),))
    assert g.layers[0].fwd_matmul_flops == 2 * 5 * 32 * 64


def test_symbolic_trace_fallback_gives_the_same_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    exported = mlp_graph()
    real_export = torch.export.export

    def export_only_fx_graphs(model: nn.Module, *args: object, **kwargs: object):
        if not isinstance(model, torch.fx.GraphModule):
            raise RuntimeError("simulated torch.export failure")
        return real_export(model, *args, **kwargs)

    monkeypatch.setattr(torch.export, "export", export_only_fx_graphs)
    fallback = capture(mlp_stack(), seq_len=8, microbatch=3, dtype=torch.float32)
    assert (exported.capture_method, fallback.capture_method) == ("export", "symbolic_trace")
    assert fallback.layers == exported.layers
