"""Context-parallel attention math without a process group: the global-position causal mask by hand, and
chunked attention (the gather done by slicing) and ring blocks merged by log-sum-exp against full attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autoplan.execute.context import attend_block, causal_mask, merge_blocks


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


def test_ring_blocks_merged_by_log_sum_exp_equal_full_causal_attention() -> None:
    torch.manual_seed(1)
    cp, local_len = 3, 4
    q, k, v = (torch.randn(2, 2, cp * local_len, 8) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    chunks = [slice(r * local_len, (r + 1) * local_len) for r in range(cp)]
    for rank in range(cp):
        qr = q[:, :, chunks[rank]]
        out, lse = attend_block(qr, k[:, :, chunks[rank]], v[:, :, chunks[rank]], causal=True)
        for src in range(rank - 1, -1, -1):  # the ring's order: rank - 1, rank - 2, ...
            out, lse = merge_blocks(out, lse, *attend_block(qr, k[:, :, chunks[src]], v[:, :, chunks[src]],
                                                             causal=False))
        torch.testing.assert_close(out, full[:, :, chunks[rank]])
        torch.testing.assert_close(lse, torch.logsumexp(
            (qr @ k[:, :, :(rank + 1) * local_len].transpose(-2, -1)) / 8 ** 0.5
            + torch.where(causal_mask(local_len, rank * local_len, (rank + 1) * local_len), 0.0, float("-inf")),
            dim=-1))


def test_merge_blocks_by_hand() -> None:
    # one query, two single-key blocks with scores 0 and log 3: weights 1/4 and 3/4
    out, lse = merge_blocks(torch.tensor([[2.0]]), torch.tensor([0.0]), torch.tensor([[6.0]]),
                            torch.tensor([3.0]).log())
    torch.testing.assert_close(out, torch.tensor([[0.25 * 2.0 + 0.75 * 6.0]]))
    torch.testing.assert_close(lse, torch.tensor([4.0]).log())
