"""A fast, vectorised first estimate of every candidate, to choose which ones the exact cost model sees.

Per-layer costs come from the cost model (`estimate_layer`, once per kind of layer and per distinct
(tp, cp, ep, sp, microbatch, recompute)); the assembly into a step time and a peak memory uses the
published approximations below, in numpy over all candidates at once. Final numbers never come from
here: search.py re-estimates the shortlist with `estimate_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from autoplan.cluster.types import ClusterSpec
from autoplan.graph.types import LayerGraph, LayerRole
from autoplan.plan.types import ParallelConfig, Schedule
from autoplan.search.space import RECOMPUTES, SCHEDULES, Space

# per-layer fields gathered from LayerCost, in this order
FIELDS = ("time", "bwd_weight", "act", "params", "dense_params", "expert_params", "out_bytes", "work")
_KEY_COLS = ("tp", "cp", "ep", "sp", "microbatch", "recompute")
# mixed-precision Adam: 2 (bf16 weights) + 2 (bf16 grads) + 12 (fp32 master, momentum, variance) bytes
# per parameter (Rajbhandari et al., ZeRO, 2020, section 3.1)
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2.0, 2.0, 12.0


@dataclass(frozen=True, slots=True)
class Quick:
    """First estimates, one entry per candidate of the Space."""

    step_time_s: np.ndarray
    peak_mem_bytes: np.ndarray
    act_mem_bytes: np.ndarray  # activations on the most loaded rank (for the notes)


def layer_table(graph: LayerGraph, cluster: ClusterSpec, space: Space, cost: Any) -> tuple[np.ndarray, np.ndarray]:
    """(key index per candidate, table [num_keys, num_layers, len(FIELDS)]), estimating each kind once."""
    code = np.zeros(len(space), dtype=np.int64)
    for col in _KEY_COLS:  # one integer per (tp, cp, ep, sp, microbatch, recompute): a fast unique
        values = space.columns[col]
        code = code * (int(values.max(initial=0)) + 1) + values
    _, first_row, key_of = np.unique(code, return_index=True, return_inverse=True)
    kinds = graph.kinds()
    kind_names = list(kinds)
    kind_of = np.array([kind_names.index(layer.kind) for layer in graph.layers])
    first = [kinds[k][0] for k in kind_names]
    table = np.zeros((len(first_row), len(graph.layers), len(FIELDS)))
    for i, row in enumerate(first_row.tolist()):
        tp, cp, ep, sp, mb, rec = (int(space.columns[col][row]) for col in _KEY_COLS)
        recompute = RECOMPUTES[rec]
        config = ParallelConfig(tp=tp, cp=cp, ep=ep, sp=bool(sp), microbatch=mb, recompute=recompute)
        per_kind = np.array([_fields(cost.estimate_layer(layer, cluster, config, recompute, seq_len=graph.seq_len))
                             for layer in first])
        table[i] = per_kind[kind_of]
    return key_of.reshape(-1), table


def _fields(c: Any) -> tuple[float, ...]:
    return (c.time_s, c.bwd_weight_s, c.act_mem_bytes, c.param_count, c.grad_param_count,
            c.expert_param_count, c.output_bytes, getattr(c, "work_mem_bytes", 0))


def inflight(schedule: np.ndarray, p: int, v: int, m: np.ndarray) -> np.ndarray:
    """Microbatches of activations (in units of the rank's whole per-microbatch activations) held by
    each rank, shape [n, p]. GPipe: all m. 1F1B and ZB-H1: p - r on rank r (Narayanan et al. 2021).
    Interleaved: Megatron warms up 2 (p - r - 1) + (v - 1) p chunk-microbatches, each 1/v of the rank's
    layers, so rank 0 holds p + (p - 1)/v (Korthikanti et al. 2022: p (1 + (p - 1)/(p v))). Zero bubble
    as 1F1B (Qi et al. 2024). Never more than the m microbatches there are. The same rule as the cost
    model's in_flight_microbatches, vectorised."""
    r = np.arange(p)[None, :]
    s = schedule[:, None]
    m2 = m[:, None].astype(float)
    one_f_one_b = np.broadcast_to(p - r, (len(m), p)).astype(float)
    interleaved = (2.0 * (p - r - 1) + (v - 1) * p + 1) / v
    out = np.where(s == SCHEDULES.index(Schedule.GPIPE), m2, one_f_one_b)
    out = np.where(s == SCHEDULES.index(Schedule.INTERLEAVED), interleaved, out)
    return np.minimum(out, m2)


def _ring_s(nbytes: np.ndarray, n: np.ndarray, span: np.ndarray, cluster: ClusterSpec, passes: float) -> np.ndarray:
    """passes * (n - 1)/n * S / BW on the link level the group reaches (ring; FORMULAS.md)."""
    intra, inter = cluster.intra_node, cluster.inter_node
    inside = (span <= cluster.devices_per_node) & (cluster.devices_per_node % np.maximum(span, 1) == 0)
    bw = np.where(inside, intra.bw_bytes_per_s * intra.allreduce_busbw_fraction,
                  inter.bw_bytes_per_s * inter.allreduce_busbw_fraction)
    return passes * (n - 1) / np.maximum(n, 1) * nbytes / bw


def quick_estimate(graph: LayerGraph, cluster: ClusterSpec, space: Space, global_batch: int, cost: Any) -> Quick:
    """Step time and peak memory of every candidate with the balanced split and uniform recompute."""
    key_of, table = layer_table(graph, cluster, space, cost)
    c = space.columns
    n = len(space)
    step, peak, act_out = np.zeros(n), np.zeros(n), np.zeros(n)
    names = {layer.name: i for i, layer in enumerate(graph.layers)}
    block = next((i for i, layer in enumerate(graph.layers) if layer.role is LayerRole.BLOCK), 0)
    out_bytes = table[:, block, FIELDS.index("out_bytes")]  # what a pipeline cut sends, per key
    work = table[:, :, FIELDS.index("work")].max(axis=1)
    cum = np.concatenate([np.zeros((table.shape[0], 1, table.shape[2])), np.cumsum(table, axis=1)], axis=1)
    for pp, v in sorted(set(zip(c["pp"].tolist(), c["virtual_stages"].tolist()))):
        idx = np.nonzero((c["pp"] == pp) & (c["virtual_stages"] == v))[0]
        stages = cost.balanced_stages(graph, pp * v)
        bounds = np.array([names[s[0]] for s in stages] + [len(names)])  # stages are contiguous, in order
        keys, inverse = np.unique(key_of[idx], return_inverse=True)
        sub = cum[keys]
        per_stage = sub[:, bounds[1:]] - sub[:, bounds[:-1]]  # [keys, S, F]
        per_rank = per_stage.reshape(len(keys), v, pp, len(FIELDS)).sum(axis=1)[inverse.reshape(-1)]
        cols = {k: col[idx] for k, col in c.items()}
        step[idx], peak[idx], act_out[idx] = _assemble(per_rank, out_bytes[key_of[idx]], work[key_of[idx]], cols,
                                                       pp, v, global_batch, cluster)
    return Quick(step_time_s=step, peak_mem_bytes=peak, act_mem_bytes=act_out)


def _assemble(per_rank: np.ndarray, out_bytes: np.ndarray, work: np.ndarray, c: dict[str, np.ndarray], pp: int, v: int,
              global_batch: int, cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    f = {name: per_rank[:, :, i] for i, name in enumerate(FIELDS)}
    replicas = c["dp"] * c["ep"]
    m = global_batch // (replicas * c["microbatch"])
    t_max = f["time"].max(axis=1)
    sched = c["schedule"]
    # bubble: (p - 1)/v slots of the slowest rank (GPipe / 1F1B / interleaved, Narayanan et al. 2021);
    # zero-bubble schedules fill about two thirds of it (ZB-H1, Qi et al. 2024)
    bubble = np.where(sched == SCHEDULES.index(Schedule.ZERO_BUBBLE), 1.0 / 3.0, 1.0) * (pp - 1) / v
    pipe = (m + bubble) * t_max
    # pipeline sends: forward activation and backward gradient at each of the v cuts per microbatch
    p2p_bw = cluster.inter_node.bw_bytes_per_s * cluster.inter_node.p2p_bw_fraction
    pp_comm = np.where(pp > 1, 2.0 * v * m * out_bytes / p2p_bw, 0.0)
    # data-parallel gradients: dense over dp*ep*cp, experts over dp*cp; ZeRO 0-2 reduce once per step
    # (an all-reduce, or reduce-scatter + all-gather: the same bytes), overlapped with the last
    # microbatch's backward; ZeRO-3 also all-gathers the weights in forward and backward every microbatch
    inner = c["tp"] * c["cp"] * c["ep"]
    dense_n, expert_n = replicas * c["cp"], c["dp"] * c["cp"]
    dense_b = f["dense_params"].max(axis=1) * GRAD_BYTES
    expert_b = f["expert_params"].max(axis=1) * GRAD_BYTES
    span = c["dp"] * inner
    grad_s = _ring_s(dense_b, dense_n, span, cluster, 2.0) + _ring_s(expert_b, expert_n, span, cluster, 2.0)
    dp_exposed = np.maximum(0.0, grad_s - 0.5 * t_max)
    gather_s = 2.0 * m * (_ring_s(dense_b, dense_n, span, cluster, 1.0) + _ring_s(expert_b, expert_n, span, cluster, 1.0))
    dp_exposed += np.where(c["zero"] >= 3, np.maximum(0.0, gather_s - 0.5 * m * t_max), 0.0)
    # memory per rank: model states with ZeRO sharding, activations times microbatches in flight
    shard_params = f["dense_params"] / dense_n[:, None] + f["expert_params"] / expert_n[:, None]
    z = c["zero"][:, None]
    states = (np.where(z >= 3, shard_params, f["params"]) * WEIGHT_BYTES
              + np.where(z >= 2, shard_params, f["params"]) * GRAD_BYTES
              + np.where(z >= 1, shard_params, f["params"]) * OPTIMIZER_BYTES)
    acts = f["act"] * inflight(sched, pp, v, m)
    mem = states + acts + work[:, None]
    params_local = np.where(z >= 1, shard_params, f["params"]).max(axis=1)
    optimizer_s = params_local * (OPTIMIZER_BYTES + WEIGHT_BYTES + GRAD_BYTES) * 2 / (
        cluster.device.mem_bw_bytes_per_s * cluster.device.mem_bw_efficiency)
    step = pipe + pp_comm + dp_exposed + optimizer_s
    peak = mem.max(axis=1) + cluster.device.runtime_reserve_bytes
    return step, peak, acts.max(axis=1)
