"""The global gradient norm of a step across every rank of a plan: the check that a run's gradients have
the reference's scale (a missing factor in a reduction leaves AdamW's update nearly unchanged, since Adam
is invariant to a constant gradient scale, but shows here), and the figure trainers log every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


def global_grad_norm(parts: Sequence[nn.Module], *, pp_group: object | None = None) -> float:
    """sqrt(sum of every parameter's squared gradient) over the whole model, the same on every rank.

    A DTensor gradient's squared norm is its local shard's, summed over the mesh dimensions it is sharded
    on (replicas counted once); a plain tensor's gradient is whole on this rank (replicated over the
    others). The pipeline ranks hold different parameters, so their sums add over the pp group (None: one
    stage)."""
    total = torch.zeros((), dtype=torch.float64)
    for part in parts:
        for param in part.parameters():
            grad = param.grad
            if grad is None:
                continue
            total += _squared_norm(grad.detach())
    if pp_group is not None:
        device = next((p.device for part in parts for p in part.parameters()), torch.device("cpu"))
        value = total.to(device)
        dist.all_reduce(value, group=pp_group)
        total = value.cpu()
    return float(total.sqrt())


def _squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """One gradient's squared 2-norm as a float64 CPU scalar, summed over its DTensor shards."""
    if not isinstance(grad, DTensor):
        return grad.to(torch.float64).pow(2).sum().cpu()
    if any(p.is_partial() for p in grad.placements):  # pending sums: reduce them before squaring
        grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
    local = grad.to_local().to(torch.float64).pow(2).sum()
    for dim, placement in enumerate(grad.placements):
        if not placement.is_replicate():  # Shard and FSDP-over-TP's _StridedShard (not is_shard())
            dist.all_reduce(local, group=grad.device_mesh.get_group(dim))
    return local.cpu()
