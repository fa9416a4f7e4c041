"""Data parallelism with FSDP2 (ZeRO, Rajbhandari et al. 2020) or replication, per block then the root,
run exactly as autoplan.plan.layout.zero_layout says (the function the cost model prices with).

zero 0: `replicate` (FSDP2's replicated data parallelism): gradients all-reduced once per step.
zero 1: `fully_shard(reshard_after_forward=False)`, gradient sync and resharding only on the last
microbatch: full gradients accumulate, are reduce-scattered once, and the updated weight shards are
all-gathered once, before the next step's first forward (only the optimizer states stay sharded).
zero 2: the same wrapping, gradients reduce-scattered after every microbatch (sharded gradients), the
weights kept gathered until the last microbatch's backward.
zero 3: `fully_shard(reshard_after_forward=True)`: weights gathered before each microbatch's forward
and again before its backward, gradients reduce-scattered every microbatch.
With pp > 1, torch.distributed.pipelining sets the same three FSDP2 switches itself (sync and reshard
on the last backward only: PipelineStage.backward_maybe_with_nosync / perform_reduce_grad), which
zero_layout's `pipelined_fsdp_defers_sync` describes.
Dense parameters are data parallel over dp*ep*cp; expert parameters, sharded over ep, over dp*cp only.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from autoplan.models import MoE, Transformer
from autoplan.plan.layout import ZeroLayout


def apply_data_parallel(model: Transformer, *, layout: ZeroLayout, dense_mesh: DeviceMesh,
                        expert_mesh: DeviceMesh, ep: int, separate_experts: bool | None = None) -> None:
    """Wrap `model` (a whole model or a pipeline stage) in place; no-op when nothing is data parallel.

    Expert gradients arrive summed over the ep group (the all-to-all backward); ExpertParallel scales
    them by 1/ep in its backward (execute/experts.py), so the plain dp*cp average here completes the
    1/(dp*ep*cp) mean of the single-device gradient. `separate_experts` (default: ep > 1) wraps the
    experts over expert_mesh on their own; folded layouts always do (their expert data-parallel group
    is not the dense one)."""
    separate = ep > 1 if separate_experts is None else separate_experts
    if dense_mesh.size() == 1 and not separate:
        return
    wrap = _wrapper(layout)
    for block in model.layers.values():
        mlp = _inner(block).mlp
        if isinstance(mlp, MoE) and separate:
            wrap(mlp.experts, mesh=expert_mesh)
        wrap(block, mesh=dense_mesh)
    wrap(model, mesh=dense_mesh)


def wrap_blocks(root: nn.Module, blocks: list[nn.Module], *, layout: ZeroLayout, mesh: DeviceMesh) -> None:
    """Any model's data parallelism as above (used for components, execute/components.py): each
    repeated block, then the root, over one data-parallel mesh."""
    wrap = _wrapper(layout)
    for block in blocks:
        wrap(block, mesh=mesh)
    wrap(root, mesh=mesh)


def _wrapper(layout: ZeroLayout) -> Callable[..., nn.Module]:
    if not layout.shards_optimizer:
        return replicate
    # ZeRO-3 frees the gathered weights after each forward (and re-gathers them for the backward)
    reshard = layout.weight_gathers_per_microbatch > 0

    def shard(module: nn.Module, *, mesh: DeviceMesh) -> nn.Module:
        return fully_shard(module, mesh=mesh, reshard_after_forward=reshard)

    return shard


def prepare_microbatch(part: nn.Module, layout: ZeroLayout, *, last: bool) -> None:
    """Before one microbatch's forward and backward without a pipeline schedule: reduce the gradients
    now or let them accumulate, and free the gathered weights after the backward or keep them, as
    `layout` says (every microbatch for ZeRO-2/3, once per step otherwise; the last one always)."""
    if not isinstance(part, FSDPModule):
        return
    part.set_is_last_backward(last)
    part.set_requires_gradient_sync(last or layout.reduce_every_microbatch)
    part.set_reshard_after_backward(last or layout.shards_weights)


def _inner(block: nn.Module) -> nn.Module:
    """The Block inside an activation-checkpoint wrapper (or the block itself)."""
    return getattr(block, "_checkpoint_wrapped_module", block)
