"""Context parallelism: the sequence split into cp contiguous chunks, exact causal attention over all of it.

`apply_context_parallel` swaps each `attn.core` for a `ContextParallelCore` that all-gathers K and V over the
cp mesh axis (autograd: reduce-scatter in backward) and masks with global positions, and makes the embedding
and attention modules number their positions from cp_rank * local_seq_len (learned positions and RoPE).
"""

from __future__ import annotations

import torch
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


def _offset_hook(cp_rank: int):
    """Forward pre-hook: position_offset = cp_rank * (the local sequence length the module is about to see)."""

    def hook(module: nn.Module, args: tuple) -> None:
        module.position_offset = cp_rank * args[0].shape[1]  # tokens [B, S] or hidden states [B, S, h]

    return hook


def apply_context_parallel(model: nn.Module, *, cp_mesh: DeviceMesh | None) -> None:
    """Replace each attention core by a ContextParallelCore over cp_mesh and offset positions by cp rank.

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
    hook = _offset_hook(cp_mesh.get_local_rank())
    for module in list(model.modules()):
        if isinstance(module, Attention):
            if not isinstance(module.core, AttentionCore):
                raise ValueError(f"attention core is already {type(module.core).__name__}: apply context "
                                 f"parallelism once, to the reference AttentionCore")
            module.core = ContextParallelCore(cp_mesh)
            module.register_forward_pre_hook(hook)
        elif isinstance(module, TokenEmbedding):
            module.register_forward_pre_hook(hook)


__all__ = ["ContextParallelCore", "apply_context_parallel", "causal_mask", "gather_sequence"]
