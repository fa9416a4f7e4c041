"""The quick estimate's schedule-dependent last step, apart from the rest of the assembly.

Candidates that differ only in their pipeline schedule (GPipe, 1F1B, zero bubble at one virtual stage) share
every per-rank term of search/assemble.py but the pipeline formula and the in-flight activations. So the
assembly runs once per distinct row of the other columns (`Shared`: about a third of the rows of a v = 1
shape) and `by_schedule` finishes each candidate from its row of it: cost.pipeline.pipeline_time_s's
m max_r (X_r + steady_r) + (sum_r Y_r - max_r Y_r) / v' needs only three numbers per shared row (Y = X, or
zero bubble's max(X - k W, 0)), and the peak memory adds the schedule's in-flight activations to the shared
model states rank by rank. Every figure is computed with the same operations on the same values, in the
same order, as when each candidate was assembled on its own (bench/plan_identity.py checks it bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoplan.cost.pipeline import reduce_stream_floor_s
from autoplan.plan.types import Schedule
from autoplan.search.space import SCHEDULES

_ZB, _INTERLEAVED, _GPIPE = (SCHEDULES.index(s) for s in (Schedule.ZERO_BUBBLE, Schedule.INTERLEAVED, Schedule.GPIPE))


@dataclass(frozen=True, slots=True)
class Shared:
    """What candidates equal but for the schedule share, per shared row: the pipeline's
    max_r (X_r + steady_r), sum_r Y_r - max_r Y_r with Y = X and with zero bubble's Y, the once-per-step
    terms added to it in order (step tail, optimizer, DeepSpeed's per-step host work), and the per-rank model
    states + working set [n, p] and reserve the peak memory adds the activations to."""

    peak: np.ndarray
    bubble: np.ndarray
    bubble_zb: np.ndarray
    once: tuple[np.ndarray, ...]
    states: np.ndarray
    reserve: np.ndarray
    # per rank [n, p]: the layers' forward, backward and its weight part, and the asynchronous reductions
    # (cost.pipeline.reduce_stream_floor_s); None where no candidate reduces asynchronously
    floor: tuple[np.ndarray, ...] | None = None


def shared_pipeline(x: np.ndarray, weight: np.ndarray, steady, v: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(max_r (X_r + steady_r), sum_r X_r - max_r X_r, the same of zero bubble's Y_r = max(X_r - k W_r, 0),
    k = 2 at one virtual stage and 3 for the V shape), cost.pipeline.pipeline_time_s's terms per row."""
    y = np.maximum(x - (2.0 if v == 1 else 3.0) * weight, 0.0)
    return (x + steady).max(axis=1), x.sum(axis=1) - x.max(axis=1), y.sum(axis=1) - y.max(axis=1)


def by_schedule(shared: Shared, of: np.ndarray | None, schedule: np.ndarray, m: np.ndarray, act: np.ndarray,
                work: np.ndarray, pp: int, v: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step time, peak memory, activations of the most loaded rank) of each candidate, from its shared row
    (`of`; None: row i is candidate i), its schedule, microbatches m, per-rank activations `act` [n, p] and
    working memory `work` [n, p]."""
    def pick(a: np.ndarray) -> np.ndarray:
        return a if of is None else a[of]

    zb = schedule == _ZB
    chunks = np.where((schedule == _INTERLEAVED) | zb, v, 1)
    step = m * pick(shared.peak) + np.where(zb, pick(shared.bubble_zb), pick(shared.bubble)) / chunks
    for k, term in enumerate(shared.once):
        step = step + pick(term)
        if k == 0 and shared.floor is not None:  # the step tail's end against the reduction stream's
            fwd, bwd, weight, reduce = (pick(a) for a in shared.floor)
            hop = np.where(zb[:, None], bwd - weight, bwd)
            step = np.maximum(step, reduce_stream_floor_s(fwd, hop, reduce, m, chunks))
    acts = act * inflight(schedule, pp, v, m) + work
    return step, (pick(shared.states) + acts).max(axis=1) + pick(shared.reserve), acts.max(axis=1)


def inflight(schedule: np.ndarray, p: int, v: int, m: np.ndarray) -> np.ndarray:
    """cost.pipeline.in_flight_microbatches per [candidate, rank]: GPipe all m; 1F1B and zero bubble
    p - r; interleaved Megatron's warm-up (2 (p - r - 1) + (v - 1) p + 1) / v; never more than m."""
    r = np.arange(p)[None, :]
    s = schedule[:, None]
    m2 = m[:, None].astype(float)
    one_f_one_b = np.broadcast_to(p - r, (len(m), p)).astype(float)
    out = np.where(s == _GPIPE, m2, one_f_one_b)
    if v > 1:  # (at one virtual stage an interleaved schedule is 1F1B)
        out = np.where(s == _INTERLEAVED, (2.0 * (p - r - 1) + (v - 1) * p + 1) / v, out)
    return np.minimum(out, m2)
