"""Context parallelism with the load-balanced ("zig-zag") split: the sequence cut into 2*cp chunks, cp rank r
holding chunks r and 2cp-1-r (Megatron-core CP; Llama 3, Dubey et al. 2024, section 3.3.2; torchtitan), so
every rank does the same causal attention work. Exact causal attention by an all-gather of K/V (default) or a
ring of P2P K/V blocks; K/V travel with their kv heads only (grouped-query heads repeated after the exchange).
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

    The gather runs on dim 0 of a contiguous [S_local, B, heads, d] buffer, so the result holds the ranks'
    positions in rank order (zigzag_positions of rank 0, then rank 1, ...); its backward reduce-scatters (sums) each rank's key/value gradients back to the rank that owns them.
    """
    seq_major = x.permute(2, 0, 1, 3).contiguous()
    gathered = _all_gather_autograd(seq_major, gather_dim=0, group=cp_mesh.get_group())
    gathered = _ContiguousGrad.apply(funcol.wait_tensor(gathered))
    return gathered.permute(1, 2, 0, 3)


def zigzag_positions(seq_len: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions cp rank `rank` holds of a seq_len sequence: chunks rank and 2cp-1-rank of 2*cp
    equal chunks, in that order (all of [0, seq_len) when cp is 1)."""
    if cp == 1:
        return torch.arange(seq_len, device=device)
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len {seq_len} does not split into 2*cp = {2 * cp} equal chunks for cp={cp} (the "
                         f"load-balanced context-parallel split): use a multiple of {2 * cp}")
    chunk = seq_len // (2 * cp)
    base = torch.arange(chunk, device=device)
    return torch.cat([base + rank * chunk, base + (2 * cp - 1 - rank) * chunk])


def _half_chunk(local_len: int) -> int:
    if local_len % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks, got an odd local length {local_len}: "
                         f"use a sequence length that is a multiple of 2*cp")
    return local_len // 2


class ContextParallelCore(nn.Module):
    """Causal attention of this rank's two query chunks against K/V all-gathered from all cp ranks.

    Rank r's queries are chunks r ("early") and 2cp-1-r ("late") of 2*cp chunks of length c. Attention
    passes K/V with kv heads repeated kv_group times (repeat_interleave); only every kv_group-th head is
    gathered and the repeat redone afterwards, so the gather moves kv-head-count K and V. The gathered
    chunks are put in sequence order, and the early chunk attends keys [0, (r+1)c), the late one keys
    [0, (2cp-r)c), each masked by global position: (2cp+1) c^2 query-key scores on every rank.
    """

    def __init__(self, cp_mesh: DeviceMesh, kv_group: int = 1) -> None:
        super().__init__()
        self.cp_mesh, self.kv_group = cp_mesh, kv_group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rank, cp, g = self.cp_mesh.get_local_rank(), self.cp_mesh.size(), self.kv_group
        c = _half_chunk(q.shape[2])
        # rank order of the gather -> sequence order, keys past the late chunk's last query dropped
        held = torch.cat([zigzag_positions(2 * c * cp, cp, src) for src in range(cp)])
        order = torch.argsort(held)[:(2 * cp - rank) * c].to(q.device)
        k_all = gather_sequence(k[:, ::g], self.cp_mesh).index_select(2, order)
        v_all = gather_sequence(v[:, ::g], self.cp_mesh).index_select(2, order)
        if g > 1:
            k_all, v_all = k_all.repeat_interleave(g, dim=1), v_all.repeat_interleave(g, dim=1)
        outs = []
        for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):
            end = (chunk + 1) * c
            mask = causal_mask(c, chunk * c, end).to(q.device)
            outs.append(F.scaled_dot_product_attention(q[:, :, half * c:(half + 1) * c], k_all[:, :, :end],
                                                       v_all[:, :, :end], attn_mask=mask))
        return torch.cat(outs, dim=2)

    def extra_repr(self) -> str:
        return (f"cp={self.cp_mesh.size()}, rank={self.cp_mesh.get_local_rank()}, kv_group={self.kv_group}, "
                f"zig-zag all-gather K/V")


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


def attend_block_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                      lse: torch.Tensor, delta: torch.Tensor, *, causal: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in float32 of one key block's share of softmax attention whose final output over all
    blocks had log-sum-exp `lse` [B, H, S] and delta = rowsum(grad_out * out) [B, H, S]: the scores are
    recomputed, P = exp(q k^T / sqrt(d) - lse), dS = P (grad_out v^T - delta) (the FlashAttention backward,
    Dao et al. 2022, algorithm 4; ring attention, Liu et al. 2023, runs it per block)."""
    scale = q.shape[-1] ** -0.5
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], 0, k.shape[2]).to(q.device), float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    grad_scores = probs * (grad_out @ v.float().transpose(-2, -1) - delta.unsqueeze(-1))
    return (grad_scores @ k.float()) * scale, (grad_scores.transpose(-2, -1) @ q.float()) * scale, \
        probs.transpose(-2, -1) @ grad_out


def _ring_shift(x: torch.Tensor, group: dist.ProcessGroup, direction: int) -> torch.Tensor:
    """Send x to the cp rank `direction` ahead, receive the one from `direction` behind (batch_isend_irecv)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), dist.get_global_rank(group, (rank + direction) % size), group),
           dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - direction) % size), group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def _repeat(x: torch.Tensor, kv_group: int) -> torch.Tensor:
    """kv heads -> query heads (each kv head kv_group times in a row, as Attention repeats them)."""
    return x.repeat_interleave(kv_group, dim=1) if kv_group > 1 else x


def _fold(x: torch.Tensor, kv_group: int) -> torch.Tensor:
    """The adjoint of _repeat: sum the gradients of each kv head's copies."""
    return x.unflatten(1, (-1, kv_group)).sum(2) if kv_group > 1 else x


def _ring_steps(rank: int, cp: int, c: int):
    """(step, query slice, key slice) of each ring step: at step s the block of rank src = (r - s) mod cp is
    here; when src < r both query chunks attend src's early chunk, else the late chunk attends all of src."""
    for step in range(1, cp):
        early = (rank - step) % cp < rank
        yield step, slice(0, 2 * c) if early else slice(c, 2 * c), slice(0, c) if early else slice(0, 2 * c)


class _RingAttention(torch.autograd.Function):
    """Zig-zag causal ring attention that keeps only q, the local kv-head K/V, the output and its log-sum-exp
    for the backward (like FlashAttention: no score block is stored; the backward passes the K/V blocks
    around the ring again, recomputes each block's scores, and sends each block's dK/dV accumulator on with
    it until it is back home)."""

    @staticmethod
    def forward(ctx, q, k, v, group, rank: int, cp: int, kv_group: int):  # type: ignore[override]
        c = _half_chunk(q.shape[2])
        out, lse = attend_block(q, _repeat(k, kv_group), _repeat(v, kv_group), causal=True)
        kv = torch.stack([k, v]).contiguous()
        for _, qs, ks in _ring_steps(rank, cp, c):
            kv = _ring_shift(kv, group, +1)
            block = attend_block(q[:, :, qs], _repeat(kv[0][:, :, ks], kv_group), _repeat(kv[1][:, :, ks], kv_group),
                                 causal=False)
            out[:, :, qs], lse[:, :, qs] = merge_blocks(out[:, :, qs], lse[:, :, qs], *block)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.group, ctx.rank, ctx.cp, ctx.kv_group = group, rank, cp, kv_group
        return result

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        g, c = ctx.kv_group, q.shape[2] // 2
        grad_out = grad_out.float()
        delta = (grad_out * out.float()).sum(-1)
        dq, dk, dv = attend_block_grad(q, _repeat(k, g), _repeat(v, g), grad_out, lse, delta, causal=True)
        home = torch.stack([_fold(dk, g), _fold(dv, g)])
        kv, acc = torch.stack([k, v]).contiguous(), torch.zeros_like(home)
        for _, qs, ks in _ring_steps(ctx.rank, ctx.cp, c):
            kv, acc = _ring_shift(kv, ctx.group, +1), _ring_shift(acc, ctx.group, +1)
            dq_s, dk_s, dv_s = attend_block_grad(q[:, :, qs], _repeat(kv[0][:, :, ks], g), _repeat(kv[1][:, :, ks], g),
                                                 grad_out[:, :, qs], lse[:, :, qs], delta[:, :, qs], causal=False)
            dq[:, :, qs] += dq_s
            acc[:, :, :, ks] += torch.stack([_fold(dk_s, g), _fold(dv_s, g)])
        if ctx.cp > 1:
            home = home + _ring_shift(acc, ctx.group, +1)  # every other rank's share of this rank's dK/dV
        return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), None, None, None, None


class RingAttentionCore(nn.Module):
    """Causal attention with K/V blocks (kv heads only, repeated on arrival) passed around the cp ring in cp - 1
    point-to-point steps and merged by log-sum-exp, on the zig-zag split.

    Rank r attends its own two chunks causally (its positions increase along the local sequence). At step s
    it holds the block of rank src = (r - s) mod cp: when src < r both its query chunks attend src's early
    chunk (src's late chunk comes after them all); when src > r only its late chunk attends, both of src's
    chunks (all before it). Either way 2 c^2 scores per step: the same work on every rank, every block used.
    Exact like the all-gather core, with P2P traffic instead of a collective. The backward recomputes the
    scores block by block (_RingAttention), so no score block is kept: the fused-attention memory the cost
    model prices (no s x s scores held)."""

    def __init__(self, cp_mesh: DeviceMesh, kv_group: int = 1) -> None:
        super().__init__()
        self.cp_mesh, self.kv_group = cp_mesh, kv_group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g = self.kv_group  # attention passes K/V repeated; only every g-th head crosses the wire
        return _RingAttention.apply(q, k[:, ::g], v[:, ::g], self.cp_mesh.get_group(),
                                    self.cp_mesh.get_local_rank(), self.cp_mesh.size(), g)

    def extra_repr(self) -> str:
        return (f"cp={self.cp_mesh.size()}, rank={self.cp_mesh.get_local_rank()}, kv_group={self.kv_group}, "
                f"zig-zag ring P2P K/V")


def _positions_hook(cp_rank: int, cp: int):
    """Forward pre-hook: module.positions = this rank's zig-zag global positions, for the local sequence length
    the module is about to see (tokens [B, S] or hidden states [B, S, h])."""

    def hook(module: nn.Module, args: tuple) -> None:
        local_len = args[0].shape[1]
        _half_chunk(local_len)
        module.positions = zigzag_positions(local_len * cp, cp, cp_rank, device=args[0].device)

    return hook


def kv_group_of(attention: Attention) -> int:
    """Query heads per kv head, from the projections' (global) output widths."""
    q_width, kv_width = attention.wq.out_features, attention.wk.out_features
    if q_width % kv_width:
        raise ValueError(f"query width {q_width} is not a multiple of the kv width {kv_width}")
    return q_width // kv_width


CP_VARIANTS = {"allgather": ContextParallelCore, "ring": RingAttentionCore}


def apply_context_parallel(model: nn.Module, *, cp_mesh: DeviceMesh | None, variant: str = "allgather") -> None:
    """Replace each attention core by a CP core over cp_mesh (`variant`: "allgather", the default, or "ring";
    both exact, both on the zig-zag split) and give the embedding and attention modules this rank's positions.

    A no-op when cp_mesh is None or has size 1. Works on TP-parallelised blocks (local head counts) and on
    pipeline stages holding some blocks or no embedding. Each rank must be fed the tokens at
    zigzag_positions(S, cp, cp_rank) of every sequence (inputs, and the targets one position later: see
    train.local_batch), and the loss averaged over the cp ranks as over data-parallel ones (equal shards, so
    the mean is exact): dense gradients are averaged over dp*ep*cp. The positions are set by forward
    pre-hooks (the `positions` attribute of TokenEmbedding and Attention), since the local sequence length is
    only known from the input.
    """
    if cp_mesh is None or cp_mesh.size() == 1:
        return
    if cp_mesh.ndim != 1:
        raise ValueError(f"cp_mesh must be a 1-D mesh (the 'cp' axis), got {cp_mesh.ndim} dimensions")
    if variant not in CP_VARIANTS:
        raise ValueError(f"unknown context-parallel variant {variant!r}: choose one of {', '.join(CP_VARIANTS)}")
    hook = _positions_hook(cp_mesh.get_local_rank(), cp_mesh.size())
    for module in list(model.modules()):
        if isinstance(module, Attention):
            if not isinstance(module.core, AttentionCore):
                raise ValueError(f"attention core is already {type(module.core).__name__}: apply context "
                                 f"parallelism once, to the reference AttentionCore")
            module.core = CP_VARIANTS[variant](cp_mesh, kv_group=kv_group_of(module))
            module.register_forward_pre_hook(hook)
        elif isinstance(module, TokenEmbedding):
            module.register_forward_pre_hook(hook)


__all__ = ["CP_VARIANTS", "ContextParallelCore", "RingAttentionCore", "apply_context_parallel", "attend_block",
           "attend_block_grad", "causal_mask", "gather_sequence", "kv_group_of", "merge_blocks", "zigzag_positions"]
