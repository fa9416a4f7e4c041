"""The cost model: pure functions from (LayerGraph, ClusterSpec, ParallelConfig) to predicted step time,
memory and where the time goes. No torch; see each module's docstrings for the sources.
"""

from __future__ import annotations

from autoplan.cost.bound import EngineCost, with_engine
from autoplan.cost.comm import (
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    group_placement,
    p2p_s,
    reduce_scatter_s,
)
from autoplan.cost.compute import matmul_efficiency, matmul_time_s, memory_time_s
from autoplan.cost.estimate import ADAM_BYTES_PER_PARAM, estimate_config
from autoplan.cost.experts import expert_dp_placement, expert_placement
from autoplan.cost.hetero import default_split, rank_clusters, rank_groups, stage_rank_errors
from autoplan.cost.layer import estimate_layer
from autoplan.cost.memory import (
    block_activation_bytes,
    fixed_memory_bytes,
    layer_state_bytes,
    model_state_bytes,
)
from autoplan.cost.overlap import exposed_s, overlapped_s
from autoplan.cost.pipeline import bubble_fraction, in_flight_microbatches, pipeline_time_s
from autoplan.cost.stages import balanced_stages, check_config
from autoplan.cost.types import GroupPlacement, LayerCost


def stage_time_s(costs: list[LayerCost] | tuple[LayerCost, ...]) -> float:
    """Forward + backward time of one microbatch through a stage of layers (compute, recompute and
    the exposed tp / cp / ep communication), without pipeline point-to-point or data-parallel traffic."""
    return sum(cost.time_s for cost in costs)


__all__ = [
    "ADAM_BYTES_PER_PARAM",
    "EngineCost",
    "GroupPlacement",
    "LayerCost",
    "all_gather_s",
    "all_reduce_s",
    "all_to_all_s",
    "balanced_stages",
    "block_activation_bytes",
    "bubble_fraction",
    "check_config",
    "default_split",
    "estimate_config",
    "estimate_layer",
    "expert_dp_placement",
    "expert_placement",
    "exposed_s",
    "fixed_memory_bytes",
    "group_placement",
    "in_flight_microbatches",
    "layer_state_bytes",
    "matmul_efficiency",
    "matmul_time_s",
    "memory_time_s",
    "model_state_bytes",
    "overlapped_s",
    "p2p_s",
    "pipeline_time_s",
    "rank_clusters",
    "rank_groups",
    "reduce_scatter_s",
    "stage_rank_errors",
    "stage_time_s",
    "with_engine",
]
