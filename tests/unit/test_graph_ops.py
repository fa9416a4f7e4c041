"""The per-op conventions of autoplan.graph.ops, on meta tensors, against 2 m n k computed by hand."""

from __future__ import annotations

import pytest
import torch

from autoplan.graph import ops
from autoplan.graph.activations import is_scores


def meta(*shape: int) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=torch.bfloat16)


def concrete(d: object) -> int:
    return int(d)  # type: ignore[call-overload]


def test_linear_addmm_bmm_conv_and_einsum_count_2mnk() -> None:
    x, w = meta(2, 5, 16), meta(32, 16)
    assert ops.matmul_flops("linear", (x, w, None), meta(2, 5, 32), concrete) == 2 * 10 * 16 * 32
    assert ops.matmul_flops("addmm", (meta(32), meta(10, 16), meta(16, 32)), meta(10, 32), concrete) == (
        2 * 10 * 16 * 32
    )
    assert (
        ops.matmul_flops("bmm", (meta(4, 7, 8), meta(4, 8, 9)), meta(4, 7, 9), concrete) == 2 * 4 * 7 * 8 * 9
    )
    conv_out = meta(2, 6, 4, 4)  # Conv2d(3, 6, kernel 3) on 6x6 images
    assert ops.matmul_flops("convolution", (meta(2, 3, 6, 6), meta(6, 3, 3, 3)), conv_out, concrete) == (
        2 * (2 * 6 * 4 * 4) * (3 * 3 * 3)
    )
    q, k = meta(2, 4, 7, 8), meta(2, 4, 9, 8)
    out = meta(2, 4, 7, 9)
    assert ops.matmul_flops("einsum", ("bhqd,bhkd->bhqk", [q, k]), out, concrete) == 2 * 2 * 4 * 7 * 9 * 8
    assert ops.matmul_flops("einsum", ("...qd,...kd->...qk", [q, k]), out, concrete) == 2 * 2 * 4 * 7 * 9 * 8


def test_fused_attention_counts_both_matmuls_in_full() -> None:
    q, k, v = meta(2, 4, 16, 8), meta(2, 4, 16, 8), meta(2, 4, 16, 8)
    assert ops.attention_flops((q, k, v), concrete) == 2 * (2 * 2 * 4 * 16 * 16 * 8)


@pytest.mark.parametrize(
    ("name", "per_element"),
    [("add", 1), ("mul", 1), ("softmax", 5), ("layer_norm", 5), ("gelu", 8), ("silu", 4)],
)
def test_elementwise_conventions(name: str, per_element: int) -> None:
    out = meta(3, 10)
    assert ops.elementwise_flops(name, (meta(3, 10),), out, concrete) == per_element * 30


def test_views_copies_and_reductions() -> None:
    x = meta(3, 10)
    assert ops.elementwise_flops("view", (x,), x, concrete) == 0
    assert ops.elementwise_flops("_to_copy", (x,), x, concrete) == 0
    assert ops.elementwise_flops("sum", (x,), meta(3), concrete) == 30  # one per input element
    assert ops.classify("scaled_dot_product_attention") == "attention"
    assert ops.classify("transpose") == "view"
    assert ops.bias_flops("linear", (x, meta(4, 10), meta(4)), meta(3, 4), concrete) == 12
    assert ops.bias_flops("linear", (x, meta(4, 10), None), meta(3, 4), concrete) == 0


def test_attention_scores_shapes() -> None:
    assert is_scores((2, 8, 128, 128), 128, 2)  # [b, heads, s, s]
    assert is_scores((16, 129, 129), 128, 2)  # [b heads, s + class token, ...]
    assert not is_scores((2, 128, 128), 128, 2)  # hidden states [b, s, h] with h == s
    assert not is_scores((2, 8, 128, 64), 128, 2)
