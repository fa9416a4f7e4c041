"""MoE parallel folding in the cost model: where the experts' own groups sit (expert parallel, expert
tensor parallel, expert data parallel) and the communication of a folded MoE layer.

Unfolded configs (etp, eep unset) keep the layout the rest of the cost model prices: experts on the dense
mesh's ep axis, expert data parallelism over dp * cp. Folded ones use the expert mesh of
plan.layout.expert_mesh_shape: (pp, edp, eep, etp), etp innermost (Megatron-Core's expert RankGenerator).
"""

from __future__ import annotations

from autoplan.cluster.types import ClusterSpec
from autoplan.cost import comm
from autoplan.cost.types import GroupPlacement
from autoplan.plan.layout import EXPERT_AXIS_NAMES, expert_mesh_shape, expert_token_split
from autoplan.plan.types import ParallelConfig, Recompute

_DENSE_AXES = {"eep": ("ep",), "etp": ("tp",), "edp": ("dp", "cp")}  # the unfolded layout's groups


def expert_placement(config: ParallelConfig, axis: str, devices_per_node: int) -> GroupPlacement:
    """The group of rank 0 along one expert axis ("eep", "etp" or "edp"), placed on nodes as
    comm.group_placement places the dense groups (rank k on node k // devices_per_node)."""
    if axis not in _DENSE_AXES:
        raise ValueError(f"unknown expert axis {axis!r}: choose one of {sorted(_DENSE_AXES)}")
    if not config.folded:
        return comm.group_placement(config, _DENSE_AXES[axis], devices_per_node)
    sizes = tuple(size for _, size in expert_mesh_shape(config))
    return comm._placement(sizes, tuple(name == axis for name in EXPERT_AXIS_NAMES), devices_per_node)


def expert_dp_placement(config: ParallelConfig, devices_per_node: int) -> GroupPlacement:
    """The group over which expert gradients are reduced (and ZeRO shards expert states): dp * cp
    unfolded, the edp axis of the expert mesh when folded."""
    return expert_placement(config, "edp", devices_per_node)


def folded_expert_comm_s(shape, cluster: ClusterSpec, config: ParallelConfig, recompute: Recompute,
                         tokens: float, dbytes: int) -> tuple[float, float]:
    """Exposed communication of one folded MoE layer per microbatch, (forward part, total).

    `tokens`: the tokens of this rank's dense replica on this cp rank (replicated over its tp group).
    With T_r = tokens / tp (plan.layout.expert_token_split: each tp rank routes its share), per pass:
    - all-to-all dispatch and combine of T_r * top_k * h elements over the eep group (GShard, Lepikhin
      et al. 2021; Megatron-Core MoEAlltoAllTokenDispatcher), 2 in forward and 2 in backward;
    - etp > 1: the received rows all-gathered over the etp group before the expert GEMMs and the partial
      outputs reduce-scattered after them, etp * T_r * top_k * h elements each (the same dispatcher's
      all-gather / reduce-scatter in the expert tensor-parallel group), one of each per pass;
    - tp > 1: autoplan's executor splits the tp group's replicated tokens locally and all-gathers the
      expert output (tokens * h) in forward and the input gradient in backward (Megatron's
      gather_from_tensor_model_parallel_region pair); Megatron-Core, whose MoE layer runs on the
      sequence-parallel shard, does not need this all-gather (priced here as the executor runs it).
    Full recompute repeats the forward's. Exposed in full: issued on the compute stream."""
    if shape is None or not shape.num_experts:
        return 0.0, 0.0
    dpn = cluster.devices_per_node
    split = expert_token_split(config)
    rows = tokens / split * shape.top_k * shape.h * dbytes
    a2a = comm.all_to_all_s(rows, expert_placement(config, "eep", dpn), cluster)
    etp_group = expert_placement(config, "etp", dpn)
    gathered = rows * config.expert_tp
    etp = (comm.all_gather_s(gathered, etp_group, cluster)
           + comm.reduce_scatter_s(gathered, etp_group, cluster)) if config.expert_tp > 1 else 0.0
    tp = comm.all_gather_s(tokens * shape.h * dbytes, comm.group_placement(config, ("tp",), dpn),
                           cluster) if split > 1 else 0.0
    one_pass = 2 * a2a + etp + tp
    passes = 3 if recompute is Recompute.FULL else 2
    return one_pass, passes * one_pass
