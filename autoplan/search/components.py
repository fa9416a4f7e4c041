"""plan_components(graph, cluster, options): a training plan for a model with components, each device group
with its own strategy, found with the existing search on the group's sub-cluster.

Groups: every component with repeated blocks gets a group; a connector without blocks (a projector) runs
in the group of the component feeding it (vLLM and LLaVA's training code run the projector with the
vision tower), else of the one it feeds. Groups take consecutive ranks in topological order.

The groups form a pipeline (DistTrain, Zhang et al. 2024, arXiv 2408.04275, section 4: a multimodal
model's encoder and LLM on disaggregated GPU groups, sized so that no group is the straggler; GPipe,
Huang et al. 2019, for the schedule): a step's global batch B is cut into M hand-off microbatches, each
group runs forward and backward of one microbatch per slot and hands activations (forward) and their
gradients (backward) to its neighbours. With t_g the slot time of group g and f_g its once-per-step tail
(optimizer, exposed gradient reduction):

    T = L + (M - 1) * max_g t_g + max_g f_g,   L = the longest path through the groups' DAG, weighted by t_g

t_g = (T_g - f_g) / M + hops, where T_g is the group's own estimate (cost.estimate_config) of the whole
batch with microbatch * dp * ep = B / M, and each edge adds one point-to-point hop per slot to both ends
(cost.comm.p2p_s of the bytes the busiest device sends or receives, as estimate_config charges pipeline
hops). The executor runs the groups GPipe-style (every forward, then the backwards as gradients return),
so a group that feeds another holds all M microbatches' activations: memory charges them.
For every split of the devices (1..devices_per_node, whole nodes and powers of two per group) the search
keeps each group's top candidates, re-times them at each M dividing B and takes the fastest.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass, field, replace
from typing import Any

from autoplan.cluster.types import ClusterSpec
from autoplan.graph.types import ComponentGraph, LayerGraph
from autoplan.plan.components import EXECUTOR_GROUP_OPTIONS, ComponentPlan
from autoplan.plan.types import Plan, Stage
from autoplan.search.component_cost import compose
from autoplan.search.search import search
from autoplan.search.space import SearchOptions


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceGroupSpec:
    """The components one device group runs, and their layers as one LayerGraph."""

    components: tuple[str, ...]
    graph: LayerGraph


@dataclass(frozen=True, kw_only=True)
class ComponentOptions:
    """What to search. `search` holds SearchOptions fields for every group (pp=1, zero=(0, 3), ...),
    `group_search` per group, keyed by any component name in it; `devices` fixes the device count of
    each group (in group order); `num_microbatches` restricts the hand-off microbatch counts."""

    global_batch: int
    top_k: int = 3
    devices: tuple[int, ...] | None = None
    num_microbatches: tuple[int, ...] | None = None
    max_microbatches: int = 64
    candidates: int = 8  # per group and size, from the search
    search: dict[str, Any] = field(default_factory=dict)
    group_search: dict[str, dict[str, Any]] = field(default_factory=dict)


def device_groups(graph: ComponentGraph) -> tuple[DeviceGroupSpec, ...]:
    """Heavy components one group each; connectors join the group feeding them (else the one they feed)."""
    heavy = [c.name for c in graph.components if c.has_blocks] or [graph.components[0].name]
    members = {name: [name] for name in heavy}
    for c in graph.components:
        if c.name in members:
            continue
        feeders = [e.src for e in graph.edges if e.dst == c.name and e.src in members]
        fed = [e.dst for e in graph.edges if e.src == c.name and e.dst in members]
        host = (feeders or fed or heavy)[0]
        members[host].append(c.name)
    order = [c.name for c in graph.components]
    return tuple(DeviceGroupSpec(components=tuple(sorted(ms, key=order.index)), graph=graph.merged(ms))
                 for ms in (members[h] for h in heavy))


def sub_cluster(cluster: ClusterSpec, num_devices: int) -> ClusterSpec:
    """A cluster of `num_devices` devices of `cluster`: inside one node when it fits, else nodes of
    gcd(num_devices, devices_per_node) devices (a group of 12 on 8-device nodes is priced as 3 x 4:
    its collectives cross the slower link beyond 4 ranks, a conservative placement)."""
    if num_devices <= cluster.devices_per_node:
        return replace(cluster, devices_per_node=num_devices, num_nodes=1)
    per_node = math.gcd(num_devices, cluster.devices_per_node)
    return replace(cluster, devices_per_node=per_node, num_nodes=num_devices // per_node)


def group_sizes(num_devices: int, devices_per_node: int) -> tuple[int, ...]:
    """Device counts a group may take: 1..devices_per_node, whole nodes and powers of two."""
    sizes = set(range(1, min(num_devices, devices_per_node) + 1))
    sizes |= set(range(devices_per_node, num_devices + 1, devices_per_node))
    sizes |= {2**k for k in range(num_devices.bit_length()) if 2**k <= num_devices}
    return tuple(sorted(sizes))


def splits(num_devices: int, num_groups: int, devices_per_node: int) -> list[tuple[int, ...]]:
    """Device counts per group summing to num_devices; every group but the last from group_sizes."""
    sizes = group_sizes(num_devices, devices_per_node)

    def rest(left: int, groups: int) -> list[tuple[int, ...]]:
        if groups == 1:
            return [(left,)] if left >= 1 else []
        return [(n, *tail) for n in sizes if n < left for tail in rest(left - n, groups - 1)]

    return rest(num_devices, num_groups)


@dataclass(frozen=True, slots=True)
class _Timed:
    """One group's plan re-timed at M hand-off microbatches."""

    plan: Plan
    slot_s: float  # per microbatch, before the hops
    tail_s: float
    extra_act_bytes: int  # activations held for the microbatches in flight beyond the plan's own

    @property
    def fits(self) -> bool:
        return self.plan.estimate.peak_mem_bytes + self.extra_act_bytes <= self.plan.estimate.mem_capacity_bytes


def retime(group: DeviceGroupSpec, cluster: ClusterSpec, plan: Plan, num_microbatches: int, *, feeds: bool,
           cost: Any) -> _Timed | None:
    """`plan` with microbatch * dp * ep = B / M (None when that does not divide or does not run)."""
    c, batch = plan.config, plan.global_batch
    share, rest = divmod(batch, num_microbatches * c.num_replicas)
    if rest or share < 1:
        return None
    config = replace(c, microbatch=share)
    stages = tuple(s.layer_names for s in plan.stages) or None
    try:
        est = cost.estimate_config(group.graph, cluster, config, global_batch=batch, stages=stages,
                                   layer_recompute=dict(plan.layer_recompute))
    except ValueError:
        return None
    tail = est.breakdown.optimizer + est.breakdown.dp_comm
    timed = replace(plan, config=config, estimate=est, seq_len=group.graph.seq_len)
    extra = _held_bytes(group.graph, cluster, timed, num_microbatches, cost) if feeds else 0
    return _Timed(plan=timed, slot_s=(est.step_time_s - tail) / num_microbatches, tail_s=tail,
                  extra_act_bytes=extra)


def _held_bytes(graph: LayerGraph, cluster: ClusterSpec, plan: Plan, m: int, cost: Any) -> int:
    """Activations of the microbatches a feeding group holds beyond its own schedule's: it keeps all M
    until their gradients return (GPipe across groups), its first pipeline rank has room for
    in_flight_microbatches of them already."""
    c = plan.config
    first = plan.stages[0].layer_names if plan.stages else tuple(layer.name for layer in graph.layers)
    names = set(first)
    per_mb = sum(cost.estimate_layer(layer, cluster, c, plan.recompute_for(layer.name), seq_len=graph.seq_len,
                                     graph_microbatch=graph.microbatch).act_mem_bytes
                 for layer in graph.layers if layer.name in names)
    held = cost.in_flight_microbatches(c.schedule, c.pp, c.virtual_stages, m, 0)
    return int(max(0.0, m - held) * per_mb)


def _candidates(group: DeviceGroupSpec, cluster: ClusterSpec, options: ComponentOptions,
                cost: Any) -> tuple[Plan, ...]:
    """The group's top plans on its sub-cluster by the existing search (none when nothing fits)."""
    # within what the component executor runs (plan.components.EXECUTOR_GROUP_OPTIONS), unless asked otherwise
    opts = {"use_ilp": False, **EXECUTOR_GROUP_OPTIONS, **options.search}
    for name in group.components:
        opts.update(options.group_search.get(name, {}))
    try:
        found = search(group.graph, cluster, SearchOptions(global_batch=options.global_batch,
                                                           top_k=options.candidates, **opts), cost_model=cost)
    except ValueError:
        return ()
    return tuple(replace(p, stages=p.stages or tuple(Stage(index=i, layer_names=s) for i, s in
                                                     enumerate(cost.balanced_stages(group.graph, p.config))))
                 for p in found)


def plan_components(graph: ComponentGraph, cluster: ClusterSpec, options: ComponentOptions, *,
                    cost_model: Any = None) -> tuple[ComponentPlan, ...]:
    """The top_k fastest component plans that fit, best first; ValueError when none does."""
    cost = cost_model or importlib.import_module("autoplan.cost")
    groups = device_groups(graph)
    check_options(graph, groups, cluster, options)
    ms = options.num_microbatches or tuple(m for m in range(1, options.max_microbatches + 1)
                                           if options.global_batch % m == 0)
    cands: dict[tuple[int, int], tuple[Plan, ...]] = {}
    found: list[ComponentPlan] = []
    layouts = [options.devices] if options.devices else splits(cluster.num_devices, len(groups),
                                                               cluster.devices_per_node)
    for sizes in layouts:
        for g, n in enumerate(sizes):
            if (g, n) not in cands:
                cands[g, n] = _candidates(groups[g], sub_cluster(cluster, n), options, cost)
        for m in ms:
            plan = _best_for(graph, groups, cluster, sizes, m, cands, cost)
            if plan is not None:
                found.append(plan)
    if not found:
        raise ValueError(_nothing_fits(graph, groups, cluster, options))
    ranked = sorted(found, key=lambda p: (float(f"{p.estimate.step_time_s:.9g}"), p.num_microbatches))
    return tuple(replace(p, rank=i + 1) for i, p in enumerate(ranked[:options.top_k]))


def _best_for(graph: ComponentGraph, groups: tuple[DeviceGroupSpec, ...], cluster: ClusterSpec,
              sizes: tuple[int, ...], m: int, cands: dict, cost: Any) -> ComponentPlan | None:
    """The fastest fitting plan of one device split and microbatch count: each group's fastest fitting
    candidate (its own step time decides; the step is monotone in every group's slot and tail)."""
    feeds = _feeding_groups(graph, groups)
    chosen: list[_Timed] = []
    for g, n in enumerate(sizes):
        sub = sub_cluster(cluster, n)
        timed = [t for p in cands[g, n] if (t := retime(groups[g], sub, p, m, feeds=g in feeds, cost=cost))
                 and t.fits]
        if not timed:
            return None
        chosen.append(min(timed, key=lambda t: t.slot_s * m + t.tail_s))
    return compose(graph, groups, cluster, sizes, m, chosen, cost)


def _feeding_groups(graph: ComponentGraph, groups: tuple[DeviceGroupSpec, ...]) -> set[int]:
    of = {name: i for i, g in enumerate(groups) for name in g.components}
    return {of[e.src] for e in graph.edges if of[e.src] != of[e.dst]}


def check_options(graph: ComponentGraph, groups: tuple[DeviceGroupSpec, ...], cluster: ClusterSpec,
                  options: ComponentOptions) -> None:
    """The mistakes a caller can make, each one line, before any search runs."""
    b = options.global_batch
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        raise ValueError(f"global_batch must be a positive integer, got {b!r}")
    if len(groups) < 2:
        raise ValueError(f"{graph.model_name} has one component with repeated blocks: plan it with "
                         f"autoplan.autoplan(), which splits a single chain")
    if len(groups) > cluster.num_devices:
        raise ValueError(f"{len(groups)} device groups ({', '.join('+'.join(g.components) for g in groups)}) "
                         f"need at least {len(groups)} devices; the cluster has {cluster.num_devices}")
    if options.devices is not None:
        d = tuple(options.devices)
        if len(d) != len(groups) or sum(d) != cluster.num_devices or min(d) < 1:
            raise ValueError(f"devices={list(d)}: give {len(groups)} positive counts (groups "
                             f"{[' + '.join(g.components) for g in groups]}) summing to {cluster.num_devices}")
    for m in options.num_microbatches or ():
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 or b % m:
            raise ValueError(f"num_microbatches {m!r} must be a positive divisor of global batch {b}")
    unknown = sorted(set(options.group_search) - {c.name for c in graph.components})
    if unknown:
        raise ValueError(f"group_search names unknown components {unknown}: known are "
                         f"{[c.name for c in graph.components]}")
    fields = {f.name for f in dataclasses.fields(SearchOptions)} - {"global_batch", "top_k"}
    for opts in (options.search, *options.group_search.values()):
        bad = sorted(set(opts) - fields)
        if bad:
            raise ValueError(f"unknown search option(s) {bad}: known are {sorted(fields)}")


def _nothing_fits(graph: ComponentGraph, groups: tuple[DeviceGroupSpec, ...], cluster: ClusterSpec,
                  options: ComponentOptions) -> str:
    need = " + ".join(f"{'+'.join(g.components)} ({g.graph.num_params / 1e6:,.1f} M params)" for g in groups)
    return (f"no split of {cluster.num_devices} devices into {len(groups)} groups fits {graph.model_name} at "
            f"global batch {options.global_batch}: {need}; add devices, allow recompute / zero, or use a global "
            f"batch with more divisors")
