"""The quick estimate's per-chunk terms over [candidates, chunks, pipeline ranks] arrays (cost/chunksync.py:
Megatron-Core launching each model chunk's gradient reduction after its last backward, and its weight
all-gathers one chunk after another), from the chunk tables search/surrogate.py builds when the engine asks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from autoplan.cost.chunksync import applies, later_gathers_s, rank_chunk_tail_s
from autoplan.plan.engine import Engine
from autoplan.search.collectives import DENSE_DP, EXPERT_DP, _bucketed_reduce, collective_s
from autoplan.search.exposed import exposed


def chunk_terms(extra, rs_or_ar, layers, sizes, lay, wire, w, cluster, engine, share, frac, pp, v):
    """cost.chunksync's per-chunk terms where the engine asks: (ranks, tail) of the reduction launched chunk by
    chunk (chunk_sync_tail), (rows, exposed) of the chunks' weight all-gathers in turn (chunk_gather_s: the
    distributed optimizer's, ZeRO-1 rows); None where it does not. Prices through search/collectives.py's
    collective_s and _bucketed_reduce; `share`: assemble.fresh_share's [n, 1] (or None)."""
    chunked = gathered = None
    if engine.grad_sync_per_chunk and engine.dp_comm_overlap and pp > 1:
        def bucketed(n: np.ndarray, bucket: float | None = None) -> np.ndarray:
            return _bucketed_reduce(None, n, layers, sizes, lay, wire, cluster, engine, bucket)
        chunked = chunk_sync_tail(*chunk_inputs(extra, rs_or_ar, bucketed, share, engine), frac, pp)
    if engine.param_gather_per_chunk and engine.param_gather_overlap and v > 1:
        gathered = chunk_gather_s(extra, lambda d, e, n: n * (
            collective_s("ag", sizes, DENSE_DP, d / n * w, cluster)
            + collective_s("ag", sizes, EXPERT_DP, e / n * w, cluster)), frac, pp)
        gathered = (lay["shards_gradients"][:, None] == 0, gathered)  # the distributed optimizer (ZeRO-1)
    return chunked, gathered


def chunk_sync_tail(chunk_reduce: np.ndarray, chunk_bwd: np.ndarray, frac: Any, pp: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """cost.chunksync.rank_chunk_tail_s (Engine.grad_sync_per_chunk) over [n, v, p] chunks (rank r's c-th
    chunk's bucketed reduction and one microbatch's backward), called on the chunks' [n, p] arrays: (the
    ranks it applies to, chunksync.applies; their exposed seconds past their last backward plus the
    SM-contention share `frac` of the hidden rest)."""
    v, r = chunk_bwd.shape[1], np.arange(pp)[None, :]
    exposed, hidden = rank_chunk_tail_s([chunk_bwd[:, c] for c in range(v)],
                                        [chunk_reduce[:, c] for c in range(v)], pp, r)
    tail = exposed + frac * hidden
    return np.broadcast_to(applies(pp, v, r), tail.shape), tail


def chunk_inputs(extra: dict[str, np.ndarray], rank_total: np.ndarray, bucketed: Any, share: np.ndarray | None,
                 engine: Engine) -> tuple[np.ndarray, np.ndarray]:
    """(reduction, backward) of each rank's chunks [n, v, p] for chunk_sync_tail: the first chunk's
    chunk_grads in the engine's buckets (`bucketed(grads)`; without buckets the rank's per-layer collectives
    `rank_total` [n, p] shared by the chunks' gradients), every later one's as one collective
    (`bucketed(grads, np.inf)`: cost.chunksync, Megatron-Core's disable_bucketing), chunk_bwd less what
    grad_freed_after_reduce / hp_grads take off (cost.estimate with_fresh_grads at `share`, assemble.fresh_share's
    [n, 1] or None: as assemble_shared's time)."""
    grads, bwd = extra["chunk_dense"] + extra["chunk_expert"], extra["chunk_bwd"]
    if share is not None:
        bwd = bwd - extra["chunk_fresh"] * share[:, :, None]
    total = grads.sum(axis=1)
    first = (bucketed(grads[:, 0]) if engine.dp_bucket_numel  # the rank's per-layer collectives, shared
             else rank_total * grads[:, 0] / np.where(total > 0, total, 1.0))
    red = [first] + [bucketed(grads[:, c], np.inf) for c in range(1, grads.shape[1])]
    return np.stack([np.where(grads[:, c] > 0, r, 0.0) for c, r in enumerate(red)], axis=1), bwd


def chunk_gather_s(extra: dict[str, np.ndarray], gather: Any, frac: Any, pp: int) -> np.ndarray:
    """cost.dataparallel's weight all-gather under Engine.param_gather_per_chunk over [n, p]: the first chunk's
    layer by layer beside its forward (exposed.exposed over its equal layers), each later chunk's whole
    beside the forwards before it (cost.chunksync.later_gathers_s), the SM-contention share `frac` of the
    hidden part on top. `gather(dense, expert, layers)` prices `layers` all-gathers of dense / layers and
    expert / layers parameters each (together)."""
    fwd, dense, expert = extra["chunk_fwd"], extra["chunk_dense"], extra["chunk_expert"]
    first = np.maximum(extra["chunk_layers"][0], 1.0)[None, :]
    out = exposed(fwd[:, 0], gather(dense[:, 0], expert[:, 0], first), None, first, True, True, frac)
    v = fwd.shape[1]
    shown, hidden = later_gathers_s([fwd[:, c] for c in range(v)],
                                    [gather(dense[:, c], expert[:, c], 1.0) for c in range(1, v)], pp)
    return out + shown + frac * hidden
