"""A fast, vectorised first estimate of every candidate, to choose which ones the exact cost model sees.

Per-layer costs come from the cost model (`estimate_layer`, once per kind of layer and per distinct
(tp, cp, ep, sp, microbatch, recompute)); the assembly into a step time and a peak memory uses the
published approximations below, in numpy over all candidates at once. Final numbers never come from
here: search.py re-estimates the shortlist with `estimate_config`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoplan.cluster.types import ClusterSpec
from autoplan.cost.estimate import GRAD_REDUCE_BYTES
from autoplan.graph.types import LayerGraph, LayerRole
from autoplan.plan.layout import stage_ranks
from autoplan.plan.types import MESH_AXIS_ORDER, ParallelConfig, Schedule
from autoplan.search.layercache import layer_costs
from autoplan.search.space import RECOMPUTES, SCHEDULES, Space

# per-layer fields gathered from LayerCost, in this order
FIELDS = ("time", "fwd", "bwd_weight", "act", "params", "dense_params", "expert_params", "out_bytes", "work")
_KEY_COLS = ("tp", "cp", "ep", "sp", "microbatch", "recompute", "etp", "eep")
# what a key column a layer does not read is set to (recompute 0: Recompute.NONE; etp, eep 0: as tp, ep)
_CANONICAL = {"ep": 1, "recompute": 0, "etp": 0, "eep": 0}
_EXPERT_COLS = ("ep", "etp", "eep")  # read by layers with routed experts only
# mixed-precision Adam: 2 (bf16 weights) + 2 (bf16 grads) + 12 (fp32 master, momentum, variance) bytes
# per parameter (Rajbhandari et al., ZeRO, 2020, section 3.1)
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2.0, 2.0, 12.0
# Adam over the local shard, memory-bound: read + write 12 bytes of fp32 states, read the 16-bit gradient
# twice, write the 16-bit weights (the cost model's ADAM_BYTES_PER_PARAM)
ADAM_BYTES = 30.0


@dataclass(frozen=True, slots=True)
class Quick:
    """First estimates, one entry per candidate of the Space."""

    step_time_s: np.ndarray
    peak_mem_bytes: np.ndarray
    act_mem_bytes: np.ndarray  # activations on the most loaded rank (for the notes)


def _codes(space: Space, cols: tuple[str, ...], rows: np.ndarray | None = None) -> np.ndarray:
    """One integer per distinct combination of `cols` (a fast unique)."""
    code = np.zeros(len(space) if rows is None else len(rows), dtype=np.int64)
    for col in cols:
        values = space.columns[col] if rows is None else space.columns[col][rows]
        code = code * (int(space.columns[col].max(initial=0)) + 1) + values
    return code


def layer_table(graph: LayerGraph, cluster: ClusterSpec, space: Space, cost: Any) -> tuple[np.ndarray, np.ndarray]:
    """(key index per candidate, table [num_keys, num_layers, len(FIELDS)]). Each kind of layer is estimated
    once per distinct value of the key columns it depends on, then broadcast to every layer of the kind:
    (tp, cp, sp, microbatch), recompute only for blocks (the cost model recomputes BLOCK-role layers only:
    cost/compute.layer_compute, cost/memory.other_activation_bytes), ep, etp and eep only for layers with routed
    experts (nothing else in estimate_layer reads them); test_search_layer_table checks both against
    estimate_layer.
    Costs computed once are kept on disk (layercache.layer_costs), so a later plan on the cluster reuses them."""
    _, first_row, key_of = np.unique(_codes(space, _KEY_COLS), return_index=True, return_inverse=True)
    kinds = graph.kinds()
    kind_names = list(kinds)
    kind_of = np.array([kind_names.index(layer.kind) for layer in graph.layers])
    per_kind = np.zeros((len(first_row), len(kind_names), len(FIELDS)))
    for k, name in enumerate(kind_names):
        layer = kinds[name][0]
        cols = _key_cols(layer)
        _, rows, inverse = np.unique(_codes(space, cols, first_row), return_index=True, return_inverse=True)
        keys = np.stack([space.columns[c][first_row[rows]] if c in cols else np.full(len(rows), _CANONICAL[c])
                         for c in _KEY_COLS], axis=1)
        # dp: any valid one (a layer's cost does not depend on it; folded expert degrees need the stage's ranks)
        dps = space.columns["dp"][first_row[rows]]

        def compute(missing: np.ndarray, layer: Any = layer, keys: np.ndarray = keys, dps: np.ndarray = dps
                    ) -> np.ndarray:
            return np.array([_fields(_estimate(layer, cluster, keys[i].tolist(), int(dps[i]), graph, cost))
                             for i in missing.tolist()])

        values = layer_costs(layer, cluster, graph.seq_len, FIELDS, keys, compute)
        per_kind[:, k] = values[inverse.reshape(-1)]
    return key_of.reshape(-1), per_kind[:, kind_of]


def split_by_layer_key(space: Space, parts: int) -> list[np.ndarray]:
    """The candidate rows in `parts` pieces, each holding whole groups of (tp, cp, sp, microbatch), the key
    columns every kind of layer reads (so no layer cost is estimated in two pieces), balanced by row count:
    groups by size, largest first, each to the lightest piece so far."""
    shared = tuple(c for c in _KEY_COLS if c not in _CANONICAL)
    _, group_of, counts = np.unique(_codes(space, shared), return_inverse=True, return_counts=True)
    load, owner = np.zeros(parts), np.empty(len(counts), dtype=np.int64)
    for group in np.argsort(-counts, kind="stable").tolist():
        owner[group] = int(np.argmin(load))
        load[owner[group]] += counts[group]
    piece = owner[group_of.reshape(-1)]
    return [np.nonzero(piece == i)[0] for i in range(parts)]


def _key_cols(layer: Any) -> tuple[str, ...]:
    """The key columns estimate_layer reads for this layer (see layer_table)."""
    skip = set(_EXPERT_COLS) if not layer.num_experts else set()
    skip |= {"recompute"} if layer.role is not LayerRole.BLOCK else set()
    return tuple(c for c in _KEY_COLS if c not in skip)


def _estimate(layer: Any, cluster: ClusterSpec, key: list[int], dp: int, graph: LayerGraph, cost: Any) -> Any:
    tp, cp, ep, sp, mb, rec, etp, eep = key
    config = ParallelConfig(tp=tp, cp=cp, ep=ep, sp=bool(sp), microbatch=mb, recompute=RECOMPUTES[rec], dp=dp,
                            etp=etp, eep=eep)
    return cost.estimate_layer(layer, cluster, config, RECOMPUTES[rec], seq_len=graph.seq_len)


def _fields(c: Any) -> tuple[float, ...]:
    return (c.time_s, c.fwd_s + getattr(c, "fwd_comm_s", 0.0), c.bwd_weight_s, c.act_mem_bytes, c.param_count,
            c.grad_param_count, c.expert_param_count, c.output_bytes, getattr(c, "work_mem_bytes", 0))


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


_COMM = ("ar_dense", "rs_dense", "ag_dense", "ar_expert", "rs_expert", "ag_expert", "p2p")


def _placement(sizes: tuple[int, ...], wanted: tuple[str, ...], devices_per_node: int, cost: Any) -> Any:
    """cost.comm.group_placement's rule in numpy: the group of rank 0 along `wanted` axes (sizes in
    MESH_AXIS_ORDER, tp innermost), its node count and its fewest members on a node."""
    ranks = np.zeros(1, dtype=np.int64)
    stride = 1
    for axis, size in zip(reversed(MESH_AXIS_ORDER), reversed(sizes)):
        if axis.value in wanted and size > 1:
            ranks = (ranks[None, :] + stride * np.arange(size)[:, None]).ravel()
        stride *= size
    counts = np.bincount(ranks // devices_per_node)
    counts = counts[counts > 0]
    return cost.GroupPlacement(size=len(ranks), num_nodes=len(counts), per_node=int(counts.min()))


def comm_lines(space: Space, cluster: ClusterSpec, cost: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per candidate, (alpha, beta) with time = alpha + beta * bytes for the collectives of its mesh, from
    the cost model's own functions (two sizes per unique mesh; exact for its ring formulas)."""
    c = space.columns
    code = np.zeros(len(space), dtype=np.int64)
    for col in ("pp", "dp", "ep", "cp", "tp", "etp", "eep"):
        code = code * (int(c[col].max(initial=0)) + 1) + c[col]
    _, first_row, inverse = np.unique(code, return_index=True, return_inverse=True)
    uniq = [tuple(int(c[k][r]) for k in ("pp", "dp", "ep", "cp", "tp", "etp", "eep")) for r in first_row.tolist()]
    lines = np.zeros((len(uniq), len(_COMM), 2))
    s1, s2 = 1e8, 2e8
    dpn = cluster.devices_per_node
    for i, (*sizes, etp, eep) in enumerate(uniq):
        dense = _placement(tuple(sizes), ("dp", "ep", "cp"), dpn, cost)
        pp, dp, ep, cp, tp = sizes  # the experts' data-parallel group, folded or not (cost.experts)
        expert = cost.expert_dp_placement(ParallelConfig(pp=pp, dp=dp, ep=ep, cp=cp, tp=tp, etp=etp, eep=eep), dpn)
        cross = _placement(tuple(sizes), ("pp",), dpn, cost).crosses_nodes
        calls = ((cost.all_reduce_s, dense), (cost.reduce_scatter_s, dense), (cost.all_gather_s, dense),
                 (cost.all_reduce_s, expert), (cost.reduce_scatter_s, expert), (cost.all_gather_s, expert),
                 (cost.p2p_s, cross))
        for k, (fn, group) in enumerate(calls):
            t1, t2 = fn(s1, group, cluster), fn(s2, group, cluster)
            beta = (t2 - t1) / (s2 - s1)
            lines[i, k] = (t1 - beta * s1, beta)
    per = lines[inverse.reshape(-1)]
    return {name: (per[:, k, 0], per[:, k, 1]) for k, name in enumerate(_COMM)}


def _t(line: tuple[np.ndarray, np.ndarray], nbytes: np.ndarray) -> np.ndarray:
    alpha, beta = line
    if nbytes.ndim == 2:
        alpha, beta = alpha[:, None], beta[:, None]
    return np.where(nbytes > 0, alpha + beta * nbytes, 0.0)


def quick_estimate(graph: LayerGraph, cluster: ClusterSpec, space: Space, global_batch: int, cost: Any) -> Quick:
    """Step time and peak memory of every candidate with the balanced split and uniform recompute."""
    key_of, table = layer_table(graph, cluster, space, cost)
    lines = comm_lines(space, cluster, cost)
    c = space.columns
    n = len(space)
    step, peak, act_out = np.zeros(n), np.zeros(n), np.zeros(n)
    names = {layer.name: i for i, layer in enumerate(graph.layers)}
    block = next((i for i, layer in enumerate(graph.layers) if layer.role is LayerRole.BLOCK), 0)
    per_key = {"out_bytes": table[:, block, FIELDS.index("out_bytes")],  # what a pipeline cut sends
               "work": table[:, :, FIELDS.index("work")].max(axis=1),
               "max_params": table[:, :, FIELDS.index("params")].max(axis=1)}
    cum = np.concatenate([np.zeros((table.shape[0], 1, table.shape[2])), np.cumsum(table, axis=1)], axis=1)
    v_shape = ((c["schedule"] == SCHEDULES.index(Schedule.ZERO_BUBBLE)) & (c["virtual_stages"] == 2)).astype(int)
    for pp, v, vee in sorted(set(zip(c["pp"].tolist(), c["virtual_stages"].tolist(), v_shape.tolist()))):
        idx = np.nonzero((c["pp"] == pp) & (c["virtual_stages"] == v) & (v_shape == vee))[0]
        config = space.config(int(idx[0]))  # the schedule decides the placement (plan.layout.stage_ranks)
        stages = cost.balanced_stages(graph, config)
        bounds = np.array([names[s[0]] for s in stages] + [len(names)])  # stages are contiguous, in order
        placement = np.zeros((pp * v, pp))
        placement[np.arange(pp * v), stage_ranks(config)] = 1.0  # [stage, rank]
        layers_per_rank = np.diff(bounds) @ placement
        hops_per_rank = _hops(stage_ranks(config), pp)
        keys, inverse = np.unique(key_of[idx], return_inverse=True)
        sub = cum[keys]
        per_stage = sub[:, bounds[1:]] - sub[:, bounds[:-1]]  # [keys, S, F]
        per_rank = np.einsum("ksf,sr->krf", per_stage, placement)[inverse.reshape(-1)]
        cols = {k: col[idx] for k, col in c.items()}
        extra = {k: val[key_of[idx]] for k, val in per_key.items()}
        sel = {k: (a[idx], b[idx]) for k, (a, b) in lines.items()}
        extra["hops"] = np.broadcast_to(hops_per_rank, (len(idx), pp))
        step[idx], peak[idx], act_out[idx] = _assemble(per_rank, layers_per_rank, extra, sel, cols, pp, v,
                                                       global_batch, cluster)
    return Quick(step_time_s=step, peak_mem_bytes=peak, act_mem_bytes=act_out)


def _hops(placement: tuple[int, ...], pp: int) -> np.ndarray:
    """Point-to-point transfers per microbatch on each rank: one per cut between stages on different
    ranks, counted on both sides (the sender's forward, the receiver's backward), as estimate_config."""
    out = np.zeros(pp)
    for a, b in itertools.pairwise(placement):
        if a != b:
            out[a] += 1.0
            out[b] += 1.0
    return out


def _assemble(per_rank: np.ndarray, layers_per_rank: np.ndarray, extra: dict[str, np.ndarray],
              lines: dict[str, tuple[np.ndarray, np.ndarray]], c: dict[str, np.ndarray], pp: int, v: int,
              global_batch: int, cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The cost model's assembly (estimate_config) in closed form over [candidates, ranks] arrays."""
    f = {name: per_rank[:, :, i] for i, name in enumerate(FIELDS)}
    m = global_batch // (c["dp"] * c["ep"] * c["microbatch"])
    z = c["zero"][:, None]
    n_layers = np.maximum(layers_per_rank, 1)[None, :].astype(float)
    fwd, bwd = f["fwd"], f["time"] - f["fwd"]
    # pipeline cuts: a rank sends its activation forward at each cut after its stages and its gradient
    # back at each cut before them (hops per rank from the placement; none inside a rank)
    hops = extra["hops"] * _t(lines["p2p"], extra["out_bytes"])[:, None] if pp > 1 else 0.0
    # ZeRO: 16-bit weight gathers and gradient reduce-scatters, prefetched / bucketed on a second stream;
    # what the layers' compute does not hide is exposed (cost.overlap.exposed_s, closed form for equal
    # layers: the uncovered excess plus one layer's collective)
    # gradients travel at the cost model's reduce dtype (fp32 under bf16: GRAD_REDUCE_BYTES)
    wire = GRAD_REDUCE_BYTES[cluster.dtype]
    wbytes, gbytes = f["dense_params"] * WEIGHT_BYTES, f["dense_params"] * wire
    ebytes, egbytes = f["expert_params"] * WEIGHT_BYTES, f["expert_params"] * wire
    gather = _t(lines["ag_dense"], wbytes) + _t(lines["ag_expert"], ebytes)
    scatter = _t(lines["rs_dense"], gbytes) + _t(lines["rs_expert"], egbytes)
    reduce = np.where(z >= 1, scatter, _t(lines["ar_dense"], gbytes) + _t(lines["ar_expert"], egbytes))
    z3_fwd = np.maximum(gather - fwd, 0.0) + gather / n_layers
    z3_bwd = np.maximum(gather + scatter - bwd, 0.0) + (gather + scatter) / n_layers
    z2_bwd = np.maximum(scatter - bwd, 0.0) + scatter / n_layers
    per_mb_dp = np.where(z == 3, z3_fwd + z3_bwd, np.where(z == 2, z2_bwd, 0.0))
    x = f["time"] + hops + per_mb_dp
    bwd_all = bwd + per_mb_dp
    # pipeline_time_s: m max_r X_r + (sum_r Y_r - max_r Y_r) / v'
    zb = (c["schedule"] == SCHEDULES.index(Schedule.ZERO_BUBBLE))[:, None]
    y = np.where(zb, np.maximum(x - (2.0 if v == 1 else 3.0) * f["bwd_weight"], 0.0), x)
    chunks = np.where((c["schedule"] == SCHEDULES.index(Schedule.INTERLEAVED)) | zb[:, 0], v, 1)
    pipe = m * x.max(axis=1) + (y.sum(axis=1) - y.max(axis=1)) / chunks
    # ZeRO-0/1: one reduction per step after the last microbatch, overlapped with that backward; rank r
    # finishes its last backward sum_{k<r} B_k before rank 0 does
    tail = np.maximum(reduce - bwd_all, 0.0) + reduce / n_layers
    offsets = np.cumsum(bwd_all, axis=1) - bwd_all
    dp_tail = np.where(c["zero"] <= 1, np.maximum((tail - offsets).max(axis=1), 0.0), 0.0)
    # ZeRO-1/2: all-gather the updated 16-bit weights after the optimizer step (exposed)
    param_gather = np.where((c["zero"] == 1) | (c["zero"] == 2), gather.max(axis=1), 0.0)
    dense_n = c["dp"] * c["ep"] * c["cp"]
    # ParallelConfig.expert_dp: dp * cp unfolded, the stage's ranks over etp * eep when folded
    expert_n = dense_n * c["tp"] // (np.where(c["etp"] > 0, c["etp"], c["tp"]) * np.where(c["eep"] > 0, c["eep"], c["ep"]))
    shard = f["dense_params"] / dense_n[:, None] + f["expert_params"] / expert_n[:, None]
    local = np.where(z >= 1, shard, f["params"]).max(axis=1)
    optimizer_s = local * ADAM_BYTES / (cluster.device.mem_bw_bytes_per_s * cluster.device.mem_bw_efficiency)
    step = pipe + dp_tail + param_gather + optimizer_s
    # memory per rank: model states with ZeRO sharding (+ ZeRO-3's two gathered layers), activations times
    # microbatches in flight, one layer's backward working set, the runtime reserve
    states = (np.where(z >= 3, shard, f["params"]) * WEIGHT_BYTES + np.where(z >= 2, shard, f["params"]) * GRAD_BYTES
              + np.where(z >= 1, shard, f["params"]) * OPTIMIZER_BYTES)
    states += np.where(z == 3, 2.0 * extra["max_params"][:, None] * WEIGHT_BYTES, 0.0)
    acts = f["act"] * inflight(c["schedule"], pp, v, m)
    mem = states + acts + extra["work"][:, None]
    return step, mem.max(axis=1) + cluster.device.runtime_reserve_bytes, acts.max(axis=1)
