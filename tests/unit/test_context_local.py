"""Context-parallel attention math without a process group: the global-position causal mask by hand, chunked
attention and ring blocks merged by log-sum-exp against full attention; the zig-zag split (equal causal work per
rank, positions and targets per rank) and both CP cores on zig-zag shards, the exchange stood in by slicing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autoplan.execute import context
from autoplan.execute.context import attend_block, causal_mask, merge_blocks, zigzag_positions
from autoplan.execute.train import local_batch
from autoplan.models import preset
from autoplan.plan.types import ParallelConfig


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


# --- the load-balanced (zig-zag) split ------------------------------------------------------------------


def test_zigzag_positions_by_hand() -> None:
    # 8 positions, cp 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # 12 positions, cp 3: chunks of 2
    assert [zigzag_positions(12, 3, r).tolist() for r in range(3)] == [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]
    assert zigzag_positions(5, 1, 0).tolist() == [0, 1, 2, 3, 4]


def test_zigzag_gives_every_rank_the_same_causal_work() -> None:
    seq, cp = 16, 4
    # unmasked (query, key) pairs of a query at position p: keys 0..p, p + 1 of them
    work = [sum(p + 1 for p in zigzag_positions(seq, cp, r).tolist()) for r in range(cp)]
    # by hand, c = 2: chunks r and 7 - r hold 2 queries each; sum of (p + 1) = 4 * 7 + 2 * 3 = 34 per rank,
    # a quarter of 16 * 17 / 2 = 136
    assert work == [34, 34, 34, 34]
    contiguous = [sum(p + 1 for p in range(r * 4, r * 4 + 4)) for r in range(cp)]
    assert contiguous == [10, 26, 42, 58]  # last rank (2cp - 1)/cp = 7/4 of the mean 34


def test_zigzag_local_batch_positions_and_targets() -> None:
    batch = torch.arange(2 * 13).reshape(2, 13) * 10  # token at position p of row b is 10 * (13 b + p)
    for rank, positions in enumerate([[0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8]]):  # cp 2, chunks of 3
        inputs, targets = local_batch(batch, ParallelConfig(cp=2), _CpRank(rank))
        expected = torch.tensor([[10 * (13 * b + p) for p in positions] for b in range(2)])
        assert torch.equal(inputs, expected) and torch.equal(targets, expected + 10)


def test_positions_attribute_overrides_the_offset() -> None:
    torch.manual_seed(0)
    gpt = preset("tiny-gpt")
    tokens = torch.randint(0, 128, (2, 16))
    picked = torch.tensor([0, 1, 14, 15])  # rank 0 of cp 4
    full = gpt.embed(tokens)
    gpt.embed.positions = picked
    torch.testing.assert_close(gpt.embed(tokens[:, picked]), full[:, picked])
    torch.testing.assert_close(gpt.embed(tokens[:, picked]),
                               gpt.embed.tok(tokens[:, picked]) + gpt.embed.pos.weight[picked])
    attn = preset("tiny-llama").layers["0"].attn
    seen: list[torch.Tensor] = []
    attn.core.forward = lambda q, k, v: (seen.append(k), v)[1]  # record the rotated keys
    x = torch.randn(2, 16, 64)
    attn(x)
    attn.positions = picked
    attn(x[:, picked])
    torch.testing.assert_close(seen[1], seen[0][:, :, picked])


class _CpRank:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def rank_on(self, axis: str) -> int:
        return self.rank if axis == "cp" else 0


class _FakeMesh:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.cp = rank, size

    def get_local_rank(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.cp

    def get_group(self) -> None:
        return None


def _gqa(seed: int, cp: int, c: int, heads: int = 4, kv_heads: int = 2):
    """q [1, heads, S, 8]; k, v with kv_heads heads; k, v repeated as Attention does; full causal attention."""
    gen = torch.Generator().manual_seed(seed)
    seq = 2 * cp * c
    q = torch.randn(1, heads, seq, 8, generator=gen)
    k, v = (torch.randn(1, kv_heads, seq, 8, generator=gen) for _ in range(2))
    group = heads // kv_heads
    k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return q, k, v, k_rep, v_rep, group, F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)


RANKS = [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]


@pytest.mark.parametrize("cp,rank", RANKS)
def test_allgather_core_on_zigzag_shards_equals_full_attention(cp: int, rank: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The core's math on one rank, the all-gather stood in by slicing: it must gather kv heads only (g/a of
    the repeated bytes), in rank order, and do (2cp + 1) c^2 query-key scores, the same on every rank."""
    c = 3
    q, k, v, k_rep, v_rep, group, full = _gqa(0, cp, c)
    shards = [zigzag_positions(2 * cp * c, cp, r) for r in range(cp)]
    mine, scores, sdpa = shards[rank], [], F.scaled_dot_product_attention

    def fake_gather(x: torch.Tensor, mesh: _FakeMesh) -> torch.Tensor:
        assert x.shape[1] == k.shape[1]  # kv heads only cross the wire
        source = k if torch.equal(x, k[:, :, mine]) else v
        torch.testing.assert_close(x, source[:, :, mine])
        return torch.cat([source[:, :, s] for s in shards], dim=2)

    def counting_sdpa(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor, **kw) -> torch.Tensor:
        scores.append(q_.shape[2] * k_.shape[2])
        return sdpa(q_, k_, v_, **kw)

    monkeypatch.setattr(context, "gather_sequence", fake_gather)
    monkeypatch.setattr(context.F, "scaled_dot_product_attention", counting_sdpa)
    core = context.ContextParallelCore(_FakeMesh(rank, cp), kv_group=group)  # type: ignore[arg-type]
    out = core(q[:, :, mine], k_rep[:, :, mine], v_rep[:, :, mine])
    torch.testing.assert_close(out, full[:, :, mine])
    assert sum(scores) == (2 * cp + 1) * c * c


@pytest.mark.parametrize("cp,rank", RANKS)
def test_ring_core_on_zigzag_shards_equals_full_attention_and_keeps_no_scores(
        cp: int, rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring core's forward on one rank, the P2P shift stood in by handing over rank - step's un-repeated
    K/V; what autograd keeps for the backward is q, the local kv-head K/V, the output and its log-sum-exp:
    no query x key score block (FlashAttention's memory, which the cost model prices for fused attention)."""
    c = 2
    q, k, v, k_rep, v_rep, group, full = _gqa(1, cp, c)
    shards = [zigzag_positions(2 * cp * c, cp, r) for r in range(cp)]
    mine, steps = shards[rank], []

    def fake_shift(kv: torch.Tensor, _group: None, direction: int) -> torch.Tensor:
        assert direction == 1 and kv.shape[2] == k.shape[1]  # kv heads only cross the wire
        steps.append(1)
        src = shards[(rank - len(steps)) % cp]
        return torch.stack([k[:, :, src], v[:, :, src]])

    monkeypatch.setattr(context, "_ring_shift", fake_shift)
    core = context.RingAttentionCore(_FakeMesh(rank, cp), kv_group=group)  # type: ignore[arg-type]
    saved: list[tuple[int, ...]] = []
    inputs = [t[:, :, mine].clone().requires_grad_() for t in (q, k_rep, v_rep)]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = core(*inputs)
    assert len(steps) == cp - 1
    torch.testing.assert_close(out, full[:, :, mine])
    heads, kv_heads, local = q.shape[1], k.shape[1], 2 * c
    assert sorted(saved) == sorted([(1, heads, local, 8), (1, kv_heads, local, 8), (1, kv_heads, local, 8),
                                    (1, heads, local, 8), (1, heads, local)])


def test_block_gradients_with_the_final_log_sum_exp_equal_autograd() -> None:
    """attend_block_grad per key block, given the merged output's lse and delta, sums to autograd's gradient
    of the merged attention (two blocks: a causal diagonal one and an earlier full one)."""
    gen = torch.Generator().manual_seed(3)
    q, k1, v1, k2, v2 = (torch.randn(1, 2, 3, 4, generator=gen, requires_grad=True)
                         for _ in range(5))
    weight = torch.randn(1, 2, 3, 4, generator=gen)
    out, lse = merge_blocks(*attend_block(q, k1, v1, causal=True), *attend_block(q, k2, v2, causal=False))
    grads = torch.autograd.grad((out * weight).sum(), (q, k1, v1, k2, v2))
    delta = (weight * out).sum(-1).detach()
    dq1, dk1, dv1 = context.attend_block_grad(q, k1, v1, weight, lse.detach(), delta, causal=True)
    dq2, dk2, dv2 = context.attend_block_grad(q, k2, v2, weight, lse.detach(), delta, causal=False)
    for got, want in zip((dq1 + dq2, dk1, dv1, dk2, dv2), grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
