"""Heterogeneous clusters in the search: which dense meshes the executor can run on node groups of
different kinds, per-rank costs for the stage problem, and the stages of a plan with their groups.

What runs (and so what is searched): one rectangular torch DeviceMesh, so every pipeline rank has the
same dp, ep, cp and tp, and pp is the outermost axis; a pipeline rank lies in one node group (its
dp*ep*cp*tp devices divide the group's), and tp stays inside a node of every group. Groups differ in how
many pipeline ranks they hold and, through the stage split, how many layers each of those holds: the
split is chosen by the stage DP / ILP (search/stages.py) with each rank's layer times and memory limit
taken on its own group's device (Metis, Um et al. ATC'24; Sailor, Strati et al. 2024).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autoplan.cluster.types import ClusterSpec
from autoplan.graph.types import LayerGraph
from autoplan.plan.layout import stage_ranks
from autoplan.plan.types import ParallelConfig, Recompute, Stage


def stage_fits_groups(cluster: ClusterSpec, stage_ranks: int, tp: int) -> bool:
    """Whether a pipeline rank of `stage_ranks` devices with tensor parallelism tp lies inside one node
    group of `cluster` wherever it falls (always true for a homogeneous cluster)."""
    return all(g.num_devices % stage_ranks == 0 and tp <= g.spec.devices_per_node for g in cluster.groups)


def with_rank_costs(problem: Any, graph: LayerGraph, cluster: ClusterSpec, config: ParallelConfig,
                    modes: tuple[Recompute, ...], cost_model: Any, run_first: list[int], reserve_bytes: float) -> Any:
    """The StageProblem with each pipeline rank's block times (rank_time_s) and memory limit
    (rank_mem_limit_bytes) on its own node group, and the pinned first / last layers' times on the ranks
    that hold them; unchanged for a homogeneous cluster. `reserve_bytes`: what the problem's single
    memory limit already keeps back besides the device's runtime reserve (working set, ZeRO-3 gathers)."""
    if not cluster.groups:
        return problem
    views = cost_model.rank_clusters(cluster, config)

    def time(view: ClusterSpec, i: int, mode: Recompute) -> float:
        return cost_model.estimate_layer(graph.layers[i], view, dataclasses.replace(config, recompute=mode), mode,
                                         seq_len=graph.seq_len, graph_microbatch=graph.microbatch).time_s

    blocks = [i for i, layer in enumerate(graph.layers) if layer.role.value == "block"]
    first = range(blocks[0])
    last = range(blocks[-1] + 1, len(graph.layers))
    rank_time = tuple(tuple(tuple(time(view, i, mode) for mode in modes) for i in run_first) for view in views)
    limits = tuple(float(v.device.mem_bytes - v.device.runtime_reserve_bytes - reserve_bytes) for v in views)
    last_view = views[problem.stage_rank[-1]]
    return dataclasses.replace(
        problem, rank_time_s=rank_time, rank_mem_limit_bytes=limits,
        mem_limit_bytes=max(limits),
        first_time_s=sum(time(views[0], i, Recompute.NONE) for i in first),
        last_time_s=sum(time(last_view, i, Recompute.NONE) for i in last))


def stage_group_names(cluster: ClusterSpec, config: ParallelConfig, cost: Any) -> tuple[str, ...]:
    """The node group each stage runs on (by name, in stage order); () for a homogeneous cluster."""
    if not cluster.groups:
        return ()
    groups = cost.rank_groups(cluster, config)
    return tuple(cluster.groups[groups[r]].name for r in stage_ranks(config))


def plan_stages(graph: LayerGraph, cluster: ClusterSpec, config: ParallelConfig,
                stages: tuple[tuple[str, ...], ...], cost: Any, global_batch: int) -> tuple[Stage, ...]:
    """A plan's stages: the given split (or the one estimate_config priced), each with its node group."""
    split = stages or tuple(cost.default_split(graph, cluster, config, global_batch))
    names = stage_group_names(cluster, config, cost) or ("",) * len(split)
    return tuple(Stage(index=i, layer_names=tuple(s), group=g) for i, (s, g) in enumerate(zip(split, names)))


def group_notes(plan: Any, graph: LayerGraph, cluster: ClusterSpec) -> tuple[str, ...]:
    """Plain words for a heterogeneous plan: which pipeline ranks run on which group with how many blocks,
    and the launch order the stage placement assumes (ranks numbered group after group)."""
    if not cluster.groups or not plan.stages:
        return ()
    blocks = {layer.name for layer in graph.blocks}
    owner = stage_ranks(plan.config)
    per_rank = [0] * plan.config.pp
    group_of = [""] * plan.config.pp
    for stage in plan.stages:
        per_rank[owner[stage.index]] += sum(1 for n in stage.layer_names if n in blocks)
        group_of[owner[stage.index]] = stage.group
    parts = []
    for group in cluster.groups:
        mine = [r for r in range(plan.config.pp) if group_of[r] == group.name]
        if mine:
            parts.append(f"pipeline rank{'s' if len(mine) > 1 else ''} {_span(mine)} on {group.name} "
                         f"({'/'.join(str(per_rank[r]) for r in mine)} blocks)")
    start, order = 0, []
    for group in cluster.groups:
        order.append(f"{group.name} as ranks {start}-{start + group.num_devices - 1}")
        start += group.num_devices
    note = (f"Node groups: {'; '.join(parts)}: stages sized by each group's speed and memory. Launch "
            f"{', then '.join(order)} (node ranks in that order).")
    return (note,)


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
