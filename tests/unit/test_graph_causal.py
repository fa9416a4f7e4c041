"""Layer.causal_attention from capture of user models (presets: test_graph_capture, HF: test_graph_hf): set for causal fused attention (is_causal=True, or a mask equal
to the lower triangle built from constants), not for bidirectional attention, other masks or masks
that come from an input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoplan.graph import capture

D, HEADS, SEQ = 32, 4, 16


class Block(nn.Module):
    """Pre-norm attention over [b, s, D] with SDPA; `mask` chooses what the attention sees."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.mask = mask
        self.norm = nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        i = torch.arange(s, device=x.device)
        if self.mask == "none":  # bidirectional, as a ViT
            out = F.scaled_dot_product_attention(q, k, v)
        elif self.mask == "is_causal":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.mask == "tril_bool":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=i[None, :] <= i[:, None])
        elif self.mask == "tril_float":
            bias = torch.zeros(s, s, device=x.device).masked_fill(i[None, :] > i[:, None], float("-inf"))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        elif self.mask == "window":  # causal, 4 keys back: not the lower triangle
            keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 4)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        else:  # a mask computed from the input
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=x[0, :, :1] > x[0, :1, :1].T)
        return x + self.proj(out.transpose(1, 2).reshape(b, s, D))


class Net(nn.Module):
    def __init__(self, mask: str) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block(mask) for _ in range(2))
        self.head = nn.Linear(D, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize(
    ("mask", "causal"),
    [
        ("none", False),
        ("is_causal", True),
        ("tril_bool", True),
        ("tril_float", True),
        ("window", False),
        ("from_input", False),
    ],
)
def test_user_model_attention_is_causal_only_for_the_lower_triangle(mask: str, causal: bool) -> None:
    g = capture(Net(mask), seq_len=SEQ, example_inputs=(torch.randn(2, SEQ, D),))
    assert len(g.blocks) == 2
    assert all(block.causal_attention is causal for block in g.blocks)
    assert all(block.fwd_attention_flops == 4.0 * 2 * SEQ * SEQ * D for block in g.blocks)  # FLOPs unchanged
