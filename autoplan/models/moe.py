"""Feed-forward layers of the reference model: the dense MLP, the routed Experts and the MoE layer.

The router is Mixtral-style: softmax over the top-k router logits (Jiang et al. 2024, "Mixtral of
Experts", eq. 1). Shared experts (DeepSeekMoE, Dai et al. 2024) are one dense MLP of their summed width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.models.config import TransformerConfig


class MLP(nn.Module):
    """gpt: fc2(gelu(fc1 x)) with biases; llama: w2(silu(w1 x) * w3 x) without biases (SwiGLU)."""

    def __init__(self, config: TransformerConfig, ffn_hidden_size: int) -> None:
        super().__init__()
        h, f = config.hidden_size, ffn_hidden_size
        self.family = config.family
        if self.family == "gpt":
            self.fc1 = nn.Linear(h, f, bias=True)
            self.fc2 = nn.Linear(f, h, bias=True)
        else:
            self.w1 = nn.Linear(h, f, bias=False)
            self.w2 = nn.Linear(f, h, bias=False)
            self.w3 = nn.Linear(h, f, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.family == "gpt":
            return self.fc2(F.gelu(self.fc1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _is_tracing(x: torch.Tensor) -> bool:
    """True under torch.compile / torch.export, on the meta device, or for fake tensors."""
    if torch.compiler.is_compiling() or x.is_meta:
        return True
    from torch._subclasses.fake_tensor import FakeTensor, is_fake

    return isinstance(x, FakeTensor) or is_fake(x)


class Experts(nn.Module):
    """The routed experts of one MoE layer, as stacked weights: w1 [E, f, h], w2 [E, h, f], w3 [E, f, h]
    (w3 for the llama family only; the gpt family uses a GELU MLP per expert). No biases.

    forward(x [T, h], topk_idx [T, k], topk_weight [T, k]) -> [T, h] = sum_j weight[t, j] * FFN_{idx[t, j]}(x[t]).

    Two paths:
    - real tensors: loop over the experts, gathering the tokens routed to each (data-dependent shapes).
    - tracing (torch.compiler.is_compiling(), meta tensors, FakeTensors, so torch.export on meta works):
      a static-shape path that ASSUMES BALANCED ROUTING. The T*k token copies are sorted by expert id
      and split evenly, each expert taking T*k/E of them (split as evenly as possible when E does not
      divide T*k). It applies exactly T*k expert FFNs, the FLOPs of any routing; its output equals the
      real path's only when routing happens to be balanced.
    Expert parallelism replaces this module as a whole.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        e, f, h = config.num_experts, config.expert_ffn_hidden_size, config.hidden_size
        self.num_experts = e
        self.family = config.family
        self.w1 = nn.Parameter(torch.empty(e, f, h))
        self.w2 = nn.Parameter(torch.empty(e, h, f))
        self.w3 = nn.Parameter(torch.empty(e, f, h)) if config.family == "llama" else None

    def expert_ffn(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert `e` on its tokens x [n, h] -> [n, h]."""
        if self.w3 is None:
            return F.gelu(x @ self.w1[e].t()) @ self.w2[e].t()
        return (F.silu(x @ self.w1[e].t()) * (x @ self.w3[e].t())) @ self.w2[e].t()

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        _num_tokens, k = topk_idx.shape
        flat_idx = topk_idx.reshape(-1)
        # token copies sorted by expert id; stable so the order within an expert is the token order
        order = torch.argsort(flat_idx, stable=True)
        token_of_copy = order // k
        x_sorted = x[token_of_copy]
        if _is_tracing(x):
            y_sorted = self._forward_balanced(x_sorted)
        else:
            y_sorted = self._forward_routed(x_sorted, flat_idx)
        y_sorted = y_sorted * topk_weight.reshape(-1)[order].unsqueeze(-1).to(y_sorted.dtype)
        out = torch.zeros_like(x)
        return out.index_add(0, token_of_copy, y_sorted)

    def _forward_routed(self, x_sorted: torch.Tensor, flat_idx: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(flat_idx, minlength=self.num_experts).tolist()
        chunks = torch.split(x_sorted, counts)
        outs = [self.expert_ffn(chunk, e) for e, chunk in enumerate(chunks) if counts[e]]
        return torch.cat(outs) if outs else x_sorted

    def _forward_balanced(self, x_sorted: torch.Tensor) -> torch.Tensor:
        n, h = x_sorted.shape
        e = self.num_experts
        if n % e == 0:  # one batched matmul per weight: [E, n/E, h]
            xb = x_sorted.view(e, n // e, h)
            if self.w3 is None:
                hidden = F.gelu(torch.bmm(xb, self.w1.transpose(1, 2)))
            else:
                hidden = F.silu(torch.bmm(xb, self.w1.transpose(1, 2))) * torch.bmm(
                    xb, self.w3.transpose(1, 2)
                )
            return torch.bmm(hidden, self.w2.transpose(1, 2)).reshape(n, h)
        chunks = torch.tensor_split(x_sorted, e)
        return torch.cat([self.expert_ffn(chunk, i) for i, chunk in enumerate(chunks)])


class MoE(nn.Module):
    """Mixture-of-experts feed-forward: `router` (Linear(h, E)), `experts` (Experts), `shared` (MLP or None).

    Router weights are the softmax over the top-k logits, as in Mixtral (DeepSeek-V3's sigmoid
    gating and bias-based balancing are not modelled; the FLOPs and shapes are the same).
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config)
        width = config.num_shared_experts * config.expert_ffn_hidden_size
        self.shared = MLP(config, width) if config.num_shared_experts else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, h] -> (topk_idx [T, k], topk_weight [T, k])."""
        logits = self.router(x)
        top_logits, topk_idx = torch.topk(logits, self.top_k, dim=-1)
        return topk_idx, torch.softmax(top_logits.float(), dim=-1).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        topk_idx, topk_weight = self.route(flat)
        out = self.experts(flat, topk_idx, topk_weight)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(shape)
