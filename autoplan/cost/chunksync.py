"""Megatron-Core's per-chunk gradient reduction under a pipeline (Engine.grad_sync_per_chunk).

Megatron-LM core_r0.8.0 (baf94af3) megatron/training/training.py train: with --overlap-grad-reduce and
--delay-grad-reduce (on by default: arguments.py `--no-delay-grad-reduce ... dest='delay_grad_reduce'`),
`config.grad_sync_func = [model_chunk.start_grad_sync for model_chunk in model]` beside the per-chunk
`no_sync_func`. megatron/core/pipeline_parallel/schedules.py then keeps every chunk's buckets in no_sync
through every backward (backward_step_helper ends in `disable_grad_sync()`), so no bucket is launched as
it fills: a chunk's whole reduction (DistributedDataParallel.start_grad_sync -> every bucket's
_reduce_scatter_base / all_reduce, async) is launched by the schedule itself:

- interleaved (forward_backward_pipelining_with_interleaving): after backward k on pipeline rank r,
  `grad_sync_microbatch_id = microbatch_id - pipeline_parallel_rank`; if that id is a chunk's last
  microbatch (is_last_microbatch_for_model_chunk), `config.grad_sync_func[grad_sync_chunk_id](...)`. The
  last group of p x v backwards runs chunk v-1 for p microbatches, then v-2, ..., chunk 0 last, so chunk c
  (c >= 1) is launched with (p - r) backwards of chunk c-1 and p of each chunk below still to run; chunk 0
  ("Launch any remaining grad reductions" after the loop) with none (chunk_windows_s).
- 1F1B (forward_backward_pipelining_without_interleaving): `if config.grad_sync_func is None or rank ==
  0: enable_grad_sync()` before the last backward: the first stage keeps the bucket-by-bucket overlap;
  every other stage launches its whole reduction after its cool-down ("Other pipeline stages do grad
  reduction during pipeline bubble").

Its buckets: the first chunk's are the engine's (dp_bucket_numel), every later chunk's gradients are one
bucket (training.py get_model: `DDP(..., disable_bucketing=(model_chunk_idx > 0))`, "since communication
for these model chunks is overlapped with compute anyway"). Every chunk's DDP reduces over the one data-parallel group (distributed_data_parallel.py
`parallel_state.get_data_parallel_group(with_context_parallel=True)`), one NCCL communicator whose
collectives run one after another in launch order: queued_tail_s. finalize_model_grads then waits for all
(finish_grad_sync). Without a pipeline (forward_backward_no_pipelining) the last microbatch runs outside
no_sync and the bucket hooks launch as buckets fill: not this module. Zero bubble (no Megatron-Core r0.8.0
schedule) is priced as the interleaved one over the rank's chunks in stage order. A MoE's expert buckets
reduce over their own group (get_data_modulo_expert_parallel_group) yet join the one queue here, as the
bucket-hook tail (cost/dataparallel.py) has them on one stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from autoplan.cost.broadcast import scalar


def chunk_windows_s(chunk_bwd: Sequence[Any], p: int, r: Any) -> list[Any]:
    """Backward seconds pipeline rank `r` (of `p`) still runs after it launches chunk c's reduction, per
    chunk c of its v (model order), from the cool-down's backward slots: chunk_bwd[c] is one microbatch's
    backward of chunk c. W_0 = 0; W_c = (p - r) b_{c-1} + p sum_{j < c-1} b_j (module docstring). The slots
    are counted back to back: a drain's waits between them would only hide more (the exposed part is an
    upper bound). Floats, or numpy arrays of one shape (chunk_bwd[c] and r broadcast: the quick estimate's
    [candidates, pipeline ranks], search/chunks.py). W_{c+1} - W_c = (p - r) b_c + r b_{c-1} >= 0: the
    windows never shrink with c, so chunk v-1 is launched first (queued_tail_s)."""
    out = [0.0]
    for c in range(1, len(chunk_bwd)):
        out.append((p - r) * chunk_bwd[c - 1] + p * sum(chunk_bwd[: c - 1]))
    return out


def queued_tail_s(windows: Sequence[Any], reduces: Sequence[Any]) -> Any:
    """Seconds the reductions run past the rank's last backward: chunk c's `reduces[c]` is queued `windows[c]`
    before that end on the one communicator, which runs them in launch order (chunk v-1 first: `windows`
    never shrink with c, as chunk_windows_s's); each starts when launched and when the one before it is
    done. Zero when all finish in time. Floats or numpy arrays (elementwise)."""
    end: Any = float("-inf")
    for c in reversed(range(len(windows))):
        end = np.maximum(end, -windows[c]) + reduces[c]
    return scalar(np.maximum(end, 0.0)) if len(reduces) else 0.0


def applies(p: int, v: int, r: Any) -> Any:
    """Whether pipeline rank r's once-per-step reduction is launched per chunk by the schedule (interleaved:
    every rank; 1F1B: all but the first stage, which keeps the bucket hooks); never without a pipeline.
    `r` an int or a numpy array of ranks (elementwise)."""
    return (p > 1) & ((v > 1) | (r > 0))


def rank_chunk_tail_s(chunk_bwd: Sequence[Any], chunk_reduces: Sequence[Any], p: int, r: Any) -> tuple[Any, Any]:
    """(exposed, hidden) seconds of rank r's per-chunk reductions (chunk_reduces[c], chunk c's buckets summed)
    past its last backward: queued_tail_s over chunk_windows_s; with one chunk (1F1B, r > 0) the whole
    reduction. Hidden is what ran beside the remaining backwards (it slows them: overlap.hidden_penalty_s).
    Floats, or numpy arrays per chunk (search/chunks.py chunk_sync_tail)."""
    exposed = queued_tail_s(chunk_windows_s(chunk_bwd, p, r), chunk_reduces)
    return exposed, scalar(np.maximum(sum(chunk_reduces) - exposed, 0.0))


def chunk_spans(chunks: Sequence[int]) -> list[range]:
    """Indices into a rank's layers of each of its chunks, from the chunks' layer counts (Rank.chunks)."""
    out, start = [], 0
    for n in chunks:
        out.append(range(start, start + n))
        start += n
    return out


def later_gathers_s(chunk_fwd: Sequence[float], gathers: Sequence[float], p: int) -> tuple[float, float]:
    """(exposed, hidden) seconds of the weight all-gathers of a rank's chunks after the first under
    Engine.param_gather_per_chunk (the first chunk's are priced layer by layer beside its forward, as without
    the field). Megatron-LM core_r0.8.0 megatron/core/optimizer/distrib_optimizer.py: zero_grad dispatches
    the first bucket's all-gather; _finish_param_sync_helper, called by the forward pre-hook of the first
    module that needs a bucket, waits for it and only then dispatches the next ("We can't pre-launch
    all-gathers for all buckets at once"), in _get_model_param_buffer_dp_views' order: the chunks in turn,
    each in forward order, every chunk after the first one bucket (get_model's disable_bucketing). The
    interleaved schedule runs p forwards of chunk c-1 (schedules.py get_model_chunk_id: groups of p
    microbatches) before chunk c's first: chunk c's gather, dispatched at the start of chunk c-1's first
    forward (c >= 2) or near the end of it (c = 1), has p x f_{c-1} (c >= 2) or (p - 1) x f_0 (c = 1) of
    forward beside it (`chunk_fwd`, one microbatch's); the rest is exposed. Floats, or numpy arrays per chunk
    (search/chunks.py chunk_gather_s)."""
    exposed: Any = 0.0
    hidden: Any = 0.0
    for c in range(1, len(chunk_fwd)):
        window = (p - 1 if c == 1 else p) * chunk_fwd[c - 1]
        exposed = exposed + np.maximum(gathers[c - 1] - window, 0.0)
        hidden = hidden + np.minimum(gathers[c - 1], window)
    return scalar(exposed), scalar(hidden)
