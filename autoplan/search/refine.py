"""Per-layer recompute and the pipeline stage split for one configuration: build the StageProblem from
the cost model's per-layer costs, solve it (exactly by rank balancing or the DP where they apply, else the
ILP within a fixed node limit: no wall-clock budget anywhere), decode it into stages and overrides.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from autoplan.cluster.types import ClusterSpec
from autoplan.cost.reserve import block_hidden
from autoplan.graph.types import LayerGraph, LayerRole
from autoplan.plan.layout import stage_ranks
from autoplan.plan.types import ParallelConfig, Recompute
from autoplan.search.balance import solve_balanced
from autoplan.search.hetero import with_rank_costs
from autoplan.search.ilp import solve_ilp
from autoplan.search.space import SCHEDULES
from autoplan.search.stages import StageProblem, StageSolution, evaluate, fits, solve_dp
from autoplan.search.surrogate import inflight


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """A decoded solution: the config (recompute = the most common mode), stages and overrides."""

    config: ParallelConfig
    stages: tuple[tuple[str, ...], ...]
    layer_recompute: tuple[tuple[str, Recompute], ...]
    solution: StageSolution


def _static_bytes(cost: Any, config: ParallelConfig, cost_model: Any, dtype: str) -> float:
    """Weights, gradients and optimizer states of one layer under the engine's ZeRO layout: the cost
    model's own rule (cost.memory.layer_state_bytes)."""
    return cost_model.layer_state_bytes(cost, config, dtype=dtype)


def build_problem(graph: LayerGraph, cluster: ClusterSpec, config: ParallelConfig, *, global_batch: int,
                  modes: tuple[Recompute, ...], cost_model: Any) -> tuple[StageProblem, list[list[str]]]:
    """The stage problem of `config` and the layer names of each run (in model order)."""
    blocks = [i for i, layer in enumerate(graph.layers) if layer.role is LayerRole.BLOCK]
    lo, hi = blocks[0], blocks[-1]
    runs: list[list[str]] = []
    costs: dict[tuple[str, Recompute], Any] = {}

    def layer_cost(i: int, mode: Recompute) -> Any:
        layer = graph.layers[i]
        key = (layer.kind, mode)
        if key not in costs:
            costs[key] = cost_model.estimate_layer(layer, cluster, replace(config, recompute=mode), mode,
                                                   seq_len=graph.seq_len)
        return costs[key]

    run_first: list[int] = []
    for i in range(lo, hi + 1):
        if runs and graph.layers[i].kind == graph.layers[run_first[-1]].kind:
            runs[-1].append(graph.layers[i].name)
        else:
            runs.append([graph.layers[i].name])
            run_first.append(i)
    m = config.num_microbatches(global_batch)
    f = inflight(np.array([SCHEDULES.index(config.schedule)]), config.pp, config.virtual_stages, np.array([m]))[0]
    pinned = [[layer_cost(i, Recompute.NONE) for i in rng] for rng in (range(lo), range(hi + 1, len(graph.layers)))]
    work = max(layer_cost(i, mode).work_mem_bytes if hasattr(layer_cost(i, mode), "work_mem_bytes") else 0
               for i in run_first for mode in modes)
    # the reserve, NCCL buffers and ZeRO-3's working set (cost.memory.fixed_memory_bytes)
    largest = max(c.param_count for c in costs.values())
    hidden = block_hidden(graph.layers)
    fixed = cost_model.fixed_memory_bytes(config, cluster, max_layer_params=largest, max_param_numel=largest,
                                          seq_len=graph.seq_len, hidden=hidden)
    dtype = cluster.dtype

    def static(c: Any) -> float:
        return _static_bytes(c, config, cost_model, dtype)

    problem = StageProblem(
        run_sizes=tuple(len(r) for r in runs),
        time_s=tuple(tuple(layer_cost(i, mode).time_s for mode in modes) for i in run_first),
        static_bytes=tuple(static(layer_cost(i, modes[0])) for i in run_first),
        act_bytes=tuple(tuple(float(layer_cost(i, mode).act_mem_bytes) for mode in modes) for i in run_first),
        num_ranks=config.pp, virtual_stages=config.virtual_stages, inflight=tuple(float(x) for x in f),
        stage_rank=stage_ranks(config),
        mem_limit_bytes=float(cluster.device.mem_bytes - fixed - work),
        first_time_s=sum(c.time_s for c in pinned[0]),
        first_static_bytes=sum(static(c) for c in pinned[0]),
        first_act_bytes=float(sum(c.act_mem_bytes for c in pinned[0])),
        last_time_s=sum(c.time_s for c in pinned[1]),
        last_static_bytes=sum(static(c) for c in pinned[1]),
        last_act_bytes=float(sum(c.act_mem_bytes for c in pinned[1])),
    )
    # heterogeneous clusters: each rank's times and memory limit on its own node group (search/hetero.py)
    problem = with_rank_costs(problem, graph, cluster, config, modes, cost_model, run_first,
                              fixed - cluster.device.runtime_reserve_bytes + work)
    return problem, runs


def decode(graph: LayerGraph, config: ParallelConfig, runs: list[list[str]], solution: StageSolution,
           modes: tuple[Recompute, ...]) -> Layout:
    """Stages as layer names (pinned layers on the first and last stage) and the per-layer modes."""
    blocks = [i for i, layer in enumerate(graph.layers) if layer.role is LayerRole.BLOCK]
    head = [layer.name for layer in graph.layers[:blocks[0]]]
    tail = [layer.name for layer in graph.layers[blocks[-1] + 1:]]
    cursor = [0] * len(runs)
    stages: list[list[str]] = []
    chosen: list[tuple[str, Recompute]] = []
    for stage in solution.counts:
        names: list[str] = []
        for j, per_mode in enumerate(stage):
            for mode, count in zip(modes, per_mode):
                for name in runs[j][cursor[j]:cursor[j] + count]:
                    names.append(name)
                    chosen.append((name, mode))
                cursor[j] += count
        stages.append(names)
    stages[0] = head + stages[0]
    stages[-1] = stages[-1] + tail
    order = {layer.name: layer.index for layer in graph.layers}
    for names in stages:
        names.sort(key=order.__getitem__)  # the modes were grouped per stage; keep model order
    common = Counter(mode for _, mode in chosen).most_common(1)[0][0]
    overrides = tuple(sorted(((n, r) for n, r in chosen if r is not common), key=lambda x: order[x[0]]))
    return Layout(config=replace(config, recompute=common), stages=tuple(tuple(s) for s in stages),
                  layer_recompute=overrides, solution=solution)


def _near_ideal(problem: StageProblem, config: ParallelConfig, modes: tuple[Recompute, ...], graph: LayerGraph,
                cost_model: Any, tolerance: float = 0.005) -> bool:
    """Whether the balanced split with no recompute fits and is within `tolerance` of the lower bound
    (all work, with each run's fastest option, spread evenly over the ranks)."""
    if Recompute.NONE not in modes or problem.rank_time_s:  # unequal ranks: the even split is no bound
        return False
    total = problem.first_time_s + problem.last_time_s + sum(
        n * min(t) for n, t in zip(problem.run_sizes, problem.time_s))
    bound = max(total / problem.num_ranks, problem.first_time_s, problem.last_time_s)
    blocks = {layer.name for layer in graph.blocks}
    run_of = {name: j for j, run in enumerate(_runs_of(problem, graph)) for name in run}
    none = modes.index(Recompute.NONE)
    counts = []
    for stage in cost_model.balanced_stages(graph, config):
        per_run = [[0] * problem.num_options for _ in problem.run_sizes]
        for name in stage:
            if name in blocks:
                per_run[run_of[name]][none] += 1
        counts.append(tuple(tuple(x) for x in per_run))
    try:
        current = evaluate(problem, tuple(counts))
    except ValueError:
        return False
    return fits(problem, current) and current.time_s <= bound * (1 + tolerance)


def _runs_of(problem: StageProblem, graph: LayerGraph) -> list[list[str]]:
    names = [layer.name for layer in graph.blocks]
    out, start = [], 0
    for size in problem.run_sizes:
        out.append(names[start:start + size])
        start += size
    return out


def solve_stages(problem: StageProblem) -> StageSolution | None:
    """The stage problem's optimum with no time limit: exact by rank balancing for one or two runs of identical
    blocks (balance.py, any chunks per rank and placement), exact by the DP for one chunk per rank; otherwise
    the ILP within its node limit, or the DP's (feasible, restricted) answer when HiGHS stops without one."""
    if len(problem.run_sizes) <= 2:
        return solve_balanced(problem)
    if problem.virtual_stages == 1:
        return solve_dp(problem)
    try:
        return solve_ilp(problem)
    except RuntimeError:  # stopped at the node limit without a solution
        return solve_dp(problem)


def refine(graph: LayerGraph, cluster: ClusterSpec, config: ParallelConfig, *, global_batch: int,
           modes: tuple[Recompute, ...], cost_model: Any) -> Layout | None:
    """The fastest stage split and per-layer recompute for `config` (None when no split fits)."""
    if not any(layer.role is LayerRole.BLOCK for layer in graph.layers):
        return None
    problem, runs = build_problem(graph, cluster, config, global_batch=global_batch, modes=modes,
                                  cost_model=cost_model)
    if config.recompute is Recompute.NONE and _near_ideal(problem, config, modes, graph, cost_model):
        return None  # already within 0.5 % of a perfectly even split with no recompute: nothing to gain
    solution = solve_stages(problem)
    return None if solution is None else decode(graph, config, runs, solution, modes)
