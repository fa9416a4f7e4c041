"""The step of a component plan from its groups' re-timed plans: hops on the edges, the pipeline across
groups (T = L + (M - 1) max t_g + max f_g, see search/components.py), the breakdown, memory and MFU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import networkx as nx

from autoplan.cluster.types import ClusterSpec
from autoplan.graph.types import ComponentGraph
from autoplan.plan.components import ComponentGroup, ComponentPlan, GroupEdge
from autoplan.plan.types import Breakdown, Estimate


def group_edges(graph: ComponentGraph, groups: tuple[Any, ...], cluster: ClusterSpec, sizes: tuple[int, ...],
                m: int, plans: list[Any], cost: Any) -> list[GroupEdge]:
    """Edges between groups with the bytes of one hand-off microbatch (B / M samples) and one hop.

    Each first-stage device of the receiving group takes its replica's rows (its cp shard): total /
    (dp ep cp); each of its tp ranks gets a copy, sent by the producer's last-stage devices: total * tp /
    (n_src / pp_src). The hop moves the larger of the two at p2p bandwidth, over the inter-node link
    unless both groups sit in one node (groups take consecutive ranks)."""
    of = {name: i for i, g in enumerate(groups) for name in g.components}
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    samples = plans[0].global_batch // m
    totals: dict[tuple[int, int], float] = {}
    for e in graph.edges:
        src, dst = of[e.src], of[e.dst]
        if src != dst:
            ratio = cost.layer.dtype_bytes(cluster.dtype) / graph.component(e.src).graph.dtype_bytes
            totals[src, dst] = totals.get((src, dst), 0.0) + e.activation_bytes * samples / graph.microbatch * ratio
    out = []
    for (src, dst), total in sorted(totals.items()):
        s, d = plans[src].config, plans[dst].config
        recv = total / (d.dp * d.ep * d.cp)
        send = total * d.tp / (sizes[src] / s.pp)
        dpn = cluster.devices_per_node
        crosses = offsets[src] // dpn != (offsets[dst] + sizes[dst] - 1) // dpn
        out.append(GroupEdge(src=src, dst=dst, activation_bytes=int(total),
                             hop_time_s=cost.p2p_s(max(send, recv), crosses, cluster)))
    return out


def compose(graph: ComponentGraph, groups: tuple[Any, ...], cluster: ClusterSpec, sizes: tuple[int, ...], m: int,
            chosen: list[Any], cost: Any) -> ComponentPlan:
    """The ComponentPlan of one split, microbatch count and chosen group plans."""
    plans = [t.plan for t in chosen]
    edges = group_edges(graph, groups, cluster, sizes, m, plans, cost)
    hops = [sum(e.hop_time_s for e in edges if i in (e.src, e.dst)) for i in range(len(groups))]
    slots = [t.slot_s + h for t, h in zip(chosen, hops)]
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(groups)))
    dag.add_edges_from((e.src, e.dst) for e in edges)
    fill = max(sum(slots[i] for i in path) for path in _paths(dag))
    b = max(range(len(groups)), key=slots.__getitem__)
    tail = max(range(len(groups)), key=lambda i: chosen[i].tail_s)
    step = fill + (m - 1) * slots[b] + chosen[tail].tail_s
    peaks = [t.plan.estimate.peak_mem_bytes + t.extra_act_bytes for t in chosen]
    estimate = _estimate(chosen, plans, b, tail, hops[b], m, fill - slots[b], step, peaks, cluster,
                         graph.components[-1].graph.seq_len)
    out_groups = tuple(ComponentGroup(components=g.components, first_rank=sum(sizes[:i]), num_devices=sizes[i],
                                      plan=plans[i], slot_time_s=slots[i], tail_time_s=chosen[i].tail_s,
                                      peak_mem_bytes=peaks[i]) for i, g in enumerate(groups))
    balance = " / ".join(f"{s * 1e3:.3g}" for s in slots)
    notes = ((f"slot per microbatch (ms) by group: {balance}; group {b} sets the pace, the other groups fill "
              f"and drain the pipeline ({(fill - slots[b]) * 1e3:.3g} ms)"),
             ("groups run GPipe-style: a group feeding another holds all microbatches' activations until "
              "their gradients return (charged in its memory)"))
    return ComponentPlan(model_name=graph.model_name, cluster_name=cluster.name, num_devices=cluster.num_devices,
                         global_batch=plans[0].global_batch, seq_len=graph.components[-1].graph.seq_len,
                         num_microbatches=m, groups=out_groups, edges=tuple(edges), estimate=estimate,
                         input_shapes=graph.input_shapes, notes=notes)


def _paths(dag: nx.DiGraph) -> list[list[int]]:
    """Every source-to-sink path of the groups' DAG (a handful of groups)."""
    sources = [n for n in dag if dag.in_degree(n) == 0]
    sinks = [n for n in dag if dag.out_degree(n) == 0]
    paths = [p for s in sources for t in sinks for p in nx.all_simple_paths(dag, s, t)]
    return paths + [[n] for n in dag if dag.degree(n) == 0]


def _estimate(chosen: list[Any], plans: list[Any], b: int, tail: int, hop_b: float, m: int, bubble: float,
              step: float, peaks: list[int], cluster: ClusterSpec, seq_len: int) -> Estimate:
    """The whole step: the pace group's causes (its own tails left out), its hops as pipeline sends, the
    fill and drain as bubble, the longest tail's optimizer and gradient sync."""
    pace = plans[b].estimate.breakdown
    last = plans[tail].estimate.breakdown
    causes = {k: v for k, v in pace.items() if k not in ("optimizer", "dp_comm")}
    causes["pp_comm"] += m * hop_b
    causes["pp_bubble"] += bubble
    breakdown = Breakdown(**causes, optimizer=last.optimizer, dp_comm=last.dp_comm)
    worst = max(range(len(plans)), key=peaks.__getitem__)
    mem = plans[worst].estimate.memory
    memory = replace(mem, activations=mem.activations + chosen[worst].extra_act_bytes)
    model_flops = sum(p.estimate.model_flops for p in plans)
    batch = plans[0].global_batch
    return Estimate(step_time_s=step, tokens_per_s=batch * seq_len / step,
                    mfu=model_flops / (step * cluster.peak_flops * cluster.num_devices),
                    peak_mem_bytes=peaks[worst], mem_capacity_bytes=cluster.device.mem_bytes,
                    fits=all(p <= cluster.device.mem_bytes for p in peaks), breakdown=breakdown,
                    memory=memory, model_flops=model_flops,
                    hardware_flops=sum(p.estimate.hardware_flops for p in plans))
