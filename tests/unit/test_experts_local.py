"""Expert-parallel bookkeeping without a process group: sorting, splits, regrouping, and a simulated
all-to-all over virtual ep ranks checked against the reference Experts module."""

from __future__ import annotations

import torch

from autoplan.execute.experts import dispatch_layout, expert_ffn, expert_major_index, rank_splits
from autoplan.models import Experts, preset_config


def test_dispatch_layout_by_hand() -> None:
    # flat copies: [1, 0, 1, 2, 0, 3]; stable sort by expert -> copies 1, 4 | 0, 2 | 3 | 5
    topk_idx = torch.tensor([[1, 0], [1, 2], [0, 3]])
    order, token_of_copy, counts = dispatch_layout(topk_idx, num_experts=4)
    assert order.tolist() == [1, 4, 0, 2, 3, 5]
    assert token_of_copy.tolist() == [0, 2, 0, 1, 1, 2]
    assert counts.tolist() == [2, 2, 1, 1]
    assert rank_splits(counts, ep=2) == [4, 2]
    assert rank_splits(counts, ep=4) == [2, 2, 1, 1]


def test_dispatch_layout_counts_unused_experts_as_zero() -> None:
    _, _, counts = dispatch_layout(torch.tensor([[2], [2]]), num_experts=4)
    assert counts.tolist() == [0, 0, 2, 0]
    assert rank_splits(counts, ep=2) == [0, 2]


def test_expert_major_index_by_hand() -> None:
    # received rows, source-major: s0e0 -> 0, 1 | s0e1 -> 2 | s1e0 -> 3, 4, 5 | s1e1 -> none
    index = expert_major_index(torch.tensor([[2, 1], [3, 0]]))
    assert index.tolist() == [0, 1, 3, 4, 5, 2]


def test_expert_major_index_all_zero_and_single_source() -> None:
    assert expert_major_index(torch.zeros(3, 2, dtype=torch.long)).tolist() == []
    assert expert_major_index(torch.tensor([[2, 3]])).tolist() == [0, 1, 2, 3, 4]


def _simulated_expert_parallel(experts: Experts, xs: list[torch.Tensor], idxs: list[torch.Tensor],
                               weights: list[torch.Tensor], ep: int) -> list[torch.Tensor]:
    """ExpertParallel.forward with the two all-to-alls done by hand over `ep` virtual ranks."""
    num_local = experts.num_experts // ep
    layouts = [dispatch_layout(idx, experts.num_experts) for idx in idxs]
    sends = [list(torch.split(x[tok], rank_splits(counts, ep))) for x, (_, tok, counts) in zip(xs, layouts)]
    back: list[list[torch.Tensor]] = [[None] * ep for _ in range(ep)]  # type: ignore[list-item]
    for dest in range(ep):
        recv_counts = torch.stack([counts.view(ep, num_local)[dest] for _, _, counts in layouts])
        received = torch.cat([sends[src][dest] for src in range(ep)])
        index = expert_major_index(recv_counts)
        rows = torch.split(received[index], recv_counts.sum(0).tolist())
        first = dest * num_local
        outs = [expert_ffn(chunk, experts.w1[first + e], experts.w2[first + e],
                           None if experts.w3 is None else experts.w3[first + e]) for e, chunk in enumerate(rows)]
        y = torch.cat(outs)[torch.argsort(index)]
        for src, part in enumerate(torch.split(y, recv_counts.sum(1).tolist())):
            back[src][dest] = part
    results = []
    for src, (order, tok, _) in enumerate(layouts):
        y_sorted = torch.cat(back[src]) * weights[src].reshape(-1)[order].unsqueeze(-1)
        results.append(torch.zeros_like(xs[src]).index_add(0, tok, y_sorted))
    return results


def test_simulated_dispatch_matches_reference_experts() -> None:
    torch.manual_seed(0)
    config = preset_config("tiny-moe")
    experts = Experts(config)
    for weight in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(weight, std=0.1)
    ep, tokens = 2, 6
    xs = [torch.randn(tokens, config.hidden_size) for _ in range(ep)]
    # skewed routing: rank 1 sends nothing to experts 0/1 (a zero split), rank 0 favours expert 3
    idxs = [torch.tensor([[3, 0], [3, 1], [3, 2], [1, 0], [3, 0], [2, 3]]),
            torch.tensor([[2, 3]] * tokens)]
    weights = [torch.softmax(torch.randn(tokens, 2), -1) for _ in range(ep)]
    with torch.no_grad():
        got = _simulated_expert_parallel(experts, xs, idxs, weights, ep)
        for x, idx, w, y in zip(xs, idxs, weights, got):
            torch.testing.assert_close(y, experts(x, idx, w))
