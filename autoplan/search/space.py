"""The search space: every ParallelConfig the planner considers, as numpy columns, and the options.

`enumerate_space` lists mesh shapes (pp * dp * ep * cp * tp = devices), microbatch sizes, schedules with
their virtual stages, recompute modes, ZeRO stages and sequence parallelism. It is honest: every
legal combination is listed; pruning happens in search.py on predicted costs, by stated rules.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from autoplan.cluster.types import ClusterSpec
from autoplan.graph.types import LayerGraph
from autoplan.plan.engine import (
    ZERO_STAGES,
    Engine,
    check_zero_stage,
    is_zero_stage,
    schedule_name,
    zero_runs_on,
)
from autoplan.plan.types import ParallelConfig, Recompute, Schedule
from autoplan.search.folding import expert_layouts, with_expert_layouts
from autoplan.search.hetero import stage_fits_groups

SCHEDULES = tuple(Schedule)
RECOMPUTES = tuple(Recompute)
COLUMNS = ("tp", "pp", "dp", "cp", "ep", "sp", "zero", "microbatch", "schedule", "virtual_stages", "recompute",
           "etp", "eep")  # etp / eep: 0 = the experts follow the dense layout (MoE folding: search/folding.py)


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchOptions:
    """What to search. A `None` degree is searched over; an int or a tuple fixes or restricts it."""

    global_batch: int
    top_k: int = 5
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    microbatch: tuple[int, ...] | None = None
    zero: tuple[int, ...] = ZERO_STAGES
    # the stages of `zero` searched where pp > 1 (None: all of them): an engine's zero_stages_with_pp
    # (engine_search_options)
    zero_with_pp: tuple[int, ...] | None = None
    # zero 0 only as the only parallel dimension (plan.engine.zero_runs_on): an engine's zero0_1d_only
    # (engine_search_options)
    zero0_1d_only: bool = False
    sp: tuple[bool, ...] = (False, True)
    schedules: tuple[Schedule, ...] = SCHEDULES
    recompute: tuple[Recompute, ...] = RECOMPUTES
    max_virtual_stages: int = 8
    max_tp: int | None = None  # tp at most this (with tp=None: every tp up to it)
    # MoE parallel folding (search/folding.py): expert tensor- and expert-parallel degrees of folded
    # candidates, beside the unfolded ones. etp defaults to 1, the folded layouts the executor runs
    etp: tuple[int, ...] | None = (1,)
    eep: tuple[int, ...] | None = None
    fold_experts: bool = True
    use_ilp: bool = True  # refine per-layer recompute and the stage split of the best candidates
    progress: bool = False  # a rich status line on stderr

    def __post_init__(self) -> None:
        if isinstance(self.global_batch, bool) or not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise ValueError(f"global_batch must be a positive integer, got {self.global_batch!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"top_k must be a positive integer, got {self.top_k!r}")
        for name in ("tp", "pp", "dp", "cp", "ep", "microbatch", "etp", "eep"):
            object.__setattr__(self, name, _as_degrees(name, getattr(self, name)))
        for name in ("max_virtual_stages", "max_tp"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self._check_zero()
        if not isinstance(self.zero0_1d_only, bool):
            raise ValueError(f"zero0_1d_only must be true or false, got {self.zero0_1d_only!r}")
        sp = _as_tuple(self.sp)
        if any(not isinstance(s, bool) for s in sp):
            raise ValueError(f"sp must be true or false, got {self.sp!r}")
        object.__setattr__(self, "sp", sp)
        object.__setattr__(self, "schedules", tuple(_parse(Schedule, s, "schedule") for s in _as_tuple(self.schedules)))
        object.__setattr__(self, "recompute", tuple(_parse(Recompute, r, "recompute mode") for r in _as_tuple(self.recompute)))


    def _check_zero(self) -> None:
        zero = _as_tuple(self.zero)
        for z in zero:
            check_zero_stage(z)
        object.__setattr__(self, "zero", zero)
        if self.zero_with_pp is None:
            return
        with_pp = _as_tuple(self.zero_with_pp)
        for z in with_pp:
            if not is_zero_stage(z):  # check_zero_stage's line names `zero`, which the caller may not have set
                raise ValueError(f"zero_with_pp must be ZeRO stages among 0, 1, 2, 3, got {z!r}")
            if z not in zero:
                raise ValueError(f"zero_with_pp {list(with_pp)} must be among zero {list(zero)}: the stages searched "
                                 f"with a pipeline are some of those searched")
        object.__setattr__(self, "zero_with_pp", with_pp)


def engine_search_options(options: dict[str, Any], engine: Engine) -> dict[str, Any]:
    """A caller's search options (SearchOptions fields) restricted to what `engine` runs, a forced value it
    does not run refused in one line before any work (search/api.py, before the cluster and the capture):
    zero (engine_zero), zero_with_pp (engine_zero_with_pp), zero0_1d_only (the engine's) and schedules
    (engine_schedules)."""
    pp = options.get("pp")
    given_pp = () if pp is None else _as_tuple(pp)
    degrees = [p for p in given_pp if isinstance(p, int) and not isinstance(p, bool)]
    pipelined = bool(given_pp) and len(degrees) == len(given_pp) and all(p > 1 for p in degrees)
    flat = bool(given_pp) and degrees == [1] * len(given_pp)  # no pipeline: no schedule or zero_with_pp runs
    out = dict(options)
    out["zero"] = engine_zero(options.get("zero"), engine, pipelined=pipelined)
    out["zero_with_pp"] = engine_zero_with_pp(options.get("zero_with_pp"), out["zero"], engine, flat=flat)
    out["zero0_1d_only"] = _zero0_1d_only(options.get("zero0_1d_only"), engine)
    out["schedules"] = engine_schedules(options.get("schedules"), engine, flat=flat)
    return out


def _zero0_1d_only(given: object, engine: Engine) -> object:
    """The caller's zero0_1d_only or the engine's (None, the CLI's unset flag: the engine's); a value that is
    not a bool is passed on for SearchOptions' one-line refusal (bool() of it would take 'no' as true)."""
    if given is None:
        return engine.zero0_1d_only
    return (given or engine.zero0_1d_only) if isinstance(given, bool) else given


def engine_zero(zero: object, engine: Engine, *, pipelined: bool = False) -> tuple:
    """The ZeRO stages to search under `engine`: its zero_stages when the caller gave none, else the caller's,
    each checked against them (Engine.check_zero: one line naming the stages the engine runs, before any
    pricing); `pipelined` (every pp the caller allows is > 1): against zero_stages_with_pp. Values that are not
    stages at all are left to SearchOptions' own message."""
    if zero is None:
        return engine.zero_stages
    given = _as_tuple(zero)
    for z in given:
        if is_zero_stage(z):
            engine.check_zero(z, pp=2 if pipelined else 1)
    return given


def engine_zero_with_pp(zero_with_pp: object, zero: tuple, engine: Engine, *, flat: bool = False) -> tuple | None:
    """The ZeRO stages to search where pp > 1: those of `zero` the engine runs with a pipeline (Engine.runs_zero
    at pp > 1) when the caller gave none, else the caller's, each checked against them (one line naming
    zero_with_pp, the option the caller set: Engine.check_zero's would point at --zero), unless the search is
    `flat` (every pp the caller allows is 1: no pipeline runs, so zero_with_pp has no effect, as
    engine_schedules has it). Values that are not stages at all are left to SearchOptions' own message."""
    if zero_with_pp is None:
        return tuple(z for z in zero if engine.runs_zero(z, pp=2))
    given = _as_tuple(zero_with_pp)
    if flat:
        return given
    runs = ", ".join(map(str, engine.zero_stages_at(2)))
    for z in given:
        if is_zero_stage(z) and not engine.runs_zero(z, pp=2):
            raise ValueError(f"engine {engine.name!r} runs ZeRO stage(s) {runs} only with a pipeline (pp > 1: its "
                             f"zero_stages_with_pp), not zero_with_pp {z}: use --zero-with-pp / zero_with_pp= "
                             f"among {runs}")
    return given


def engine_schedules(schedules: object, engine: Engine, *, flat: bool = False) -> tuple:
    """The pipeline schedules to search under `engine`: its schedules when the caller gave none, else the
    caller's, each checked against them (Engine.check_schedule: one line naming the schedules the engine runs,
    before any pricing), unless the search is `flat` (every pp the caller allows is 1: no schedule runs, as
    Engine.check_schedule has it for a config). Names that are no schedule at all are left to SearchOptions'
    own message."""
    if schedules is None:
        return engine.schedules
    given = _as_tuple(schedules)
    if flat:
        return given
    known = {s.value for s in Schedule}
    for s in given:
        if schedule_name(s) in known:
            engine.check_schedule(s)
    return given


def _as_tuple(value: object) -> tuple:
    if isinstance(value, (list, tuple, set, frozenset)):
        return tuple(sorted(value, key=str)) if isinstance(value, (set, frozenset)) else tuple(value)
    return (value,)


def _as_degrees(name: str, value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    out = _as_tuple(value)
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return out


def _parse(enum_type: type, value: object, what: str) -> object:
    try:
        return enum_type(str(getattr(value, "value", value)).lower())
    except ValueError:
        known = ", ".join(repr(m.value) for m in enum_type)
        raise ValueError(f"unknown {what} {value!r}: choose one of {known}") from None


def token_free_restriction(graph: LayerGraph, options: SearchOptions) -> tuple[SearchOptions, str]:
    """The search space a model without tokens (its input an image: LayerGraph.input_shape of rank > 1) is
    run in, and why (empty for other models). autoplan's executor runs such a model as a chain of its modules
    (execute/runner.py): no context or sequence parallelism (its positions are made inside its forward, which
    a sequence split cannot reach). Blocks that are not recognised transformer blocks (convolutions: no heads,
    no token sequence) add: no tensor parallelism, no selective recompute (no attention core), no experts;
    left are data parallelism and ZeRO, pipeline stages over the blocks, full recompute and the microbatch.
    ValueError when a restriction the caller fixed leaves nothing."""
    if len(graph.input_shape) < 2:
        return options, ""
    transformer = all(b.hidden_size and b.num_heads for b in graph.blocks)
    keep: dict[str, tuple] = {"cp": (1,), "sp": (False,)}
    if not transformer:
        keep.update(tp=(1,), ep=(1,), recompute=(Recompute.NONE, Recompute.FULL))
    changes = {}
    for name, allowed in keep.items():
        given = getattr(options, name)
        chosen = allowed if given is None else tuple(v for v in given if v in allowed)
        if not chosen:
            raise ValueError(f"{name}={list(given)}: {graph.model_name} takes {graph.input_shape} inputs, not tokens"
                             + ("" if transformer else ", and its blocks are not transformer blocks")
                             + f": it runs with {name} in {[getattr(v, 'value', v) for v in allowed]}")
        changes[name] = chosen
    if transformer:
        what, refused = "data parallelism / ZeRO, tensor parallelism, pipeline stages over its blocks, recompute", \
            "context or sequence parallelism"
    else:
        what, refused = "data parallelism / ZeRO, pipeline stages over its blocks, full recompute", \
            "tensor, context or sequence parallelism, selective recompute: its blocks are not transformer blocks"
    note = (f"{graph.model_name} takes inputs of shape {graph.input_shape}, not tokens: searched over {what} and "
            f"the microbatch (no {refused}; autoplan's executor runs such a model as a chain of its modules, "
            f"which make their positions inside their forward).")
    return replace(options, **changes), note


@lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """The divisors of n, ascending (pairs d, n // d up to sqrt(n): enumerate_space asks for each mesh's
    per-replica batch)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


def _fits(graph: LayerGraph, config: ParallelConfig, global_batch: int | None = None,
          sizes: tuple[dict[str, int], ...] | None = None) -> bool:
    return not graph.divisibility_errors(config, global_batch=global_batch, sizes=sizes)


def mesh_shapes(
    graph: LayerGraph, cluster: ClusterSpec, options: SearchOptions
) -> tuple[tuple[int, int, int, int, int], ...]:
    """(tp, pp, dp, cp, ep) with product = devices and tp inside a node, that divide the model as
    plan.layout.divisibility_errors says (the executor refuses the rest with the same function): tp the
    heads, kv heads, FFN width and vocabulary; ep the routed experts; 2*cp the sequence (cp > 1); pp the
    blocks (pp <= blocks); dp*ep the global batch. Each rule involves one degree (or dp*ep), so each degree
    is filtered on its own and the product is checked once more."""
    n, experts = cluster.num_devices, max((b.num_experts for b in graph.blocks), default=0)
    sizes = graph.divisibility_sizes()
    tps = [t for t in _allowed(divisors(cluster.devices_per_node), options.tp)
           if _fits(graph, ParallelConfig(tp=t), sizes=sizes) and (options.max_tp is None or t <= options.max_tp)]
    eps = [e for e in _allowed(divisors(experts) if experts else (1,), options.ep)
           if _fits(graph, ParallelConfig(ep=e), sizes=sizes)]
    cps = [c for c in _allowed(divisors(graph.seq_len), options.cp) if _fits(graph, ParallelConfig(cp=c), sizes=sizes)]
    out = []
    for tp, ep, cp in itertools.product(tps, eps, cps):
        inner = tp * ep * cp
        if n % inner:
            continue
        for pp in _allowed(divisors(n // inner), options.pp):
            dp = n // (inner * pp)
            if options.dp is not None and dp not in options.dp:
                continue
            if not stage_fits_groups(cluster, dp * ep * cp * tp, tp):  # heterogeneous: search/hetero.py
                continue
            if _fits(graph, ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep), options.global_batch, sizes):
                out.append((tp, pp, dp, cp, ep))
    return tuple(out)


def _allowed(values: Iterable[int], restrict: tuple[int, ...] | None) -> list[int]:
    return [v for v in values if restrict is None or v in restrict]


def schedule_choices(pp: int, num_blocks: int, options: SearchOptions) -> tuple[tuple[Schedule, int], ...]:
    """(schedule, virtual stages). With pp = 1 every schedule is the same computation: 1F1B stands for
    all. Interleaved needs v >= 2 dividing blocks // pp (Megatron's rule, Narayanan et al. 2021); the
    zero-bubble schedule runs as ZB-H1 (v = 1) or ZB-V (v = 2; Qi et al. 2024); pp * v <= blocks (plan.layout
    divisibility_errors: at least one block per stage) holds for both."""
    if pp == 1:
        return ((Schedule.ONE_F_ONE_B, 1),)
    out: list[tuple[Schedule, int]] = []
    for s in options.schedules:
        if s in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
            out.append((s, 1))
        elif s is Schedule.INTERLEAVED:
            per = num_blocks // pp
            out += [(s, v) for v in divisors(per) if 2 <= v <= options.max_virtual_stages]
        else:
            out += [(s, v) for v in (1, 2) if pp * v <= num_blocks]
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Space:
    """Candidates as integer columns (schedule and recompute as indices into SCHEDULES / RECOMPUTES)."""

    columns: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.columns["tp"])

    def config(self, i: int) -> ParallelConfig:
        c = {k: int(v[i]) for k, v in self.columns.items()}
        return ParallelConfig(
            tp=c["tp"], pp=c["pp"], dp=c["dp"], cp=c["cp"], ep=c["ep"], sp=bool(c["sp"]), zero=c["zero"],
            microbatch=c["microbatch"], schedule=SCHEDULES[c["schedule"]],
            virtual_stages=c["virtual_stages"], recompute=RECOMPUTES[c["recompute"]],
            etp=c.get("etp", 0), eep=c.get("eep", 0),
        )

    def take(self, index: np.ndarray) -> Space:
        return Space({k: v[index] for k, v in self.columns.items()})


def enumerate_space(graph: LayerGraph, cluster: ClusterSpec, options: SearchOptions) -> Space:
    """Every legal candidate: mesh x microbatch x (schedule, v) x recompute x zero x sp (a model without tokens:
    what token_free_restriction leaves)."""
    options, _ = token_free_restriction(graph, options)
    num_blocks = len(graph.blocks)
    recomputes = [RECOMPUTES.index(r) for r in options.recompute]
    blocks: list[np.ndarray] = []
    for tp, pp, dp, cp, ep in mesh_shapes(graph, cluster, options):
        per_replica = options.global_batch // (dp * ep)
        mbs = _allowed(divisors(per_replica), options.microbatch)
        # ZeRO shards over the dense data-parallel group dp*ep*cp (plan.layout.zero_layout): nothing to shard
        # over one rank; with a pipeline, the stages the engine runs with one (SearchOptions.zero_with_pp); zero 0
        # where the engine runs it beside the other degrees (SearchOptions.zero0_1d_only)
        stages = options.zero if pp == 1 or options.zero_with_pp is None else options.zero_with_pp
        zeros = [z for z in stages if (dp * ep * cp > 1 or z == 0)
                 and zero_runs_on(z, options.zero0_1d_only, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep)]
        sps = [int(s) for s in options.sp if tp > 1 or not s]
        scheds = [(SCHEDULES.index(s), v) for s, v in schedule_choices(pp, num_blocks, options)]
        if not (mbs and zeros and sps and scheds and recomputes):
            continue
        # the product mb x (schedule, v) x recompute x zero x sp, in that nesting order
        grid = np.stack(np.meshgrid(np.arange(len(mbs)), np.arange(len(scheds)), np.array(recomputes),
                                    np.array(zeros), np.array(sps), indexing="ij"), axis=-1).reshape(-1, 5)
        sched_v = np.array(scheds, dtype=np.int64)[grid[:, 1]]
        rows = np.empty((len(grid), len(COLUMNS)), dtype=np.int64)
        rows[:, :5] = (tp, pp, dp, cp, ep)
        rows[:, 5] = grid[:, 4]
        rows[:, 6] = grid[:, 3]
        rows[:, 7] = np.array(mbs, dtype=np.int64)[grid[:, 0]]
        rows[:, 8] = sched_v[:, 0]
        rows[:, 9] = sched_v[:, 1]
        rows[:, 10] = grid[:, 2]
        rows[:, 11:] = 0
        rows = rows[_schedule_runs(rows, per_replica, pp)]
        blocks += with_expert_layouts(rows, expert_layouts(graph, options, tp, pp, dp, cp, ep, cluster.devices_per_node))
    table = np.concatenate(blocks) if blocks else np.zeros((0, len(COLUMNS)), dtype=np.int64)
    return Space({name: table[:, i] for i, name in enumerate(COLUMNS)})


def _schedule_runs(rows: np.ndarray, per_replica: int, pp: int) -> np.ndarray:
    """Rows whose (schedule, virtual stages, microbatches) the executor's schedule accepts: plan.layout
    schedule_errors in numpy (1F1B needs m >= pp; looped interleaved / zero bubble need m a multiple of
    max(1, m // pp))."""
    if pp == 1:
        return np.ones(len(rows), dtype=bool)
    m = per_replica // rows[:, 7]
    sched, v = rows[:, 8], rows[:, 9]
    one_f_one_b = sched == SCHEDULES.index(Schedule.ONE_F_ONE_B)
    looped = (sched == SCHEDULES.index(Schedule.INTERLEAVED)) | ((sched == SCHEDULES.index(Schedule.ZERO_BUBBLE))
                                                                  & (v != 2))
    rounds = np.maximum(1, m // pp)
    return ~((one_f_one_b & (m < pp)) | (looped & (m % rounds != 0)))
