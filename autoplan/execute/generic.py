"""apply_plan for models that are not presets: Hugging Face causal LMs and any block model, parallelised from the
roles of their modules (graph.roles) with torch's own APIs.

The order is the preset path's (apply.py): the pipeline split first (execute.runner.build_stage: the stage's
blocks, embedding on the first stage, norm and head on the last), then on each part: tensor / sequence
parallel (DTensor parallelize_module) -> expert parallel (the MoE layers' experts) -> context parallel (Hugging
Face attention through transformers' AttentionInterface) -> activation recompute -> weights (each rank's own
shards, execute.weights) -> data parallel (FSDP2 fully_shard / replicate per block, then the part), block by
block, so that a block's weights exist unsharded only while FSDP2 shards them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from autoplan.execute import hf_attention
from autoplan.execute.experts import apply_experts
from autoplan.execute.fsdp import _wrapper
from autoplan.execute.mesh import SubMeshes
from autoplan.execute.pipeline import local_stage_indices
from autoplan.execute.runner import build_stage
from autoplan.execute.source import ModelSpec
from autoplan.execute.tensor_parallel import apply_tensor_parallel_roles, vocab_parallel
from autoplan.execute.weights import WeightFiles, materialise
from autoplan.graph.roles import ModelRoles
from autoplan.graph.types import LayerRole
from autoplan.plan.layout import ZeroLayout, default_stages, num_stages
from autoplan.plan.types import ParallelConfig, Plan, Recompute, Stage

_WRAPPED = "_checkpoint_wrapped_module"


def config_of(plan: Plan | ParallelConfig) -> ParallelConfig:
    return plan.config if isinstance(plan, Plan) else plan


def stage_blocks(roles: ModelRoles, plan: Plan | ParallelConfig) -> tuple[tuple[str, ...], ...]:
    """The blocks of each pipeline stage: the plan's cut (checked), else plan.layout's default split."""
    config = config_of(plan)
    blocks = set(roles.block_paths)
    if isinstance(plan, Plan) and plan.stages:
        stages = tuple(sorted(plan.stages, key=lambda s: s.index))
        check_stages(roles, stages, num_stages(config))
        return tuple(tuple(n for n in s.layer_names if n in blocks) for s in stages)
    split = default_stages([u.name for u in roles.layers], [u.role is LayerRole.BLOCK for u in roles.layers], config)
    return tuple(tuple(n for n in s if n in blocks) for s in split)


def check_stages(roles: ModelRoles, stages: tuple[Stage, ...], count: int) -> None:
    """ValueError unless the stages hold every block once, in order; other names must be the model's
    embedding layer (first stage), head layer (last stage) or one of their modules."""
    got = [n for s in stages for n in s.layer_names if n in set(roles.block_paths)]
    if len(stages) != count or got != list(roles.block_paths):
        raise ValueError(f"the plan's {len(stages)} stages hold blocks {got}, but pp * virtual_stages = {count} "
                         f"stages must hold {list(roles.block_paths)} in order")
    where = {}
    for unit in roles.layers:
        for name in (unit.name, *unit.paths):
            where.setdefault(name, unit.role)
    for i, stage in enumerate(stages):
        for name in stage.layer_names:
            role = where.get(name)
            if role is None:
                raise ValueError(f"stage {stage.index} names {name!r}, not a layer of the model (its layers: "
                                 f"{', '.join(u.name for u in roles.layers)})")
            wanted = {LayerRole.EMBEDDING: 0, LayerRole.HEAD: count - 1}.get(role)
            if wanted is not None and i != wanted:
                raise ValueError(f"stage {stage.index} holds {name!r}: the embedding belongs on the first stage, "
                                 f"the final norm and head on the last")


def resolve(model: nn.Module, path: str) -> nn.Module | None:
    """The module at `path` (original names), looking through activation-checkpoint wrappers; None if absent."""
    module: nn.Module | None = model
    for name in path.split(".") if path else ():
        if module is None:
            return None
        nxt = module._modules.get(name) if name in module._modules else None
        if nxt is None and _WRAPPED in module._modules:
            nxt = module._modules[_WRAPPED]._modules.get(name)
        module = nxt
    return module


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, child = path.rpartition(".")
    parent = resolve(model, parent_path) if parent_path else model
    setattr(parent, child, new)


def _blocks_in(part: nn.Module, roles: ModelRoles) -> list[str]:
    return [path for path in roles.block_paths if resolve(part, path) is not None]


def apply_recompute_roles(part: nn.Module, roles: ModelRoles, family: str, *,
                          recompute_for: Callable[[str], Recompute]) -> None:
    """Full: each block in a checkpoint wrapper. Selective: only the attention op (Hugging Face families,
    through the autoplan attention function), or the whole attention module (other models)."""
    for path in _blocks_in(part, roles):
        mode = recompute_for(path)
        attention, op = roles.block(path).attention, roles.block(path).attention_op
        if mode is Recompute.FULL:
            _replace(part, path, checkpoint_wrapper(resolve(part, path)))
        elif mode is Recompute.SELECTIVE and family in ("hf-decoder", "gpt2") and op:
            hf_attention.use_autoplan_attention(part)
            hf_attention.set_core_recompute(resolve(part, op))
        elif mode is Recompute.SELECTIVE and attention:
            _replace(part, attention, checkpoint_wrapper(resolve(part, attention)))


def apply_context_parallel_roles(part: nn.Module, roles: ModelRoles, *, cp_mesh) -> None:
    if cp_mesh is None or cp_mesh.size() == 1:
        return
    hf_attention.use_autoplan_attention(part)
    for path in _blocks_in(part, roles):
        hf_attention.set_context_parallel(resolve(part, roles.block(path).attention_op), cp_mesh)


def shard_weights_and_data(part: nn.Module, roles: ModelRoles, config: ParallelConfig, meshes: SubMeshes, *,
                           layout: ZeroLayout, device: torch.device, seed: int, std: float,
                           weights: WeightFiles | None) -> None:
    """Materialise this rank's shards and apply data parallelism as `layout` says (execute.fsdp's wrapping),
    block by block (see the module docstring). Dense parameters are data parallel over dp*ep*cp, experts
    (sharded over ep) over dp*cp."""
    fill = {"device": device, "seed": seed, "std": std, "weights": weights}
    if meshes.dense_dp.size() == 1 and config.ep == 1:
        materialise(part, **fill)
        return
    wrap = _wrapper(layout)
    for path in _blocks_in(part, roles):
        block = resolve(part, path)
        materialise(block, prefix=path, **fill)
        experts = resolve(part, roles.block(path).experts) if roles.block(path).experts else None
        if experts is not None and config.ep > 1:
            wrap(experts, mesh=meshes.expert_dp)
        wrap(block, mesh=meshes.dense_dp)
    materialise(part, **fill)
    wrap(part, mesh=meshes.dense_dp)


def build_generic_parts(spec: ModelSpec, plan: Plan | ParallelConfig, meshes: SubMeshes, *, device: torch.device,
                        seed: int, recompute_for: Callable[[str], Recompute], layout: ZeroLayout) -> list[nn.Module]:
    """This rank's parts of the model of `spec`, parallelised as the plan says, weights filled."""
    config, roles = config_of(plan), spec.roles
    assert roles is not None, "a preset has no roles: use apply.apply_plan"
    skeleton = spec.build()
    runner = {"family": spec.family, "seq_factor": config.tp if config.sp else 1, "cp": config.cp,
              "cp_rank": meshes.rank_on("cp")}
    if config.pp > 1:
        split = stage_blocks(roles, plan)
        parts = [build_stage(skeleton, roles, blocks=split[i], first=i == 0, last=i == len(split) - 1, **runner)
                 for i in local_stage_indices(config, meshes.rank_on("pp"))]
    else:
        parts = [build_stage(skeleton, roles, blocks=None, first=True, last=True, **runner)]
    vocab = vocab_parallel(roles, skeleton, config.tp)
    del skeleton
    weights = WeightFiles(spec.weights, base_prefix=spec.base_prefix) if spec.weights else None
    experts = tuple(b.experts for _, b in roles.blocks if b.experts)
    for part in parts:
        apply_tensor_parallel_roles(part, roles, tp_mesh=meshes.tp, sp=config.sp, vocab=vocab)
        apply_experts(part, ep_mesh=meshes.ep, paths=experts)
        apply_context_parallel_roles(part, roles, cp_mesh=meshes.cp)
        apply_recompute_roles(part, roles, spec.family, recompute_for=recompute_for)
        shard_weights_and_data(part, roles, config, meshes, layout=layout, device=device, seed=seed,
                               std=spec.init_std, weights=weights)
    if weights is not None:
        weights.close()
    return parts


__all__ = ["apply_context_parallel_roles", "apply_recompute_roles", "build_generic_parts", "check_stages",
           "resolve", "shard_weights_and_data", "stage_blocks"]
