"""Pipeline schedules: step time of p ranks running m microbatches (GPipe, 1F1B, interleaved 1F1B,
zero bubble), their bubble, and how many microbatches of activations each rank holds.

Times are per microbatch per pipeline rank (a rank's chunks summed); the slowest rank sets the pace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from autoplan.plan.types import Schedule


def _schedule(value: Schedule | str) -> Schedule:
    try:
        return Schedule(str(value).lower())
    except ValueError:
        known = ", ".join(repr(s.value) for s in Schedule)
        raise ValueError(f"unknown pipeline schedule {value!r}: choose one of {known}") from None


def _check(p: int, v: int, m: int) -> None:
    for name, value in (("p", p), ("v", v), ("m", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"pipeline {name} must be a positive integer, got {value!r}")


def bubble_fraction(schedule: Schedule, p: int, v: int, m: int, *, weight_fraction: float = 1 / 3) -> float:
    """Bubble time over the ideal time m (F + B) for uniform stages.

    GPipe (Huang et al. 2019) and 1F1B (Narayanan et al. 2021): (p - 1) / m; interleaved 1F1B with v
    chunks per rank: (p - 1) / (v m). Zero bubble (Qi et al., ICLR 2024), with B the full backward
    and W its weight-gradient part (W = weight_fraction (F + B)): ZB-H1 (v = 1) leaves
    (p - 1)(F + B - 2W), one third of 1F1B's at F = B_input = W; ZB-V (v = 2) leaves
    (p - 1)(F + B - 3W) / 2, zero at F = B_input = W."""
    _check(p, v, m)
    schedule = _schedule(schedule)
    return max(_bubble_term(schedule, v, 1.0, weight_fraction)
               * (p - 1) / m / chunks_per_rank(schedule, v), 0.0) if p > 1 else 0.0


def chunks_per_rank(schedule: Schedule, v: int) -> int:
    """Model chunks (virtual stages) a pipeline rank runs: v for interleaved 1F1B and zero bubble, else 1."""
    return v if schedule in (Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE) else 1


def _bubble_term(schedule: Schedule, v: int, fwd_bwd: float, weight: float) -> float:
    if schedule is Schedule.ZERO_BUBBLE:
        return max(fwd_bwd - (2.0 if v == 1 else 3.0) * weight, 0.0)
    return fwd_bwd


def pipeline_time_s(schedule: Schedule | str, p: int, v: int, m: int, fwd_s: Sequence[float],
                    bwd_s: Sequence[float], bwd_weight_s: Sequence[float] | None = None,
                    steady_s: Sequence[float] | None = None) -> float:
    """Time for p ranks to run m microbatches forward and backward.

    fwd_s, bwd_s, bwd_weight_s: per microbatch, per pipeline rank (length p, a rank's v chunks summed)
    or per stage (length p * v in model order; stage i runs on rank i % p, Megatron's looped
    placement). With X_r = F_r + B_r and Y_r the schedule's bubble term (X_r, or X_r - 2 W_r for
    ZB-H1, X_r - 3 W_r for ZB-V): T = m max_r X_r + (sum_r Y_r - max_r Y_r) / v'. For uniform stages
    this is m X + (p - 1) Y / v': (m + p - 1)(F + B) for GPipe and 1F1B (Narayanan et al. 2021),
    m X + (p - 1) X / v for interleaved 1F1B, and Qi et al. 2024's ZB-H1 / ZB-V bubbles, v' = v for
    interleaved and zero bubble, 1 otherwise; for heterogeneous stages the fill and drain pass
    through every rank once while the steady state runs at the slowest rank.

    steady_s (additive, per rank or stage): time in a rank's slot that only the steady state pays, not the
    fill and drain: X_r grows by it, Y_r does not. An unbatched pipeline's blocking receives (cost/estimate.py
    unbatched_p2p) are such time: in the fill and drain a receive waits for the same transfer the sender's
    slot already carries along the chain. It may be negative: an overlapped p2p (cost/p2p.py p2p_overlapped,
    Megatron-Core's interleaved schedule) is time the fill and drain wait for along the chain but the steady
    state hides, so X_r loses it and Y_r keeps it."""
    _check(p, v, m)
    schedule = _schedule(schedule)
    fwd = _per_rank(fwd_s, p, v, "fwd_s")
    bwd = _per_rank(bwd_s, p, v, "bwd_s")
    weight = _per_rank(bwd_weight_s, p, v, "bwd_weight_s") if bwd_weight_s is not None else [0.0] * p
    steady = _per_rank(steady_s, p, v, "steady_s") if steady_s is not None else [0.0] * p
    x = [f + b for f, b in zip(fwd, bwd)]
    y = [_bubble_term(schedule, v, xi, w) for xi, w in zip(x, weight)]
    return m * max(xi + e for xi, e in zip(x, steady)) + (sum(y) - max(y)) / chunks_per_rank(schedule, v)


def _per_rank(values: Sequence[float], p: int, v: int, name: str) -> list[float]:
    values = list(values)
    if len(values) == p:
        return [float(x) for x in values]
    if len(values) == p * v:
        out = [0.0] * p
        for i, x in enumerate(values):
            out[i % p] += float(x)
        return out
    raise ValueError(f"{name} has {len(values)} entries: give one per pipeline rank (p={p}) "
                     f"or one per stage (p*v={p * v})")


def in_flight_microbatches(schedule: Schedule | str, p: int, v: int, m: int, rank: int) -> float:
    """Microbatches of activations pipeline rank `rank` holds at its peak, in units of one full
    microbatch of all its chunks.

    GPipe: all m. 1F1B: min(m, p - rank) (Narayanan et al. 2021: p on the first stage). Interleaved
    1F1B: Megatron-LM's warm-up of (p - rank - 1) * 2 + (v - 1) * p chunk-microbatches plus the one in
    flight, over v chunks; on rank 0 that is p (1 + (p - 1)/(p v)) (Narayanan et al. 2021, section
    2.2.2). Zero bubble: as 1F1B (Qi et al. 2024: ZB-H1 and ZB-V keep 1F1B's peak memory)."""
    _check(p, v, m)
    schedule = _schedule(schedule)
    if not 0 <= rank < p:
        raise ValueError(f"pipeline rank {rank} out of range for p={p}")
    if schedule is Schedule.GPIPE:
        return float(m)
    if schedule is Schedule.INTERLEAVED and v > 1:
        chunks = (p - rank - 1) * 2 + (v - 1) * p + 1
        return min(chunks, m * v) / v
    return float(min(m, p - rank))


def reduce_stream_floor_s(fwd: Any, hop_bwd: Any, reduce: Any, m: Any, chunks: Any) -> Any:
    """Lower bound on the step (before the optimizer) of a pipeline whose every-microbatch gradient
    reductions run on a stream of their own that the backward does not wait for (Engine.grad_reduce_async,
    cost/dataparallel.async_reduce_s), per rank [..., p] (a rank's chunks summed, per microbatch): the
    layers' forward `fwd`, the backward a gradient passes through on its way back `hop_bwd` (the whole
    backward; zero bubble's input-gradient part), the rank's reductions `reduce`; `m` microbatches,
    `chunks` virtual stages per rank (1 but for interleaved and zero bubble). Numbers or numpy arrays.

    A gradient exists only once its backward has run, and one data-parallel communicator runs a rank's
    reductions one after another, so rank r's stream ends no earlier than its first backward's start +
    m x reduce[r]. The first backward anywhere is microbatch 0's at the last virtual stage, after that
    microbatch's forward through every stage (sum_r fwd[r]); rank r's first backward waits for the
    gradient to come back through each later rank, one chunk each (sum_{r' > r} hop_bwd[r'] / chunks):
    the schedule's warm-up forwards (Megatron-LM / torch.distributed.pipelining interleaved 1F1B:
    (p - r - 1) 2 + (v - 1) p of them on rank r) have no gradient to hide a reduction behind. The steady
    state's m x max(compute, reductions) (async_reduce_s) assumes every microbatch slot has one; this
    bound is what the warm-up costs when the reductions are the bottleneck. Pipeline hops and the wait for
    a first layer's backward only add to it (left out: it stays a lower bound). Zero where no rank
    reduces asynchronously."""
    fwd, hop, reduce = (np.asarray(a, dtype=float) for a in (fwd, hop_bwd, reduce))
    after = np.cumsum(hop[..., ::-1], axis=-1)[..., ::-1] - hop  # sum over the later ranks
    start = fwd.sum(axis=-1, keepdims=True) + after / np.asarray(chunks, dtype=float)[..., None]
    floor = (start + np.asarray(m, dtype=float)[..., None] * reduce).max(axis=-1)
    return np.where(reduce.max(axis=-1) > 0, floor, 0.0)


def nic_shared_reduce_s(reduce: Any, compute: Any, nic_in: Any, nic_out: Any) -> tuple[Any, Any]:
    """What an asynchronous reduction stream (Engine.grad_reduce_async) costs beyond dataparallel.async_reduce_s
    when it crosses nodes on the NIC that the compute stream's own exposed transfers also use (one NIC per
    GPU: DGX H100, profiles/dgx-h100-80gb.yaml): (exposed seconds per microbatch added, stream seconds per
    microbatch added). Per microbatch: `reduce` the stream's reductions, `compute` the layers' time the stream
    runs beside (async_reduce_s's C), `nic_in` the part of that time the compute stream spends on the same NIC
    (the CP exchange across nodes), `nic_out` its NIC transfers outside the layers (pipeline hops across
    nodes). Numbers or numpy arrays.

    Concurrent transfers on one link share it: two NCCL operations over one link at once each get about half
    of it, together what one gets alone (NVIDIA/nccl issue 1094, nccl-tests on 4 A100s: a 256 MB all-reduce
    takes 1.8 ms alone and 4.2 ms beside a second one; issue 204: two broadcasts between two GPUs, 12 GB/s
    alone, 6 + 6 at once). A compute-stream transfer X = nic_in + nic_out that meets the stream takes
    twice as long while they overlap, and the stream loses as much; it meets it for the stream's busy share
    u = min(1, reduce / (compute + nic_out)) of the slot. So the slot is max(compute + nic_out + u X,
    reduce + X): the NIC carries both (reduce + X, whatever the overlap) and the layers wait u X for it; the
    stream's work for pipeline.reduce_stream_floor_s grows by u X. No NIC traffic beside it: nothing added."""
    reduce, compute, nic_in, nic_out = (np.asarray(a, dtype=float) for a in (reduce, compute, nic_in, nic_out))
    nic = nic_in + nic_out
    slot = compute + nic_out
    busy = np.minimum(1.0, reduce / np.where(slot > 0, slot, 1.0))
    before = np.maximum(reduce - compute, 0.0)
    after = np.maximum(np.maximum(reduce + nic_in - compute, busy * nic), 0.0)
    return after - before, busy * nic
