"""The pipeline schedule as actions in time: which pipeline rank runs which forward (F), backward (B,
or I for the input-gradient half under zero bubble), weight gradient (W) and send (C), when.

Pure. Each rank runs its actions in the order torch.distributed.pipelining's schedule gives it (the
orders below are rewritten from torch 2.13's schedules.py: ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble via _get_1f1b_rank_ops, ScheduleZBVZeroBubble),
each action as soon as its rank is free and its inputs have arrived: F(s, j) after F(s-1, j); B or I
(s, j) after F(s, j) and B/I(s+1, j); W(s, j) after I(s, j). A stage boundary between two ranks costs a
send on the sending rank (the cost model charges the hop to the sender, estimate_config). Ranks are
placed by plan.layout.stage_ranks, as the executor places them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoplan.cluster.types import ClusterSpec
from autoplan.cost import comm
from autoplan.cost.layer import estimate_layer
from autoplan.cost.stages import balanced_stages
from autoplan.graph.types import LayerGraph
from autoplan.plan.layout import stage_ranks
from autoplan.plan.types import ParallelConfig, Plan, Schedule

Order = list[tuple[str, int, int]]  # (kind, stage, microbatch) in the order a rank runs them


@dataclass(frozen=True, slots=True)
class Action:
    rank: int  # pipeline rank
    kind: str  # F, B, I, W, C (send after the action it follows)
    stage: int
    microbatch: int
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTimes:
    """Per stage (model order), per microbatch: forward, full backward (input + weight gradient), its
    weight-gradient part, and the send to the next stage (0 when the next stage is on the same rank)."""

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    weight_s: tuple[float, ...]
    hop_s: tuple[float, ...]


def _gpipe(rank: int, m: int) -> Order:
    return [("F", rank, j) for j in range(m)] + [("B", rank, j) for j in range(m)]


def _one_f_one_b(rank: int, p: int, m: int) -> Order:
    """Schedule1F1B: min(m, p - rank) forwards, then backward / forward pairs, then the backwards."""
    warm = min(m, p - rank)
    order: Order = [("F", rank, j) for j in range(warm)]
    for j in range(m):
        order.append(("B", rank, j))
        if warm + j < m:
            order.append(("F", rank, warm + j))
    return order


def _looped(rank: int, p: int, v: int, m: int, zero_bubble: bool) -> Order:
    """ScheduleInterleaved1F1B (zero_bubble False) and ScheduleInterleavedZeroBubble (True): torch's
    _get_warmup_ops and _get_1f1b_rank_ops, with its rounds of m // max(1, m // p) microbatches."""
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(f"the looped schedules need the {m} microbatches to be a multiple of {rounds} rounds")
    per_round = m // rounds
    warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), m * v)
    total = m * v

    def fwd_stage(step: int) -> int:
        return (step // per_round) % v * p + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warm) // per_round) % v) * p + rank

    counts: dict[tuple[str, int], int] = {}

    def take(kind: str, stage: int) -> tuple[str, int, int]:
        j = counts.get((kind, stage), 0)
        counts[(kind, stage)] = j + 1
        return kind, stage, j

    order: Order = []
    backward_steps: list[int] = []
    weights = 0  # W actions issued, in the order of the backward steps
    for step in range(total + warm):
        if step < total:
            order.append(take("F", fwd_stage(step)))
        if step >= warm:
            order.append(take("I" if zero_bubble else "B", bwd_stage(step)))
            backward_steps.append(step)
            if zero_bubble and step - warm >= rank:  # W deferred by `rank` microbatches
                order.append(take("W", bwd_stage(backward_steps[weights])))
                weights += 1
    while zero_bubble and weights < len(backward_steps):
        order.append(take("W", bwd_stage(backward_steps[weights])))
        weights += 1
    return order


def _zbv(rank: int, p: int, m: int) -> Order:
    """ScheduleZBVZeroBubble: chunk 0 = stage rank, chunk 1 = stage 2p - 1 - rank."""
    n = max(2 * p - 1, m)
    s0, s1 = rank, 2 * p - 1 - rank
    c = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}
    order: Order = []

    def put(kind: str, stage: int, key: str) -> None:
        order.append((kind, stage, c[key]))
        if kind != "W" or key.startswith("w"):
            c[key] += 1

    for _ in range(2 * (p - rank) - 1):
        put("F", s0, "f0")
    for _ in range(rank):
        put("F", s1, "f1")
        put("F", s0, "f0")
    for _ in range(p - rank):
        put("F", s1, "f1")
        order += [("I", s1, c["b1"]), ("W", s1, c["b1"])]
        c["b1"] += 1
    while c["f1"] < c["f0"] or c["f0"] < n:
        if c["f0"] < n:
            put("F", s0, "f0")
        order += [("I", s0, c["b0"]), ("W", s0, c["b0"])]
        c["b0"] += 1
        put("F", s1, "f1")
        order += [("I", s1, c["b1"]), ("W", s1, c["b1"])]
        c["b1"] += 1
    w0, w1 = c["b0"], c["b1"]
    for _ in range(rank):
        put("I", s0, "b0")
        put("I", s1, "b1")
    for _ in range(p - rank):
        put("I", s0, "b0")
        order.append(("W", s0, w0))
        w0 += 1
    order += [("W", s1, j) for j in range(w1, c["b1"])] + [("W", s0, j) for j in range(w0, c["b0"])]
    return [a for a in order if a[2] < m]  # torch drops the padding microbatches past m


def rank_orders(config: ParallelConfig, m: int) -> dict[int, Order]:
    """Each pipeline rank's actions in the order its schedule runs them, for m microbatches."""
    p, v = config.pp, config.virtual_stages
    if m < 1:
        raise ValueError(f"need at least one microbatch, got {m}")
    out = {}
    for r in range(p):
        if config.schedule is Schedule.GPIPE:
            out[r] = _gpipe(r, m)
        elif config.schedule is Schedule.ONE_F_ONE_B:
            out[r] = _one_f_one_b(r, p, m)
        elif config.schedule is Schedule.ZERO_BUBBLE and v == 2:
            out[r] = _zbv(r, p, m)
        else:
            out[r] = _looped(r, p, v, m, config.schedule is Schedule.ZERO_BUBBLE)
    return out


def _duration(kind: str, stage: int, times: StageTimes) -> float:
    if kind == "F":
        return times.fwd_s[stage]
    if kind == "B":
        return times.bwd_s[stage]
    if kind == "I":
        return max(times.bwd_s[stage] - times.weight_s[stage], 0.0)
    return times.weight_s[stage]


def _key(kind: str, stage: int, j: int) -> tuple[str, int, int]:
    """What an action produces: F the activations of (stage, j), B and I its input gradient ('G')."""
    return ("G" if kind in ("B", "I") else kind, stage, j)


def _inputs(kind: str, stage: int, j: int, last: int) -> list[tuple[str, int, int]]:
    """The outputs this action waits for."""
    if kind == "F":
        return [("F", stage - 1, j)] if stage > 0 else []
    if kind == "W":
        return [("G", stage, j)]
    return [("F", stage, j)] + ([("G", stage + 1, j)] if stage < last else [])


def _hop(kind: str, stage: int, rank: int, placement: Sequence[int], times: StageTimes) -> float:
    """The send after this action: F to stage + 1, B / I to stage - 1, when that stage is elsewhere."""
    if kind == "F" and stage + 1 < len(placement) and placement[stage + 1] != rank:
        return times.hop_s[stage]
    if kind in ("B", "I") and stage > 0 and placement[stage - 1] != rank:
        return times.hop_s[stage - 1]
    return 0.0


def simulate(config: ParallelConfig, m: int, times: StageTimes) -> tuple[Action, ...]:
    """The actions of one step's pipeline schedule, each at its earliest start (see the module doc)."""
    n = config.pp * config.virtual_stages
    for name in ("fwd_s", "bwd_s", "weight_s", "hop_s"):
        if len(getattr(times, name)) != n:
            raise ValueError(f"{name} has {len(getattr(times, name))} entries: give one per stage ({n})")
    placement = stage_ranks(config)
    orders = rank_orders(config, m)
    free, pos = [0.0] * config.pp, [0] * config.pp
    ready: dict[tuple[str, int, int], float] = {}  # when an output is available to its consumer
    done: list[Action] = []
    while any(pos[r] < len(orders[r]) for r in orders):
        moved = False
        for r, order in orders.items():
            while pos[r] < len(order):
                kind, s, j = order[pos[r]]
                deps = _inputs(kind, s, j, n - 1)
                if any(d not in ready for d in deps):
                    break
                start = max([free[r]] + [ready[d] for d in deps])
                end = start + _duration(kind, s, times)
                done.append(Action(r, kind, s, j, start, end))
                hop = _hop(kind, s, r, placement, times)
                if hop > 0:
                    done.append(Action(r, "C", s, j, end, end + hop))
                free[r] = ready[_key(kind, s, j)] = end + hop
                pos[r] += 1
                moved = True
        if not moved:
            raise ValueError(f"schedule {config.schedule.value} deadlocks in the simulation (an order bug)")
    return tuple(done)


def makespan(actions: Sequence[Action]) -> float:
    return max((a.end_s for a in actions), default=0.0)


def bubbles(actions: Sequence[Action], num_ranks: int) -> dict[int, float]:
    """Idle seconds per pipeline rank before the makespan."""
    span = makespan(actions)
    busy: Mapping[int, float] = {r: sum(a.end_s - a.start_s for a in actions if a.rank == r) for r in range(num_ranks)}
    return {r: span - b for r, b in busy.items()}


def stage_times(graph: LayerGraph, cluster: ClusterSpec, plan: Plan) -> StageTimes:
    """Per-stage times of a plan from the cost model's per-layer costs (estimate_layer), as
    estimate_config sums them: forward = compute + the forward's tp / cp / ep communication, backward =
    the rest of the layer's time (recompute included), its weight-gradient part, and the pipeline send
    of the stage's last layer's output (comm.p2p_s) where the next stage runs on another rank. The
    data-parallel traffic is not per stage: it is in the step's tail (see timeline_of)."""
    config = plan.config
    stages = tuple(s.layer_names for s in plan.stages) or balanced_stages(graph, config)
    by_name = {layer.name: layer for layer in graph.layers}
    placement = stage_ranks(config)
    crosses = comm.group_placement(config, ("pp",), cluster.devices_per_node).crosses_nodes
    fwd, bwd, weight, hop = [], [], [], []
    for i, names in enumerate(stages):
        costs = [estimate_layer(by_name[n], cluster, config, plan.recompute_for(n), seq_len=graph.seq_len,
                                graph_microbatch=graph.microbatch) for n in names]
        fwd.append(sum(c.forward_s for c in costs))
        bwd.append(sum(c.time_s for c in costs) - fwd[-1])
        weight.append(sum(c.bwd_weight_s for c in costs))
        last = i + 1 == len(stages) or placement[i + 1] == placement[i] or not costs
        hop.append(0.0 if last else comm.p2p_s(costs[-1].output_bytes, crosses, cluster))
    return StageTimes(fwd_s=tuple(fwd), bwd_s=tuple(bwd), weight_s=tuple(weight), hop_s=tuple(hop))


def timeline_of(graph: LayerGraph, cluster: ClusterSpec, plan: Plan) -> tuple[tuple[Action, ...], float]:
    """The predicted schedule of one step of `plan` and its tail: the predicted step time minus the
    simulated pipeline (the data-parallel gradient reduction, ZeRO's gathers and the optimizer)."""
    m = plan.config.num_microbatches(plan.global_batch)
    actions = simulate(plan.config, m, stage_times(graph, cluster, plan))
    return actions, max(plan.estimate.step_time_s - makespan(actions), 0.0)


def _core_share(cores: float, ranks: float, oversubscribed: float) -> float:
    """A core's throughput per process: whole up to one process per core, else cores / ranks of it at the
    oversubscribed efficiency (the profile's cpu_oversubscribed_efficiency; as cluster/cpu_share.py)."""
    return 1.0 if ranks <= cores else cores / ranks * oversubscribed


def shared_cores_makespan(config: ParallelConfig, m: int, times: StageTimes, *, cores: float,
                          ranks: int, oversubscribed: float = 1.0) -> float:
    """The schedule's time when `ranks` single-threaded rank processes share `cores` CPU cores and a
    rank waiting for its input uses none (gloo blocks in its wait: measured here, a rank waiting 2 s in
    recv used 4 ms of CPU). `times` are at the all-busy share of a core (_core_share of all ranks); the
    ranks / pp pipeline replicas run in step. Processor sharing (a fluid model): each running action
    progresses at the share of (running ranks of a pipeline x replicas), so a pipeline's fill and
    drain, when few ranks work, run faster than its steady state."""
    full = _core_share(cores, ranks, oversubscribed)  # the share the given times were measured at
    replicas = max(1, ranks // config.pp)
    placement, n = stage_ranks(config), config.pp * config.virtual_stages
    orders = rank_orders(config, m)
    pos, left = [0] * config.pp, [0.0] * config.pp
    running: set[int] = set()
    done: set[tuple[str, int, int]] = set()
    t = 0.0
    while True:
        for r, order in orders.items():
            if r not in running and pos[r] < len(order):
                kind, s, j = order[pos[r]]
                if all(d in done for d in _inputs(kind, s, j, n - 1)):
                    left[r] = (_duration(kind, s, times) + _hop(kind, s, r, placement, times)) * full
                    running.add(r)
        if not running:
            break
        rate = _core_share(cores, len(running) * replicas, oversubscribed)
        dt = min(left[r] for r in running) / rate
        t += dt
        for r in sorted(running):
            left[r] -= dt * rate
            if left[r] <= 1e-15:
                kind, s, j = orders[r][pos[r]]
                done.add(_key(kind, s, j))
                pos[r] += 1
                running.discard(r)
    if any(pos[r] < len(orders[r]) for r in orders):
        raise ValueError(f"schedule {config.schedule.value} deadlocks in the simulation (an order bug)")
    return t


def shared_cores_pipeline_time_s(config: ParallelConfig, m: int, fwd_s: Sequence[float], bwd_s: Sequence[float],
                                 weight_s: Sequence[float], *, cores: float, ranks: int,
                                 oversubscribed: float = 1.0) -> float:
    """pipeline_time_s for CPU ranks sharing `cores` cores (shared_cores_makespan), from per pipeline
    rank times (a rank's chunks summed, sends included, split evenly over its chunks), at least the
    slowest rank's m microbatches at the all-busy share: the steady state runs every rank."""
    placement = stage_ranks(config)
    per = [placement.count(r) for r in range(config.pp)]
    times = StageTimes(fwd_s=tuple(fwd_s[r] / per[r] for r in placement),
                       bwd_s=tuple(bwd_s[r] / per[r] for r in placement),
                       weight_s=tuple(weight_s[r] / per[r] for r in placement), hop_s=(0.0,) * len(placement))
    slowest = max(f + b for f, b in zip(fwd_s, bwd_s))
    return max(shared_cores_makespan(config, m, times, cores=cores, ranks=ranks, oversubscribed=oversubscribed),
               m * slowest)
