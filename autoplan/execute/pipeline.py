"""Pipeline parallelism with torch.distributed.pipelining: stages cut where the plan cuts them.

A stage is a deep copy of the model with the other blocks deleted (the ModuleDict keeps the names)
and embed / norm / head set to None where the stage does not hold them. Placement and the default split
come from autoplan.plan.layout (stage_ranks, default_stages), the functions the cost model prices with:
looped (stage i on rank i % pp) or, for 'zb' with 2 stages per rank, the zero-bubble V.
Gradients are averaged over microbatches (`scale_grads=True`, recorded in the report).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from autoplan.models import Transformer
from autoplan.plan.layout import default_stages, num_stages, rank_stages, uses_v_placement
from autoplan.plan.types import ParallelConfig, Schedule, Stage

SCALE_GRADS = True  # gradients averaged over microbatches, as the single-device mean loss


def local_stage_indices(config: ParallelConfig, pp_rank: int) -> tuple[int, ...]:
    """The stages pipeline rank `pp_rank` holds, in increasing order (plan.layout.rank_stages: the cost
    model places stages with the same function)."""
    return rank_stages(config, pp_rank)


def even_stages(model: Transformer, config: ParallelConfig | int) -> tuple[Stage, ...]:
    """The default split (plan.layout.default_stages, the one the cost model prices): embed on the first
    stage, norm and head on the last. An int means that many looped stages."""
    if isinstance(config, int):
        config = ParallelConfig(pp=config)
    blocks = [f"layers.{n}" for n in model.layers]
    names = ["embed", *blocks, "norm", "head"]
    split = default_stages(names, [name in set(blocks) for name in names], config)
    return tuple(Stage(index=i, layer_names=tuple(s)) for i, s in enumerate(split))


def _blocks(stage: Stage) -> list[str]:
    return [name for name in stage.layer_names if name.split(".")[0] == "layers"]


def check_stages(model: Transformer, stages: Sequence[Stage], count: int) -> None:
    """Raise ValueError unless `stages` are `count` stages whose blocks cover every block once, in model
    order. Other names (embed, norm, head and their submodules) may be given or omitted: embed always
    runs on the first stage, norm and head on the last."""
    ordered = sorted(stages, key=lambda s: s.index)
    expected = [f"layers.{n}" for n in model.layers]
    got = [name for stage in ordered for name in _blocks(stage)]
    if len(stages) != count or got != expected:
        raise ValueError(f"the plan's {len(stages)} stages hold blocks {got}, but pp * virtual_stages = {count} "
                         f"stages must hold {expected} in order")
    for i, stage in enumerate(ordered):
        for name in set(stage.layer_names) - set(_blocks(stage)):
            root = name.split(".")[0]
            if root not in ("embed", "norm", "head"):
                raise ValueError(f"stage {stage.index} names {name!r}, not a module of {model.config.name}")
            if i != (0 if root == "embed" else count - 1):
                raise ValueError(f"stage {stage.index} holds {name!r}: embed belongs on the first stage, "
                                 f"norm and head on the last")


def extract_stage(model: Transformer, stage: Stage, *, first: bool, last: bool) -> Transformer:
    """A deep copy of `model` holding only the blocks of `stage` (names unchanged), plus the embedding
    on the first stage and the final norm and head on the last."""
    part = copy.deepcopy(model)
    keep = set(_blocks(stage))
    for name in list(part.layers.keys()):
        if f"layers.{name}" not in keep:
            del part.layers[name]
    if not first:
        part.embed = None
    if not last:
        part.norm = part.head = None
    return part


def build_schedule(parts: Sequence[nn.Module], indices: Sequence[int], config: ParallelConfig, *,
                   pp_group: object, device: torch.device, num_microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> object:
    """Wrap the local stage modules in PipelineStages and the plan's schedule."""
    n = num_stages(config)
    stages = [PipelineStage(part, index, n, device, group=pp_group) for part, index in zip(parts, indices)]
    kwargs = {"n_microbatches": num_microbatches, "loss_fn": loss_fn, "scale_grads": SCALE_GRADS}
    schedule_cls = _schedule_class(config)
    if issubclass(schedule_cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(f"schedule {config.schedule.value!r} runs one stage per rank, got {len(stages)}: "
                             f"use virtual_stages=1")
        return schedule_cls(stages[0], **kwargs)
    return schedule_cls(stages, **kwargs)


def _schedule_class(config: ParallelConfig) -> type:
    if config.schedule is Schedule.GPIPE:
        return ScheduleGPipe
    if config.schedule is Schedule.ONE_F_ONE_B:
        return Schedule1F1B
    if config.schedule is Schedule.INTERLEAVED:
        return ScheduleInterleaved1F1B
    return ScheduleZBVZeroBubble if uses_v_placement(config) else ScheduleInterleavedZeroBubble


def holds_first_stage(indices: Sequence[int]) -> bool:
    return 0 in indices


def holds_last_stage(indices: Sequence[int], config: ParallelConfig) -> bool:
    return num_stages(config) - 1 in indices

