r"""An exact solver of the stage problem (stages.StageProblem) for one or two runs of identical blocks, for any
number of chunks per rank and any placement (looped or V), with no solver and no time limit.

The problem decomposes by rank. A rank's time and memory depend only on how many blocks of each run it
holds and with which recompute options, not on how they are cut into its chunks, so with g_r(a, b) the
fastest way for rank r to run a blocks of run 0 and b of run 1 within its memory,

    minimise_T  T   such that  sum_r a_r = N_0,  sum_r b_r = N_1,  g_r(a_r, b_r) <= T,  lo_r <= (a_r, b_r) <= hi_r,

where the bounds come from model order: run 0 fills stages 0..q0 and run 1 stages q1..S-1 (q1 = q0 or
q0 + 1, every stage holding at least one block), and each such boundary (q0, q1) is tried. g_r is
non-decreasing in a and b (dropping a block saves time and memory), so T* is the smallest value g takes at
which some boundary admits an allocation: bisection over the values g takes, each test a knapsack over ranks
(the largest b each rank can add for every a). g_r itself combines, per run, the Pareto front of (time,
activation bytes) over the option mixes of k blocks (the DP's `_segment_cost`, tabulated once per rank).
Ties at T* go to the least total time (the ILP's secondary objective), greedily.
"""

from __future__ import annotations

import numpy as np

from autoplan.search.stages import StageProblem, StageSolution, _pareto, evaluate, fits, mem_slack

# per block count k: bytes [k, L] ascending (inf past the front), time [k, L], option counts [k, L, R]
Front = tuple[np.ndarray, np.ndarray, np.ndarray]


def _pad(rows: list[np.ndarray], width: int, fill: float) -> np.ndarray:
    return np.stack([np.concatenate([r, np.full((width - len(r),) + r.shape[1:], fill)]) for r in rows])


def _front(time: tuple[float, ...], act: tuple[float, ...], count: int) -> Front:
    """The Pareto fronts of (activation bytes, time) over the option mixes of 0..count blocks of one run,
    built up a block at a time: the front of k blocks is the front of (the front of k - 1) + each option
    (a point dominated at k - 1 stays dominated after adding the same block), so every mix is covered."""
    r = len(time)
    opt_t, opt_a, unit = np.asarray(time, dtype=float), np.asarray(act, dtype=float), np.eye(r, dtype=np.int64)
    t, a, c = np.zeros(1), np.zeros(1), np.zeros((1, r), dtype=np.int64)
    points = [(a, t, c)]
    for _ in range(count):
        t, a, c = _pareto((t[:, None] + opt_t[None, :]).ravel(), (a[:, None] + opt_a[None, :]).ravel(),
                          (c[:, None, :] + unit[None, :, :]).reshape(-1, r))
        points.append((a, t, c))
    width = max(len(p[0]) for p in points)
    return (_pad([p[0] for p in points], width, np.inf), _pad([p[1] for p in points], width, np.inf),
            _pad([p[2] for p in points], width, 0).astype(np.int64))


def _runs(problem: StageProblem, times: tuple[tuple[float, ...], ...]) -> tuple[Front, Front]:
    """The fronts of runs 0 and 1 for one table of block times [run][option]; one run becomes run 1 after
    an empty run 0."""
    fronts = [_front(times[j], problem.act_bytes[j], n) for j, n in enumerate(problem.run_sizes)]
    if len(problem.run_sizes) == 2:
        return fronts[0], fronts[1]
    empty = (np.zeros((1, 1)), np.zeros((1, 1)), np.zeros((1, 1, problem.num_options), dtype=np.int64))
    return empty, fronts[0]


def _rank_terms(problem: StageProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per rank: pinned time, memory budget left by the pinned layers (each rank's own limit on a
    heterogeneous cluster), activation factor (in flight)."""
    pin_t, pin_m = np.zeros(problem.num_ranks), np.zeros(problem.num_ranks)
    f = np.asarray(problem.inflight, dtype=float)
    first, last = problem.stage_rank[0], problem.stage_rank[-1]
    pin_t[first] += problem.first_time_s
    pin_m[first] += problem.first_static_bytes + f[first] * problem.first_act_bytes
    pin_t[last] += problem.last_time_s
    pin_m[last] += problem.last_static_bytes + f[last] * problem.last_act_bytes
    limits = np.array([problem.mem_limit_on(r) for r in range(problem.num_ranks)], dtype=float)
    # the budget keeps stages.fits' tolerance (stages.mem_slack), so what fits there fits here
    slack = np.array([mem_slack(limit) for limit in limits])
    return pin_t, limits - pin_m + slack, f


def _tables(problem: StageProblem, sizes: tuple[int, int], statics: tuple[float, float]
            ) -> tuple[np.ndarray, np.ndarray, list[tuple[Front, Front]]]:
    """g[r, a, b]: the fastest time of rank r holding a blocks of run 0 and b of run 1 within its memory
    (inf where no mix fits), the front points [r, a, b, run] it picks, and each rank's fronts (ranks of
    one device kind share them)."""
    pin_t, budget, f = _rank_terms(problem)
    n0, n1 = sizes
    g = np.full((problem.num_ranks, n0 + 1, n1 + 1), np.inf)
    pick = np.zeros((problem.num_ranks, n0 + 1, n1 + 1, 2), dtype=np.int64)
    kinds: dict[tuple, list[int]] = {}
    for r in range(problem.num_ranks):
        kinds.setdefault(tuple(problem.time_on(r)), []).append(r)
    fronts_of: list[tuple[Front, Front]] = [None] * problem.num_ranks  # type: ignore[list-item]
    for times, ranks in kinds.items():
        fronts = _runs(problem, times)
        g[ranks], pick[ranks] = _table(fronts, sizes, statics, budget[ranks], f[ranks])
        for r in ranks:
            fronts_of[r] = fronts
    return g + pin_t[:, None, None], pick, fronts_of


def _table(fronts: tuple[Front, Front], sizes: tuple[int, int], statics: tuple[float, float], budget: np.ndarray,
           f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """g and pick for ranks sharing `fronts`: for each point of run 0's front, run 1's best point is the
    last of its front (ascending bytes, descending time) that still fits."""
    (act0, time0, _), (act1, time1, _) = fronts
    n0, n1 = sizes
    g = np.full((len(f), n0 + 1, n1 + 1), np.inf)
    pick = np.zeros((len(f), n0 + 1, n1 + 1, 2), dtype=np.int64)
    b = np.arange(n1 + 1)
    finite1 = np.isfinite(act1)[None]
    act1 = np.where(np.isfinite(act1), act1, 0.0)
    for a in range(n0 + 1):
        for p in np.nonzero(np.isfinite(act0[a]))[0].tolist():
            room = budget[:, None] - a * statics[0] - b[None, :] * statics[1] - f[:, None] * act0[a, p]  # [r, b]
            fit = finite1 & (f[:, None, None] * act1[None] <= room[:, :, None])
            last = fit.sum(-1) - 1  # the front ascends in bytes, so what fits is a prefix
            t = np.where(last >= 0, time1[b[None, :], np.maximum(last, 0)], np.inf) + time0[a, p]
            better = t < g[:, a, :]
            g[:, a, :] = np.where(better, t, g[:, a, :])
            pick[:, a, :, 0] = np.where(better, p, pick[:, a, :, 0])
            pick[:, a, :, 1] = np.where(better, last, pick[:, a, :, 1])
    return g, pick


Bounds = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _bounds(problem: StageProblem, sizes: tuple[int, int], q0: int, q1: int) -> Bounds:
    """(lo0, hi0, lo1, hi1) per rank when run 0 fills stages 0..q0 and run 1 stages q1..S-1: a rank holds at
    least one block of a run per stage of that run it has, and none of a run it has no stage of."""
    ranks, q = np.asarray(problem.stage_rank), np.arange(problem.num_stages)
    lo0 = np.bincount(ranks[q <= q0], minlength=problem.num_ranks)
    lo1 = np.bincount(ranks[q >= q1], minlength=problem.num_ranks)
    return lo0, np.where(lo0 > 0, sizes[0], 0), lo1, np.where(lo1 > 0, sizes[1], 0)


def _boundaries(problem: StageProblem, sizes: tuple[int, int]) -> list[tuple[int, int]]:
    """(q0, q1): run 0 ends in stage q0, run 1 starts in q1 = q0 (a shared stage) or q0 + 1."""
    s = problem.num_stages
    if not sizes[0]:
        return [(-1, 0)]
    out = [(q0, q1) for q0 in range(min(sizes[0], s)) for q1 in (q0, q0 + 1)]
    return [(q0, q1) for q0, q1 in out if q1 < s and s - q1 <= sizes[1]]


def _allocate(g: np.ndarray, bounds: Bounds, sizes: tuple[int, int], limit: float
              ) -> tuple[np.ndarray, np.ndarray] | None:
    """Run-0 blocks a_r per rank summing to N0 and the most run-1 blocks b_r each rank can then hold with
    g <= limit, maximising sum b_r (a knapsack over ranks); None unless sum b_r reaches N1."""
    lo0, hi0, lo1, hi1 = bounds
    n0, n1 = sizes
    b = np.arange(n1 + 1)[None, None, :]
    ok = (g <= limit) & (b >= lo1[:, None, None]) & (b <= hi1[:, None, None])
    # g is non-decreasing in b: the feasible b of (rank, a) run from lo1 up to `most` (-1: none)
    most = np.where(ok.any(-1), n1 - np.argmax(ok[:, :, ::-1], axis=-1), -1)
    a = np.arange(n0 + 1)
    most = np.where((a[None, :] >= lo0[:, None]) & (a[None, :] <= hi0[:, None]), most, -1)
    gain = np.where(most >= 0, most, -np.inf).astype(float)
    prev = a[:, None] - a[None, :]  # [total so far, this rank's a]
    best = np.where(a == 0, 0.0, -np.inf)
    choices = []
    for r in range(g.shape[0]):
        total = np.where(prev >= 0, best[np.maximum(prev, 0)] + gain[r][None, :], -np.inf)
        choices.append(np.argmax(total, axis=1))
        best = total.max(axis=1)
    if not best[n0] >= n1:
        return None
    a_r, left = np.zeros(g.shape[0], dtype=np.int64), n0
    for r in range(g.shape[0] - 1, -1, -1):
        a_r[r] = choices[r][left]
        left -= a_r[r]
    return a_r, most[np.arange(g.shape[0]), a_r]


def _trim(g: np.ndarray, a_r: np.ndarray, b_r: np.ndarray, lo1: np.ndarray, n1: int) -> np.ndarray:
    """Drop the run-1 blocks beyond N1, each time from the rank whose time drops the most."""
    b_r = b_r.copy()
    ranks = np.arange(len(b_r))
    while b_r.sum() > n1:
        saving = np.where(b_r > lo1, g[ranks, a_r, b_r] - g[ranks, a_r, np.maximum(b_r - 1, 0)], -np.inf)
        b_r[int(np.argmax(saving))] -= 1
    return b_r


def solve_balanced(problem: StageProblem) -> StageSolution | None:
    """The exact optimum of a stage problem with one or two runs (None when no split fits); ValueError
    for more runs (the DP or the ILP handle those)."""
    if len(problem.run_sizes) > 2:
        raise ValueError(f"solve_balanced handles one or two runs, got {len(problem.run_sizes)}")
    if len(problem.run_sizes) == 2:
        sizes, statics = tuple(problem.run_sizes), tuple(problem.static_bytes)
    else:
        sizes, statics = (0, problem.run_sizes[0]), (0.0, problem.static_bytes[0])
    g, pick, fronts = _tables(problem, sizes, statics)
    cases = [(q, _bounds(problem, sizes, *q)) for q in _boundaries(problem, sizes)]

    def found(limit: float):
        for boundary, bounds in cases:
            alloc = _allocate(g, bounds, sizes, limit)
            if alloc is not None:
                return boundary, bounds, alloc
        return None

    values = np.unique(g[np.isfinite(g)])
    if not len(values) or found(values[-1]) is None:
        return None
    lo, hi = 0, len(values) - 1  # bisect for the smallest value at which some boundary admits an allocation
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if found(values[mid]) is not None else (mid + 1, hi)
    boundary, bounds, (a_r, b_r) = found(values[lo])
    b_r = _trim(g, a_r, b_r, bounds[2], sizes[1])
    return _decode(problem, boundary, a_r, b_r, pick, fronts)


def _split(total: int, slots: list[int], comp: np.ndarray) -> dict[int, np.ndarray]:
    """Option counts per stage: `total` blocks of one run over the rank's `slots` (each >= 1), as evenly
    as possible (earlier stages first), the options laid out in order."""
    if not slots:
        return {}
    base, extra = divmod(total, len(slots))
    modes = np.repeat(np.arange(len(comp)), comp)
    out, start = {}, 0
    for i, q in enumerate(slots):
        size = base + (i < extra)
        out[q] = np.bincount(modes[start:start + size], minlength=len(comp))
        start += size
    return out


def _decode(problem: StageProblem, boundary: tuple[int, int], a_r: np.ndarray, b_r: np.ndarray,
            pick: np.ndarray, fronts: list[tuple[Front, Front]]) -> StageSolution | None:
    q0, q1 = boundary
    r_opts = problem.num_options
    counts = np.zeros((problem.num_stages, 2, r_opts), dtype=np.int64)
    for r in range(problem.num_ranks):
        p0, p1 = pick[r, a_r[r], b_r[r]]
        mine = [q for q, rank in enumerate(problem.stage_rank) if rank == r]
        for j, (total, slots, point) in enumerate(((a_r[r], [q for q in mine if q <= q0], p0),
                                                   (b_r[r], [q for q in mine if q >= q1], p1))):
            for q, c in _split(int(total), slots, fronts[r][j][2][total, point]).items():
                counts[q, j] = c
    runs = counts if len(problem.run_sizes) == 2 else counts[:, 1:]
    solution = evaluate(problem, tuple(tuple(tuple(int(x) for x in run) for run in st) for st in runs.tolist()),
                        method="balanced")
    return solution if fits(problem, solution) else None
