"""The pipeline stage problem as data, a checker, and an exact dynamic program (pure; no solver).

Blocks come in runs of identical layers (dense then MoE, ...); choose how many blocks of each run go to
each of the S = pp * v stages, and with which recompute option, minimising the slowest pipeline rank's
time per microbatch with every rank's memory under the limit. The ILP in ilp.py solves the same problem.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

Counts = tuple[tuple[tuple[int, ...], ...], ...]  # [stage][run][option] -> number of blocks


@dataclass(frozen=True, slots=True, kw_only=True)
class StageProblem:
    """Per-block figures for one microbatch on one device; options are recompute modes (any order).

    Stage q runs on rank stage_rank[q] (autoplan.plan.layout.stage_ranks: looped q % num_ranks unless
    the schedule places its chunks in a V). Rank r holds `inflight[r]` microbatches of activations.
    `first_*` (embedding, ...) sit on stage 0, `last_*` (norm, head) on stage S - 1.

    Heterogeneous devices (additive): `rank_time_s[rank]` replaces time_s on that rank ([rank][run]
    [option]) and `rank_mem_limit_bytes[rank]` its memory limit (search/hetero.py fills them from each
    rank's node group; first_time_s / last_time_s are then the times on the ranks holding them).
    Read them through time_on(rank) and mem_limit_on(rank)."""

    run_sizes: tuple[int, ...]
    time_s: tuple[tuple[float, ...], ...]  # [run][option]
    static_bytes: tuple[float, ...]  # [run]: weights, gradients, optimizer states of one block
    act_bytes: tuple[tuple[float, ...], ...]  # [run][option], per microbatch in flight
    num_ranks: int
    virtual_stages: int = 1
    inflight: tuple[float, ...] = ()  # [rank]; () means 1 everywhere
    mem_limit_bytes: float = float("inf")
    first_time_s: float = 0.0
    first_static_bytes: float = 0.0
    first_act_bytes: float = 0.0
    last_time_s: float = 0.0
    last_static_bytes: float = 0.0
    last_act_bytes: float = 0.0
    stage_rank: tuple[int, ...] = ()  # [stage]; () means looped, q % num_ranks
    rank_time_s: tuple[tuple[tuple[float, ...], ...], ...] = ()  # [rank][run][option]; () means time_s
    rank_mem_limit_bytes: tuple[float, ...] = ()  # [rank]; () means mem_limit_bytes

    def __post_init__(self) -> None:
        if not self.stage_rank:
            object.__setattr__(self, "stage_rank", tuple(q % self.num_ranks for q in range(self.num_stages)))
        if len(self.stage_rank) != self.num_stages or not all(0 <= r < self.num_ranks for r in self.stage_rank):
            raise ValueError(f"stage_rank {self.stage_rank} must give a rank in [0, {self.num_ranks}) for each "
                             f"of the {self.num_stages} stages")
        if not self.inflight:
            object.__setattr__(self, "inflight", (1.0,) * self.num_ranks)
        if len(self.inflight) != self.num_ranks:
            raise ValueError(f"inflight has {len(self.inflight)} entries for {self.num_ranks} ranks")
        if self.num_stages > sum(self.run_sizes):
            raise ValueError(f"{self.num_stages} stages for {sum(self.run_sizes)} blocks: at most one stage per block")
        for name in ("rank_time_s", "rank_mem_limit_bytes"):
            if getattr(self, name) and len(getattr(self, name)) != self.num_ranks:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {self.num_ranks} ranks")

    def time_on(self, rank: int) -> tuple[tuple[float, ...], ...]:
        """[run][option] block times on pipeline rank `rank`."""
        return self.rank_time_s[rank] if self.rank_time_s else self.time_s

    def mem_limit_on(self, rank: int) -> float:
        return self.rank_mem_limit_bytes[rank] if self.rank_mem_limit_bytes else self.mem_limit_bytes

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.virtual_stages

    @property
    def num_options(self) -> int:
        return len(self.time_s[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class StageSolution:
    counts: Counts
    time_s: float  # slowest rank, per microbatch
    rank_time_s: tuple[float, ...]
    rank_mem_bytes: tuple[float, ...]
    method: str = ""

    def stage_sizes(self) -> tuple[int, ...]:
        return tuple(sum(sum(run) for run in stage) for stage in self.counts)


def evaluate(problem: StageProblem, counts: Counts, method: str = "") -> StageSolution:
    """Rank times and memory of a solution; raises ValueError if it is not a valid split."""
    p, s_total = problem.num_ranks, problem.num_stages
    if len(counts) != s_total:
        raise ValueError(f"{len(counts)} stages given, the problem has {s_total}")
    arr = np.asarray(counts, dtype=np.int64)
    if (arr < 0).any() or tuple(arr.sum(axis=(0, 2))) != tuple(problem.run_sizes):
        raise ValueError(f"run totals {arr.sum(axis=(0, 2)).tolist()} != {list(problem.run_sizes)}")
    if (arr.sum(axis=(1, 2)) < 1).any():
        raise ValueError("every stage needs at least one block")
    _check_order(arr.sum(axis=2), problem.run_sizes)
    a = np.asarray(problem.act_bytes)
    st = np.asarray(problem.static_bytes)
    times, mems = np.zeros(p), np.zeros(p)
    for q in range(s_total):
        r = problem.stage_rank[q]
        times[r] += (arr[q] * np.asarray(problem.time_on(r))).sum()
        mems[r] += (arr[q].sum(axis=1) * st).sum() + problem.inflight[r] * (arr[q] * a).sum()
    times[0] += problem.first_time_s
    mems[0] += problem.first_static_bytes + problem.inflight[0] * problem.first_act_bytes
    last = problem.stage_rank[s_total - 1]
    times[last] += problem.last_time_s
    mems[last] += problem.last_static_bytes + problem.inflight[last] * problem.last_act_bytes
    return StageSolution(counts=tuple(tuple(tuple(int(x) for x in run) for run in st_) for st_ in arr.tolist()),
                         time_s=float(times.max()), rank_time_s=tuple(times.tolist()),
                         rank_mem_bytes=tuple(mems.tolist()), method=method)


def _check_order(per_stage_run: np.ndarray, run_sizes: tuple[int, ...]) -> None:
    """Blocks keep model order: once a later run has started, earlier runs are complete."""
    cum = np.cumsum(per_stage_run, axis=0)
    for j in range(len(run_sizes) - 1):
        started = cum[:, j + 1] > 0
        if (cum[started, j] < run_sizes[j]).any():
            raise ValueError(f"run {j + 1} starts before run {j} ends: stages must keep model order")


MEM_RTOL = 1e-9  # a rank's memory may exceed its limit by this fraction of it (rounding of its sums)


def mem_slack(limit: float) -> float:
    """Bytes over `limit` that still fit (MEM_RTOL of it; 0 for no limit): the one tolerance of fits, the DP's
    segment budgets and balance's, so that what one of them accepts the others accept."""
    return MEM_RTOL * abs(limit) if math.isfinite(limit) else 0.0


def fits(problem: StageProblem, solution: StageSolution) -> bool:
    return all(mem <= problem.mem_limit_on(r) + mem_slack(problem.mem_limit_on(r))
               for r, mem in enumerate(solution.rank_mem_bytes))


@lru_cache(maxsize=256)
def _compositions(k: int, r: int) -> np.ndarray:
    """All ways to write k as an ordered sum of r non-negative integers, shape [n, r]."""
    if r == 1:
        return np.array([[k]], dtype=np.int64)
    parts = [np.concatenate([np.full((len(rest), 1), i, dtype=np.int64), rest], axis=1)
             for i in range(k + 1) for rest in (_compositions(k - i, r - 1),)]
    return np.concatenate(parts)


def _pareto(time: np.ndarray, mem: np.ndarray, choice: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keep the (time, mem) points no other point beats on both; sorted by memory ascending."""
    order = np.lexsort((time, mem))
    time, mem, choice = time[order], mem[order], choice[order]
    best = np.minimum.accumulate(time)
    keep = np.ones(len(time), dtype=bool)
    keep[1:] = time[1:] < best[:-1]
    return time[keep], mem[keep], choice[keep]


def _segment_cost(problem: StageProblem, ks: tuple[int, ...], factor: float, budget: float,
                  rank: int = 0) -> tuple[float, tuple]:
    """Fastest option counts for ks[j] blocks of each run on `rank` under `budget` bytes (exact, by
    enumeration of each run's compositions and a Pareto merge). Returns (inf, ()) when nothing fits.
    `budget` already holds the rank's slack (mem_slack), so a segment fits here exactly when fits() accepts it."""
    r = problem.num_options
    time, mem, choice = np.zeros(1), np.zeros(1), np.zeros((1, 0), dtype=np.int64)
    for j, k in enumerate(ks):
        comp = _compositions(k, r)
        t = comp @ np.asarray(problem.time_on(rank)[j])
        m = comp @ (np.asarray(problem.act_bytes[j]) * factor) + k * problem.static_bytes[j]
        tt = (time[:, None] + t[None, :]).ravel()
        mm = (mem[:, None] + m[None, :]).ravel()
        ch = np.concatenate([np.repeat(choice, len(comp), axis=0), np.tile(comp, (len(choice), 1))], axis=1)
        ok = mm <= budget
        if not ok.any():
            return float("inf"), ()
        time, mem, choice = _pareto(tt[ok], mm[ok], ch[ok])
    best = int(np.argmin(time))
    return float(time[best]), tuple(tuple(int(x) for x in choice[best, j * r:(j + 1) * r]) for j in range(len(ks)))


def _run_counts(run_sizes: tuple[int, ...], start: int, stop: int) -> tuple[int, ...]:
    bounds = np.concatenate([[0], np.cumsum(run_sizes)])
    return tuple(int(max(0, min(stop, bounds[j + 1]) - max(start, bounds[j]))) for j in range(len(run_sizes)))


def solve_dp(problem: StageProblem) -> StageSolution | None:
    """Exact minimax dynamic program over contiguous splits for v = 1 (None if nothing fits).

    dp[q][c] = the smallest possible slowest-stage time of stages 0..q holding the first c blocks;
    a stage's cost is its exact fastest recompute mix under the rank's memory (_segment_cost). With
    v > 1 a rank's memory is shared by its v chunks: each chunk gets 1/v of it (a restriction, so the
    answer is feasible but may be slower than the ILP's)."""
    n, s_total = sum(problem.run_sizes), problem.num_stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(s_total + 1)]
    back: list[list[tuple[int, tuple]]] = [[(0, ())] * (n + 1) for _ in range(s_total + 1)]
    best[0][0] = 0.0
    cache: dict = {}
    for q in range(s_total):
        rank = problem.stage_rank[q]
        first, last = q == 0, q == s_total - 1
        fixed_t = problem.first_time_s * first + problem.last_time_s * last
        fixed_m = (problem.first_static_bytes + problem.inflight[rank] * problem.first_act_bytes) * first + (
            problem.last_static_bytes + problem.inflight[rank] * problem.last_act_bytes) * last
        limit = problem.mem_limit_on(rank)
        budget = (limit + mem_slack(limit)) / problem.virtual_stages - fixed_m
        remaining = s_total - q - 1
        for c in range(q, n - remaining):
            if best[q][c] == inf:
                continue
            stops = [n] if last else range(c + 1, n - remaining + 1)
            for stop in stops:
                ks = _run_counts(problem.run_sizes, c, stop)
                times = rank if problem.rank_time_s else 0  # ranks share one time table when homogeneous
                key = (ks, problem.inflight[rank], budget, times)
                if key not in cache:
                    cache[key] = _segment_cost(problem, ks, problem.inflight[rank], budget, rank)
                seg_t, seg_choice = cache[key]
                value = max(best[q][c], seg_t + fixed_t)
                if value < best[q + 1][stop]:
                    best[q + 1][stop] = value
                    back[q + 1][stop] = (c, seg_choice)
    if best[s_total][n] == inf:
        return None
    stages, c = [], n
    for q in range(s_total, 0, -1):
        prev, choice = back[q][c]
        stages.append(choice)
        c = prev
    return evaluate(problem, tuple(reversed(stages)), method="dp")


def brute_force(problem: StageProblem) -> StageSolution | None:
    """Every split and every per-block option (tiny problems only; the reference in tests)."""
    n, s_total, r = sum(problem.run_sizes), problem.num_stages, problem.num_options
    run_of = [j for j, size in enumerate(problem.run_sizes) for _ in range(size)]
    best: StageSolution | None = None
    for cuts in itertools.combinations(range(1, n), s_total - 1):
        bounds = (0, *cuts, n)
        for opts in itertools.product(range(r), repeat=n):
            counts = []
            for q in range(s_total):
                stage = [[0] * r for _ in problem.run_sizes]
                for i in range(bounds[q], bounds[q + 1]):
                    stage[run_of[i]][opts[i]] += 1
                counts.append(tuple(tuple(x) for x in stage))
            sol = evaluate(problem, tuple(counts), method="brute")
            if fits(problem, sol) and (best is None or sol.time_s < best.time_s - 1e-12):
                best = sol
    return best
