"""A fast, vectorised first estimate of every candidate, to choose which ones the exact cost model sees.

Per-layer costs come from the cost model (`estimate_layer`, once per kind of layer and per distinct value of
the key columns it reads, kept on disk per cluster: layer_table); the assembly into a step time and a peak memory is
search/assemble.py, built from the exact model's own functions, in numpy over all candidates at once.
Final numbers never come from here: search.py re-estimates the shortlist with `estimate_config`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoplan.cluster.types import ClusterSpec
from autoplan.graph.types import LayerGraph, LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.layout import stage_ranks
from autoplan.plan.types import MESH_AXIS_ORDER, ParallelConfig, Schedule
from autoplan.search.assemble import assemble, max_param_numel
from autoplan.search.assemble import inflight as _inflight
from autoplan.search.layercache import layer_costs
from autoplan.search.space import RECOMPUTES, SCHEDULES, Space

# per-layer fields gathered from LayerCost, in this order
FIELDS = ("time", "fwd", "bwd_weight", "act", "params", "dense_params", "expert_params", "out_bytes", "work", "host")
_KEY_COLS = ("tp", "cp", "ep", "sp", "microbatch", "recompute", "etp", "eep")
# what a key column a layer does not read is set to (recompute 0: Recompute.NONE; etp, eep 0: as tp, ep)
_CANONICAL = {"ep": 1, "recompute": 0, "etp": 0, "eep": 0}
_EXPERT_COLS = ("ep", "etp", "eep")  # read by layers with routed experts only


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

        values = layer_costs(layer, cluster, graph.seq_len, FIELDS, keys, compute, engine=getattr(cost, "engine", None))
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
            c.grad_param_count, c.expert_param_count, c.output_bytes, getattr(c, "work_mem_bytes", 0),
            getattr(c, "host_s", 0.0))


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


def quick_estimate(graph: LayerGraph, cluster: ClusterSpec, space: Space, global_batch: int, cost: Any) -> Quick:
    """Step time and peak memory of every candidate with the balanced split and uniform recompute, for the
    engine `cost` is bound to (autoplan.cost.with_engine; the plain module means autoplan's executor)."""
    engine = getattr(cost, "engine", None) or Engine()
    key_of, table = layer_table(graph, cluster, space, cost)
    c = space.columns
    n = len(space)
    step, peak, act_out = np.zeros(n), np.zeros(n), np.zeros(n)
    names = {layer.name: i for i, layer in enumerate(graph.layers)}
    block = next((i for i, layer in enumerate(graph.layers) if layer.role is LayerRole.BLOCK), 0)
    out_bytes = table[:, block, FIELDS.index("out_bytes")]  # what a pipeline cut sends
    cum = np.concatenate([np.zeros((table.shape[0], 1, table.shape[2])), np.cumsum(table, axis=1)], axis=1)
    v_shape = ((c["schedule"] == SCHEDULES.index(Schedule.ZERO_BUBBLE)) & (c["virtual_stages"] == 2)).astype(int)
    max_numel = max_param_numel(graph, c["tp"])
    for pp, v, vee in sorted(set(zip(c["pp"].tolist(), c["virtual_stages"].tolist(), v_shape.tolist()))):
        idx = np.nonzero((c["pp"] == pp) & (c["virtual_stages"] == v) & (v_shape == vee))[0]
        config = space.config(int(idx[0]))  # the schedule decides the placement (plan.layout.stage_ranks)
        stages = cost.balanced_stages(graph, config)
        bounds = np.array([names[s[0]] for s in stages] + [len(names)])  # stages are contiguous, in order
        ranks = stage_ranks(config)
        placement = np.zeros((pp * v, pp))
        placement[np.arange(pp * v), ranks] = 1.0  # [stage, rank]
        layers_per_rank = np.diff(bounds) @ placement
        keys, inverse = np.unique(key_of[idx], return_inverse=True)
        sub = cum[keys]
        per_stage = sub[:, bounds[1:]] - sub[:, bounds[:-1]]  # [keys, S, F]
        per_rank = np.einsum("ksf,sr->krf", per_stage, placement)[inverse.reshape(-1)]
        extra = {"hops": np.broadcast_to(_hops(ranks, pp), (len(idx), pp)), "out_bytes": out_bytes[key_of[idx]],
                 "max_numel": max_numel[idx]}
        if engine.zero3 == "deepspeed" and engine.zero3_regather_persistent:
            extra["regather_ops"] = _regather_ops(graph, cluster, c, idx, cost, engine)
        for name in ("params", "work"):  # per-rank maxima over the rank's stages
            stage_max = np.maximum.reduceat(table[keys][:, :, FIELDS.index(name)], bounds[:-1], axis=1)
            rank_max = np.stack([stage_max[:, [s for s, r in enumerate(ranks) if r == k]].max(axis=1)
                                 for k in range(pp)], axis=1)
            extra["max_params" if name == "params" else "work"] = rank_max[inverse.reshape(-1)]
        f = {name: per_rank[:, :, i] for i, name in enumerate(FIELDS)}
        cols = {k: col[idx] for k, col in c.items()}
        step[idx], peak[idx], act_out[idx] = assemble(f, layers_per_rank, extra, cols, pp, v, global_batch,
                                                      cluster, engine)
    return Quick(step_time_s=step, peak_mem_bytes=peak, act_mem_bytes=act_out)


def _regather_ops(graph: LayerGraph, cluster: ClusterSpec, c: dict[str, np.ndarray], idx: np.ndarray, cost: Any,
                  engine: Engine) -> np.ndarray:
    """Host ops per layer of DeepSpeed's per-step re-gather of the persistent parameters
    (cost.deepspeed.persistent_regather over one block's small parameters, cost.dataparallel.
    layer_small_numels), per candidate: each distinct (tp, data-parallel size) priced once."""
    from autoplan.cost.dataparallel import layer_small_numels
    from autoplan.cost.deepspeed import persistent_regather

    block = next((layer for layer in graph.layers if layer.role is LayerRole.BLOCK), None)
    out = np.zeros(len(idx))
    if block is None:
        return out
    tp, n = c["tp"][idx], (c["dp"] * c["ep"] * c["cp"])[idx]
    for t, size in set(zip(tp.tolist(), n.tolist())):
        config = ParallelConfig(tp=t)
        layer_cost = cost.estimate_layer(block, cluster, config, "none", seq_len=graph.seq_len)
        small = [x for x in layer_small_numels(block, layer_cost, graph, config) if x < engine.zero3_persistence_numel]
        out[(tp == t) & (n == size)] = persistent_regather(small, size)[0]
    return out


def _hops(placement: tuple[int, ...], pp: int) -> np.ndarray:
    """Point-to-point transfers per microbatch on each rank: one per cut between stages on different
    ranks, counted on both sides (the sender's forward, the receiver's backward), as estimate_config."""
    out = np.zeros(pp)
    for a, b in itertools.pairwise(placement):
        if a != b:
            out[a] += 1.0
            out[b] += 1.0
    return out


def inflight(schedule: np.ndarray, p: int, v: int, m: np.ndarray) -> np.ndarray:
    """Microbatches of activations held by each rank [n, p]: cost.pipeline.in_flight_microbatches in
    numpy (search.assemble.inflight)."""
    return _inflight(schedule, p, v, m)
