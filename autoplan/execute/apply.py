"""apply_plan: turn one seeded model into this rank's model parts, one per local pipeline stage.

The order is fixed. First the pipeline split (module surgery only, no communication), because each
stage becomes its own data-parallel root; then on each part: tensor/sequence parallel -> expert
parallel -> context parallel -> activation recompute -> data parallel (FSDP2 / replicate). The caller
wraps the parts in PipelineStages and a schedule last (pipeline.build_schedule).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from autoplan.execute.context import apply_context_parallel
from autoplan.execute.experts import apply_experts
from autoplan.execute.fsdp import apply_data_parallel
from autoplan.execute.mesh import SubMeshes
from autoplan.execute.pipeline import (
    check_stages,
    even_stages,
    extract_stage,
    local_stage_indices,
    num_stages,
)
from autoplan.execute.recompute import apply_recompute
from autoplan.execute.tensor_parallel import apply_tensor_parallel
from autoplan.models import Transformer
from autoplan.plan.layout import zero_layout
from autoplan.plan.types import ParallelConfig, Plan, Recompute, Stage


def config_of(plan: Plan | ParallelConfig) -> ParallelConfig:
    return plan.config if isinstance(plan, Plan) else plan


def plan_stages(model: Transformer, plan: Plan | ParallelConfig) -> tuple[Stage, ...]:
    """The plan's pipeline cut, or the blocks split evenly when the plan has none."""
    config = config_of(plan)
    count = num_stages(config)
    stages = plan.stages if isinstance(plan, Plan) and plan.stages else even_stages(model, config)
    check_stages(model, stages, count)
    return tuple(sorted(stages, key=lambda s: s.index))


def recompute_lookup(plan: Plan | ParallelConfig) -> Callable[[str], Recompute]:
    if isinstance(plan, Plan):
        return plan.recompute_for
    return lambda _name: plan.recompute


def apply_plan(model: Transformer, plan: Plan | ParallelConfig, meshes: SubMeshes, *,
               device: torch.device, num_microbatches: int = 1) -> list[nn.Module]:
    """This rank's parts of `model` (built on CPU from the seed), parallelised in place as the plan says
    (data parallelism as plan.layout.zero_layout says for `num_microbatches` per step)."""
    config = config_of(plan)
    layout = zero_layout(config, num_microbatches)
    if config.pp > 1:
        stages = plan_stages(model, plan)
        parts = [extract_stage(model, stages[i], first=i == 0, last=i == len(stages) - 1)
                 for i in local_stage_indices(config, meshes.rank_on("pp"))]
    else:
        parts = [model]
    for part in parts:
        part.to(device)
        apply_tensor_parallel(part, tp_mesh=meshes.tp, sp=config.sp)
        apply_experts(part, ep_mesh=meshes.expert_shards, token_mesh=meshes.token_split,
                      grad_scale=meshes.expert_dp.size() / meshes.dense_dp.size())
        apply_context_parallel(part, cp_mesh=meshes.cp)
        apply_recompute(part, recompute_for=recompute_lookup(plan))
        apply_data_parallel(part, layout=layout, dense_mesh=meshes.dense_dp, expert_mesh=meshes.expert_dp,
                            ep=meshes.expert_shards.size(), separate_experts=config.folded or None)
    return parts

