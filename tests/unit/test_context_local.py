"""Context-parallel masking without a process group: the global-position causal mask by hand, and chunked
attention against full causal attention (the gather done by slicing)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autoplan.execute.context import causal_mask


def test_causal_mask_first_chunk_is_lower_triangular() -> None:
    expected = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_mask(3, 0, 3), expected)


def test_causal_mask_with_offset_by_hand() -> None:
    # queries at global positions 2, 3 (second chunk of length 2) against keys 0..3
    expected = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_mask(2, 2, 4), expected)


def test_chunked_attention_with_offsets_equals_full_causal_attention() -> None:
    torch.manual_seed(0)
    cp, local_len = 4, 3
    q, k, v = (torch.randn(2, 3, cp * local_len, 8) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for rank in range(cp):
        queries = slice(rank * local_len, (rank + 1) * local_len)
        end = (rank + 1) * local_len  # keys past the chunk's last query are dropped, as the CP core does
        mask = causal_mask(local_len, rank * local_len, end)
        chunk = F.scaled_dot_product_attention(q[:, :, queries], k[:, :, :end], v[:, :, :end], attn_mask=mask)
        torch.testing.assert_close(chunk, full[:, :, queries])
