"""Heterogeneous clusters in the cost model: which node group each pipeline rank runs on, the cluster
each rank is priced on, the point-to-point hop between groups, and the default split by group speed.

Ranks are numbered group after group (ClusterSpec.groups) and pp is the outermost mesh axis, so pipeline
rank r holds global ranks [r R, (r + 1) R) with R = dp * ep * cp * tp. Every pipeline rank must lie in
one group (R divides each group's device count); its layers are then costed on that group's device and
links, its memory against that group's capacity (as Metis, Um et al., ATC'24, and Sailor, Strati et al.
2024, cost each stage on the devices it is placed on).
"""

from __future__ import annotations

from autoplan.cluster.types import ClusterSpec, LinkSpec
from autoplan.graph.types import LayerGraph, LayerRole
from autoplan.plan.layout import num_stages, split_by_counts, stage_ranks
from autoplan.plan.types import ParallelConfig


def stage_rank_errors(cluster: ClusterSpec, config: ParallelConfig) -> tuple[str, ...]:
    """Why `config`'s pipeline ranks cannot each sit in one node group (empty when they can, and always
    for a homogeneous cluster): R = dp*ep*cp*tp must divide every group's devices, tp a node of each."""
    out = []
    ranks = config.dp * config.ep * config.cp * config.tp
    for group in cluster.groups:
        if group.num_devices % ranks:
            out.append(f"a pipeline rank's dp*ep*cp*tp = {ranks} devices do not divide group {group.name!r}'s "
                       f"{group.num_devices}: each pipeline rank must lie in one node group; choose degrees "
                       f"whose product divides every group's device count")
        if config.tp > group.spec.devices_per_node:
            out.append(f"tp={config.tp} is larger than a node of group {group.name!r} "
                       f"({group.spec.devices_per_node} devices): use tp <= {group.spec.devices_per_node}")
    return tuple(out)


def rank_groups(cluster: ClusterSpec, config: ParallelConfig) -> tuple[int, ...]:
    """The node group (index into cluster.groups) of each pipeline rank; all 0 when homogeneous."""
    if not cluster.groups:
        return (0,) * config.pp
    errors = stage_rank_errors(cluster, config)
    if errors:
        raise ValueError(errors[0])
    per_rank = config.dp * config.ep * config.cp * config.tp
    return tuple(cluster.group_of_rank(r * per_rank) for r in range(config.pp))


def rank_clusters(cluster: ClusterSpec, config: ParallelConfig) -> tuple[ClusterSpec, ...]:
    """The cluster each pipeline rank is priced on: its group's spec (the cluster itself when
    homogeneous). Collectives inside a pipeline rank (tp, cp, ep, dp) then run on that group's links."""
    if not cluster.groups:
        return (cluster,) * config.pp
    return tuple(cluster.groups[g].spec for g in rank_groups(cluster, config))


def link_p2p_s(nbytes: float, link: LinkSpec) -> float:
    """Send/recv over one link: alpha + S / (BW * p2p_bw_fraction), as comm.p2p_s."""
    if nbytes <= 0:
        return 0.0
    return link.latency_s + nbytes / (link.bw_bytes_per_s * link.p2p_bw_fraction)


def crosses_groups(cluster: ClusterSpec, config: ParallelConfig, a: int, b: int) -> bool:
    """Whether pipeline ranks a and b sit in different node groups (their hop takes inter_group)."""
    groups = rank_groups(cluster, config)
    return bool(cluster.groups) and groups[a] != groups[b]


def speed_split(graph: LayerGraph, config: ParallelConfig, block_time_s: tuple[float, ...],
                max_blocks: tuple[float, ...] | None = None) -> tuple[tuple[str, ...], ...]:
    """The default split on a heterogeneous cluster: blocks dealt to the pipeline ranks in proportion to
    their speed, 1 / block_time_s[r] (the time of one block on rank r's device), no rank given more than
    max_blocks[r] (what its memory holds) while others have room: a rank at its cap keeps it and the rest
    is dealt again over the others (water filling); then by largest remainder, each rank at least its
    virtual_stages chunks' one block each; a rank's blocks split evenly over its chunks (earlier chunks
    take the remainder). Metis (Um et al., ATC'24, section 5) starts its stage search from the same
    device-proportional layer partition. The search then refines it (DP / ILP, search/stages.py)."""
    names = [layer.name for layer in graph.layers]
    flags = [layer.role is LayerRole.BLOCK for layer in graph.layers]
    total, v = sum(flags), config.virtual_stages
    speed = [1.0 / max(t, 1e-30) for t in block_time_s]
    cap = list(max_blocks) if max_blocks and sum(max_blocks) >= total else [float(total)] * config.pp
    counts = _round(_water_fill(total, speed, cap), total, v, cap)
    placement = stage_ranks(config)
    per_stage = [0] * num_stages(config)
    for r in range(config.pp):
        mine = [q for q, owner in enumerate(placement) if owner == r]
        base, extra = divmod(counts[r], len(mine))
        for k, q in enumerate(mine):
            per_stage[q] = base + (1 if k < extra else 0)
    return split_by_counts(names, flags, per_stage)


def _round(share: list[float], total: int, v: int, cap: list[float]) -> list[int]:
    """Whole blocks: each share rounded down (at least v), then the missing blocks one each to the largest
    remainders among ranks under their cap (then to any), the surplus taken from the largest counts."""
    counts = [max(v, int(x)) for x in share]
    by_remainder = sorted(range(len(share)), key=lambda r: int(share[r]) - share[r])
    while sum(counts) < total:
        room = [r for r in by_remainder if counts[r] + 1 <= cap[r]] or by_remainder
        counts[room[0]] += 1
        by_remainder.append(by_remainder.pop(by_remainder.index(room[0])))
    while sum(counts) > total:
        r = max((r for r in range(len(counts)) if counts[r] > v), key=lambda r: counts[r])
        counts[r] -= 1
    return counts


def _water_fill(total: float, speed: list[float], cap: list[float]) -> list[float]:
    """Shares of `total` proportional to speed, none above its cap (the excess dealt to the others)."""
    share = [0.0] * len(speed)
    free, left = set(range(len(speed))), float(total)
    while free:
        weight = sum(speed[r] for r in free)
        trial = {r: left * speed[r] / weight for r in free}
        over = [r for r in free if trial[r] > cap[r]]
        if not over:
            for r, x in trial.items():
                share[r] = x
            break
        for r in over:
            share[r] = cap[r]
            left -= cap[r]
            free.discard(r)
    return share


def default_split(graph: LayerGraph, cluster: ClusterSpec, config: ParallelConfig,
                  global_batch: int | None = None) -> tuple[tuple[str, ...], ...]:
    """The split estimate_config prices when given none: the balanced split (cost.stages) on a homogeneous
    cluster; on a heterogeneous one speed_split, with each rank's mean block time on its own group and,
    given the global batch, the blocks its memory holds (_max_blocks)."""
    from autoplan.cost.layer import estimate_layer
    from autoplan.cost.stages import balanced_stages

    if not cluster.groups or not graph.blocks:
        return balanced_stages(graph, config)
    views = rank_clusters(cluster, config)
    costs = [[estimate_layer(layer, view, config, config.recompute, seq_len=graph.seq_len,
                             graph_microbatch=graph.microbatch) for layer in graph.layers] for view in views]
    block = [i for i, layer in enumerate(graph.layers) if layer.role is LayerRole.BLOCK]
    times = tuple(sum(c[i].time_s for i in block) / len(block) for c in costs)
    caps = _max_blocks(graph, views, config, costs, global_batch) if global_batch else None
    return speed_split(graph, config, times, caps)


def _max_blocks(graph: LayerGraph, views, config: ParallelConfig, costs, global_batch: int) -> tuple[float, ...]:
    """Blocks each pipeline rank's memory holds: (device memory - runtime reserve - the embedding on the
    first rank and the head on the last) / (model states of a block + its activations times the
    microbatches the rank holds in flight): memory.model_state_bytes and pipeline.in_flight_microbatches,
    the functions estimate_config's memory uses (less its working set and ZeRO-3's gathered layers)."""
    from autoplan.cost.memory import model_state_bytes
    from autoplan.cost.pipeline import in_flight_microbatches

    m = config.num_microbatches(global_batch)
    placement = stage_ranks(config)
    block = [i for i, layer in enumerate(graph.layers) if layer.role is LayerRole.BLOCK]
    out = []
    for r, (view, c) in enumerate(zip(views, costs)):
        held = in_flight_microbatches(config.schedule, config.pp, config.virtual_stages, m, r)
        need = [sum(model_state_bytes(x.grad_param_count, x.expert_param_count, config)) + held * x.act_mem_bytes
                for x in c]
        pinned = sum(need[:block[0]]) if r == placement[0] else 0.0
        pinned += sum(need[block[-1] + 1:]) if r == placement[-1] else 0.0
        per_block = sum(need[i] for i in block) / len(block)
        room = view.device.mem_bytes - view.device.runtime_reserve_bytes - pinned
        out.append(max(room, 0.0) / max(per_block, 1.0))
    return tuple(out)
