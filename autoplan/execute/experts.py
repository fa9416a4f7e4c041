"""Expert parallelism: each MoE layer's routed experts split over the ep mesh axis, tokens exchanged by all-to-all.

`apply_experts` swaps every `mlp.experts` (autoplan.models.Experts, or a Hugging Face transformers 5 experts
module: stacked `gate_up_proj` [E, 2f, h] and `down_proj` [E, h, f] with `act_fn`, as Mixtral's) for an
`ExpertParallel` that holds the experts [ep_rank * E/ep, (ep_rank + 1) * E/ep) as DTensor Shard(0) parameters
on the ep mesh, so their FQNs and global shapes are those of the reference model and DCP reshards them.

MoE folding (plan.layout.expert_mesh_shape): the experts are sharded over the expert mesh's eep axis and
each tp rank routes its 1/tp of the tp group's replicated tokens (a local split, the outputs all-gathered
back), so every rank of a pipeline stage sends distinct tokens, as Megatron-Core's folded MoE layer does.
Expert tensor parallelism (etp > 1) is priced by the cost model but not run here: check_expert_layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autoplan.models.moe import Experts
from autoplan.plan.types import ParallelConfig

_WEIGHT_NAMES = ("w1", "w2", "w3")
HF_WEIGHT_NAMES = ("gate_up_proj", "down_proj")


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the T*k token copies by expert id (stable, as the reference Experts does).

    Returns (order [T*k]: flat copy indices in sorted order, token_of_copy [T*k]: the token of each sorted
    copy, counts [E]: copies per expert). Sorted by expert means sorted by destination ep rank too, since
    rank r owns the contiguous experts [r*E/ep, (r+1)*E/ep).
    """
    k = topk_idx.shape[1]
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, order // k, counts


def rank_splits(counts: torch.Tensor, ep: int) -> list[int]:
    """Copies per destination rank: per-expert counts [E] summed over each rank's E/ep experts."""
    return counts.view(ep, -1).sum(dim=1).tolist()


def expert_major_index(recv_counts: torch.Tensor) -> torch.Tensor:
    """Gather index that reorders received rows from source-major to local-expert-major.

    recv_counts [ep, E_local]: rows from source rank s for local expert e (the all-to-all delivers all of
    rank 0's rows, sorted by expert, then rank 1's, ...). The result `idx` makes `received[idx]` hold all
    rows of local expert 0 (source 0 first, then source 1, ...), then local expert 1, and so on.
    """
    device = recv_counts.device
    flat = recv_counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(recv_counts)
    counts_em = recv_counts.t().reshape(-1)  # blocks in expert-major order
    starts_em = starts.t().reshape(-1)
    block = torch.repeat_interleave(torch.arange(counts_em.numel(), device=device), counts_em)
    block_begin = torch.cumsum(counts_em, 0) - counts_em
    within = torch.arange(block.numel(), device=device) - block_begin[block]
    return starts_em[block] + within


def expert_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor | None) -> torch.Tensor:
    """One expert on its rows x [n, h]: gelu(x w1^T) w2^T (gpt), (silu(x w1^T) * x w3^T) w2^T (llama)."""
    if w3 is None:
        return F.gelu(x @ w1.t()) @ w2.t()
    return (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()


def is_hf_experts(module: nn.Module) -> bool:
    """A transformers 5 experts module: exactly the stacked gate_up_proj / down_proj weights and an act_fn."""
    names = {name for name, _ in module.named_parameters(recurse=False)}
    return (names == set(HF_WEIGHT_NAMES) and hasattr(module, "act_fn")
            and all(getattr(module, n).dim() == 3 for n in HF_WEIGHT_NAMES))


def _hf_expert_ffn(act_fn: nn.Module):
    """One Hugging Face expert on its rows (MixtralExperts.forward): gate, up = x W_gu^T; down(act(gate) * up)."""

    def ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(act_fn(gate) * up, down)

    return ffn


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


class _SplitRows(torch.autograd.Function):
    """This rank's 1/n of rows that are replicated over the group; backward all-gathers the row
    gradients, so the replicated input gets its whole, identical gradient on every rank (Megatron's
    scatter_to_tensor_model_parallel_region pair)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:  # type: ignore[override]
        ctx.mesh = mesh
        return x.chunk(mesh.size())[mesh.get_local_rank()].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _gather_rows(grad, ctx.mesh), None


class _GatherRows(torch.autograd.Function):
    """All ranks' rows, in rank order; backward keeps this rank's rows of the (replicated) gradient
    (gather_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:  # type: ignore[override]
        ctx.mesh = mesh
        return _gather_rows(x, mesh)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad.chunk(ctx.mesh.size())[ctx.mesh.get_local_rank()].contiguous(), None


# torch >= 2.10 renamed the dim-0 all-gather (the old name warns there and is all torch 2.6 has)
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _gather_rows(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return funcol.wait_tensor(_all_gather(x.contiguous(), 0, mesh.get_group()))


class ExpertParallel(nn.Module):
    """The local E/ep experts of one MoE layer; forward(x [T, h], topk_idx [T, k], topk_weight [T, k]) -> [T, h].

    Dispatch: copies sorted by expert are sent to their owner rank with all_to_all_single_autograd (uneven
    and zero splits; the per-expert counts are exchanged first), regrouped by local expert, run, sent back
    and combined with the router weights exactly as the reference Experts does.

    Gradients: the backward all-to-all sums, into each expert's weight gradient, the contributions of all ep
    ranks' tokens. Dense parameters are averaged over the dp*ep*cp replicas while expert weights are only
    averaged over dp*cp (they are sharded over ep), so the expert gradient is scaled by 1/ep here; then the
    dp*cp average equals the single-device gradient of the mean loss.

    Folded (`token_mesh`, the dense tp mesh): each tp rank routes its 1/tp of the rows (_SplitRows) and the
    outputs are all-gathered back (_GatherRows). `grad_scale` then is edp / (dp*ep*cp): every token of the
    stage reaches its experts once, so the expert gradients summed over the edp replicas are the sum over
    all dp*ep*cp dense replicas' losses (1/ep unfolded, the default).
    """

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh, *, token_mesh: DeviceMesh | None = None,
                 grad_scale: float | None = None) -> None:
        super().__init__()
        self.token_mesh = token_mesh if token_mesh is not None and token_mesh.size() > 1 else None
        self.grad_scale = 1.0 / ep_mesh.size() if grad_scale is None else grad_scale
        if isinstance(experts, Experts):
            self.weight_names, num_experts = _WEIGHT_NAMES, experts.num_experts
            self.family = experts.family
            self._ffn = lambda x, w1, w2, w3: expert_ffn(x, w1, w2, w3)
        elif is_hf_experts(experts):
            self.weight_names, num_experts = HF_WEIGHT_NAMES, int(experts.gate_up_proj.shape[0])
            self.family, self.act_fn = "hf", experts.act_fn
            self._ffn = _hf_expert_ffn(experts.act_fn)
        else:
            raise ValueError(f"expert parallelism takes autoplan's Experts or transformers' stacked gate_up_proj / "
                             f"down_proj experts, not {type(experts).__name__}")
        ep = ep_mesh.size()
        if num_experts % ep:
            raise ValueError(f"expert parallel degree ep={ep} does not divide the {num_experts} experts of a "
                             f"MoE layer: choose ep among the divisors of {num_experts}")
        self.num_experts = num_experts
        self.ep_mesh = ep_mesh
        self.num_local_experts = num_experts // ep
        first = ep_mesh.get_local_rank() * self.num_local_experts
        for name in self.weight_names:
            full = getattr(experts, name)
            if full is None:
                setattr(self, name, None)
                continue
            if isinstance(full, DTensor):
                raise ValueError(f"experts.{name} is already a DTensor on mesh {full.device_mesh}: expert "
                                 f"parallelism takes unsharded experts (apply no tensor parallelism to them)")
            local = full.detach()[first:first + self.num_local_experts].clone()
            shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False,
                                       shape=full.shape, stride=full.stride())
            setattr(self, name, nn.Parameter(shard, requires_grad=full.requires_grad))

    def _local_weights(self) -> list[torch.Tensor | None]:
        scale = self.grad_scale
        out: list[torch.Tensor | None] = []
        for name in self.weight_names:
            weight = getattr(self, name)
            if weight is not None:
                weight = weight.to_local() if isinstance(weight, DTensor) else weight
                weight = _ScaleGrad.apply(weight, scale)
            out.append(weight)
        return out

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        if self.token_mesh is None:
            return self._dispatch(x, topk_idx, topk_weight)
        mesh = self.token_mesh
        mine = topk_idx.chunk(mesh.size())[mesh.get_local_rank()]
        y = self._dispatch(_SplitRows.apply(x, mesh), mine, _SplitRows.apply(topk_weight, mesh))
        return _GatherRows.apply(y, mesh)

    def _dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        ep, group = self.ep_mesh.size(), self.ep_mesh.get_group()
        order, token_of_copy, counts = dispatch_layout(topk_idx, self.num_experts)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)  # equal splits: E/ep counts per rank
        recv_counts = recv_counts.view(ep, self.num_local_experts)
        send_splits = rank_splits(counts, ep)
        recv_splits = recv_counts.sum(dim=1).tolist()

        x_sorted = x[token_of_copy].contiguous()
        received = funcol.all_to_all_single_autograd(x_sorted, recv_splits, send_splits, group)
        index = expert_major_index(recv_counts)
        rows = torch.split(received[index], recv_counts.sum(dim=0).tolist())
        weights = self._local_weights()
        # every local expert runs, even on zero rows, so each weight always gets a (possibly zero) gradient
        outs = [self._ffn(chunk, *(None if w is None else w[e] for w in weights)) for e, chunk in enumerate(rows)]
        y_expert_major = torch.cat(outs)
        y_source_major = y_expert_major[torch.argsort(index)].contiguous()
        y_sorted = funcol.all_to_all_single_autograd(y_source_major, send_splits, recv_splits, group)

        y_sorted = y_sorted * topk_weight.reshape(-1)[order].unsqueeze(-1).to(y_sorted.dtype)
        return torch.zeros_like(x).index_add(0, token_of_copy, y_sorted)

    def extra_repr(self) -> str:
        first = self.ep_mesh.get_local_rank() * self.num_local_experts
        return f"experts [{first}, {first + self.num_local_experts}) of {self.num_experts}, ep={self.ep_mesh.size()}"


def check_expert_layout(config: ParallelConfig) -> None:
    """Refuse, before any work, a folded expert layout this executor does not run: etp > 1 (expert tensor
    parallelism; the cost model prices it, Megatron-Core runs it)."""
    if config.folded and config.expert_tp > 1:
        raise ValueError(f"etp={config.expert_tp}: autoplan's executor runs folded expert layouts with etp=1 "
                         f"only (expert tensor parallelism is planned and exported, not executed): use etp=1, "
                         f"or train this plan with Megatron-Core (--export megatron)")


def apply_experts(model: nn.Module, *, ep_mesh: DeviceMesh | None, paths: tuple[str, ...] | None = None,
                  token_mesh: DeviceMesh | None = None, grad_scale: float | None = None) -> None:
    """Replace every `Experts` submodule (each MoE block's `mlp.experts`), or the modules at `paths` (module
    FQNs, for other models: graph.roles finds them), by an `ExpertParallel` over ep_mesh (folded:
    token_mesh and grad_scale as ExpertParallel says).

    A no-op when ep_mesh is None or has size 1 (and no token_mesh splits the tokens), and for models or
    pipeline stages without MoE layers.
    Needs the full, identically seeded expert weights on every rank (each keeps its own slice), or meta
    weights (each rank then materialises its own slice: execute.weights).
    Data parallelism afterwards must treat the ExpertParallel modules apart: their weights are sharded over
    ep, so they are replicated / FSDP-sharded over the dp (and cp) axes only, not over ep.
    """
    splits = token_mesh is not None and token_mesh.size() > 1
    if ep_mesh is None or (ep_mesh.size() == 1 and not splits):
        return
    if ep_mesh.ndim != 1:
        raise ValueError(f"ep_mesh must be a 1-D mesh (the 'ep' axis), got {ep_mesh.ndim} dimensions")
    present = dict(model.named_modules())
    if paths is None:
        targets = [(name, module) for name, module in present.items() if isinstance(module, Experts)]
    else:
        targets = [(name, present[name]) for name in paths if name in present]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, ExpertParallel(module, ep_mesh, token_mesh=token_mesh, grad_scale=grad_scale))


def expert_parallel_modules(model: nn.Module) -> list[ExpertParallel]:
    """The ExpertParallel modules of `model` (for data parallelism to wrap over the non-ep axes)."""
    return [module for module in model.modules() if isinstance(module, ExpertParallel)]


__all__ = ["HF_WEIGHT_NAMES", "ExpertParallel", "apply_experts", "check_expert_layout", "dispatch_layout",
           "expert_ffn", "expert_major_index", "expert_parallel_modules", "is_hf_experts", "rank_splits"]
