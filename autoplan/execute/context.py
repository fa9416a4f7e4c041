"""Context parallelism: the sequence split into cp contiguous chunks, exact causal attention over all of it.

`apply_context_parallel` swaps each `attn.core` for a `ContextParallelCore` that all-gathers K and V over the
cp mesh axis (autograd: reduce-scatter in backward) and masks with global positions (or, variant "ring", a
`RingAttentionCore` passing K/V blocks around the cp ring point to point), and makes the embedding and
attention modules number their positions from cp_rank * local_seq_len (learned positions and RoPE).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from autoplan.models.transformer import Attention, AttentionCore, TokenEmbedding

# torch >= 2.10 renamed the dim-0 autograd all-gather; the old name warns there and is all torch 2.6 has
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def causal_mask(num_queries: int, query_offset: int, num_keys: int) -> torch.Tensor:
    """Boolean [num_queries, num_keys], True where query i (global position query_offset + i) may attend
    key j (global position j): j <= query_offset + i."""
    query_pos = torch.arange(num_queries) + query_offset
    return torch.arange(num_keys)[None, :] <= query_pos[:, None]


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; makes the incoming gradient contiguous before it reaches the collective's backward
    (non-contiguous gradients into an all-gather backward silently gave wrong results on gloo: TORCH_NOTES)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.contiguous()


def gather_sequence(x: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """All-gather x [B, heads, S_local, d] over cp along the sequence -> [B, heads, cp * S_local, d].

    The gather runs on dim 0 of a contiguous [S_local, B, heads, d] buffer, so rank order is sequence order;
    its backward reduce-scatters (sums) each rank's key/value gradients back to the rank that owns them.
    """
    seq_major = x.permute(2, 0, 1, 3).contiguous()
    gathered = _all_gather_autograd(seq_major, gather_dim=0, group=cp_mesh.get_group())
    gathered = _ContiguousGrad.apply(funcol.wait_tensor(gathered))
    return gathered.permute(1, 2, 0, 3)


class ContextParallelCore(nn.Module):
    """Causal attention for the local query chunk cp_rank against keys and values gathered from all cp ranks.

    Rank r holds global positions [r*S, (r+1)*S) with S the local length; keys past (r+1)*S are never
    attended, so they are dropped before the softmax. Grouped-query attention arrives with kv heads already
    repeated (Attention does that before its core), so the gather moves q-head-count K and V.
    """

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.cp_mesh = cp_mesh

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        local_len, rank = q.shape[2], self.cp_mesh.get_local_rank()
        end = (rank + 1) * local_len
        k_all = gather_sequence(k, self.cp_mesh)[:, :, :end]
        v_all = gather_sequence(v, self.cp_mesh)[:, :, :end]
        mask = causal_mask(local_len, rank * local_len, end).to(q.device)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)

    def extra_repr(self) -> str:
        return f"cp={self.cp_mesh.size()}, rank={self.cp_mesh.get_local_rank()}, all-gather K/V"


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [B, H, S, d] over one key block [B, H, Sk, d], in float32: (out [B, H, S, d],
    log-sum-exp of the scores [B, H, S]). causal: the diagonal block (query i sees keys j <= i)."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], 0, k.shape[2]).to(q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v.float(), lse


def merge_blocks(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax attentions over disjoint key sets (the online softmax of Milakov and
    Gimelshein 2018, as in ring attention, Liu et al. 2023)."""
    merged = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - merged).unsqueeze(-1) + block_out * torch.exp(block_lse - merged).unsqueeze(-1),
            merged)


def _ring_shift(x: torch.Tensor, group: dist.ProcessGroup, direction: int) -> torch.Tensor:
    """Send x to the cp rank `direction` ahead, receive the one from `direction` behind (batch_isend_irecv)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), dist.get_global_rank(group, (rank + direction) % size), group),
           dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - direction) % size), group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


class _RingShift(torch.autograd.Function):
    """Pass a block one step around the ring; the backward passes its gradient one step back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _ring_shift(x, group, +1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _ring_shift(grad, ctx.group, -1), None


class RingAttentionCore(nn.Module):
    """Causal attention with K/V blocks passed around the cp ring (cp - 1 point-to-point steps) and merged by
    log-sum-exp; rank r attends its own block causally and the blocks of ranks < r fully.

    Exact like the all-gather core, with P2P traffic instead of a collective; autograd keeps every block for
    the backward, so the activation memory is that of the all-gather core (no memory saving here)."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.cp_mesh = cp_mesh

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group, rank, cp = self.cp_mesh.get_group(), self.cp_mesh.get_local_rank(), self.cp_mesh.size()
        out, lse = attend_block(q, k, v, causal=True)
        kv = torch.stack([k, v])
        for step in range(1, cp):
            kv = _RingShift.apply(kv, group)
            if step <= rank:  # the block of rank - step, all before this rank's queries
                out, lse = merge_blocks(out, lse, *attend_block(q, kv[0], kv[1], causal=False))
        if rank < cp - 1:
            # the ring's tail is unused here but its backward shifts must still run, to pair with the
            # neighbours' (P2P in backward happens only for blocks in the autograd graph)
            out = out + 0.0 * kv.sum()
        return out.to(q.dtype)

    def extra_repr(self) -> str:
        return f"cp={self.cp_mesh.size()}, rank={self.cp_mesh.get_local_rank()}, ring P2P K/V"


def _offset_hook(cp_rank: int):
    """Forward pre-hook: position_offset = cp_rank * (the local sequence length the module is about to see)."""

    def hook(module: nn.Module, args: tuple) -> None:
        module.position_offset = cp_rank * args[0].shape[1]  # tokens [B, S] or hidden states [B, S, h]

    return hook


CP_VARIANTS = {"allgather": ContextParallelCore, "ring": RingAttentionCore}


def apply_context_parallel(model: nn.Module, *, cp_mesh: DeviceMesh | None, variant: str = "allgather") -> None:
    """Replace each attention core by a CP core over cp_mesh (`variant`: "allgather", the default, or "ring")
    and offset positions by cp rank.

    A no-op when cp_mesh is None or has size 1. Works on TP-parallelised blocks (local head counts) and on
    pipeline stages holding some blocks or no embedding. Each rank must be fed the contiguous sequence
    chunk cp_rank of every sequence (inputs and targets), and the loss averaged over the cp ranks as over
    data-parallel ones: dense gradients are averaged over dp*ep*cp. The offsets are set by forward
    pre-hooks, since the local sequence length is only known from the input.
    """
    if cp_mesh is None or cp_mesh.size() == 1:
        return
    if cp_mesh.ndim != 1:
        raise ValueError(f"cp_mesh must be a 1-D mesh (the 'cp' axis), got {cp_mesh.ndim} dimensions")
    if variant not in CP_VARIANTS:
        raise ValueError(f"unknown context-parallel variant {variant!r}: choose one of {', '.join(CP_VARIANTS)}")
    hook = _offset_hook(cp_mesh.get_local_rank())
    for module in list(model.modules()):
        if isinstance(module, Attention):
            if not isinstance(module.core, AttentionCore):
                raise ValueError(f"attention core is already {type(module.core).__name__}: apply context "
                                 f"parallelism once, to the reference AttentionCore")
            module.core = CP_VARIANTS[variant](cp_mesh)
            module.register_forward_pre_hook(hook)
        elif isinstance(module, TokenEmbedding):
            module.register_forward_pre_hook(hook)


__all__ = ["CP_VARIANTS", "ContextParallelCore", "RingAttentionCore", "apply_context_parallel", "attend_block",
           "causal_mask", "gather_sequence", "merge_blocks"]
