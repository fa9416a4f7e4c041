"""Data parallelism with FSDP2 (ZeRO, Rajbhandari et al. 2020) or replication, per block then the root.

zero 3: `fully_shard` (weights, gradients and optimizer states sharded; weights re-gathered in
backward). zero 1 and 2: `fully_shard(reshard_after_forward=False)`: gradients and optimizer states
sharded, weights kept after forward; ZeRO-1 runs as ZeRO-2 (the same numerics, less memory).
zero 0: `replicate` (FSDP2's replicated data parallelism: gradients all-reduced).
Dense parameters are data parallel over dp*ep*cp; expert parameters, sharded over ep, over dp*cp only.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from autoplan.models import MoE, Transformer

ZERO1_RUNS_AS_ZERO2 = True  # recorded in the run report


def apply_data_parallel(model: Transformer, *, zero: int, dense_mesh: DeviceMesh, expert_mesh: DeviceMesh,
                        ep: int) -> None:
    """Wrap `model` (a whole model or a pipeline stage) in place; no-op when nothing is data parallel.

    Expert gradients arrive summed over the ep group (the all-to-all backward); ExpertParallel scales
    them by 1/ep in its backward (execute/experts.py), so the plain dp*cp average here completes the
    1/(dp*ep*cp) mean of the single-device gradient."""
    if dense_mesh.size() == 1 and ep == 1:
        return
    wrap = _wrapper(zero)
    for block in model.layers.values():
        mlp = _inner(block).mlp
        if isinstance(mlp, MoE) and ep > 1:
            wrap(mlp.experts, mesh=expert_mesh)
        wrap(block, mesh=dense_mesh)
    wrap(model, mesh=dense_mesh)


def wrap_blocks(root: nn.Module, blocks: list[nn.Module], *, zero: int, mesh: DeviceMesh) -> None:
    """Any model's data parallelism as above (used for components, execute/components.py): each
    repeated block, then the root, over one data-parallel mesh."""
    wrap = _wrapper(zero)
    for block in blocks:
        wrap(block, mesh=mesh)
    wrap(root, mesh=mesh)


def _wrapper(zero: int) -> Callable[..., nn.Module]:
    if zero == 0:
        return replicate
    reshard = zero == 3

    def shard(module: nn.Module, *, mesh: DeviceMesh) -> nn.Module:
        return fully_shard(module, mesh=mesh, reshard_after_forward=reshard)

    return shard


def _inner(block: nn.Module) -> nn.Module:
    """The Block inside an activation-checkpoint wrapper (or the block itself)."""
    return getattr(block, "_checkpoint_wrapped_module", block)
