"""A fast, vectorised first estimate of every candidate, to choose which ones the exact cost model sees.

Per-layer costs come from the cost model (`estimate_layer`, once per kind of layer and per distinct value of
the key columns it reads, kept on disk per cluster: layer_table); the assembly into a step time and a peak memory is
search/assemble.py, built from the exact model's own functions, in numpy over all candidates at once.
Final numbers never come from here: search.py re-estimates the shortlist with `estimate_config`.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoplan.cluster.types import ClusterSpec
from autoplan.cost.reserve import block_hidden
from autoplan.graph.types import LayerGraph, LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.layout import stage_ranks
from autoplan.plan.types import MESH_AXIS_ORDER, ParallelConfig, Schedule
from autoplan.search.assemble import assemble_shared, microbatches
from autoplan.search.deepspeed_terms import _deepspeed_step_terms, block_weights, max_param_numel
from autoplan.search.layercache import layer_costs
from autoplan.search.pricing import Pricing, int_codes
from autoplan.search.rootunit import ROOT_PER_KEY, ROOT_SHARED, rank_roots, uses_roots
from autoplan.search.schedules import by_schedule
from autoplan.search.schedules import inflight as _inflight
from autoplan.search.space import RECOMPUTES, SCHEDULES, Space

# per-layer fields gathered from LayerCost, in this order
FIELDS = ("time", "fwd", "bwd_weight", "act", "params", "dense_params", "expert_params", "out_bytes", "work", "host",
          "fresh", "cp")
# the fields summed per pipeline rank (search/assemble.py reads these sums; of params and work the maxima)
SUMMED = ("time", "fwd", "bwd_weight", "act", "dense_params", "expert_params", "host", "fresh", "cp")
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
    table = np.empty((per_kind.shape[0], len(kind_of), per_kind.shape[2]))
    for i, k in enumerate(kind_of.tolist()):  # per_kind[:, kind_of], a layer at a time: a tenth of the time of
        table[:, i] = per_kind[:, k]  # numpy's fancy gather of 80-byte rows (2.1 s for deepseek-v3's 224 MB)
    return key_of.reshape(-1), table


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
    config = key_config(tp=tp, cp=cp, ep=ep, sp=bool(sp) and tp > 1, microbatch=mb, recompute=RECOMPUTES[rec],
                        dp=dp, etp=etp, eep=eep)
    return cost.estimate_layer(layer, cluster, config, RECOMPUTES[rec], seq_len=graph.seq_len)


_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ParallelConfig)}


def key_config(**fields: Any) -> ParallelConfig:
    """The ParallelConfig of a layer-table key, its fields set without __post_init__'s checks (a tenth of a
    cold layer table's time): a key's values are a valid candidate's (enumerate_space), given as
    __post_init__ leaves them (Python ints, enums, sp only over tp > 1; test_search_layer_table checks that
    the result equals the validated one). Anything a user gives still goes through ParallelConfig(...)."""
    config = object.__new__(ParallelConfig)
    for name, value in {**_CONFIG_DEFAULTS, **fields}.items():
        object.__setattr__(config, name, value)
    return config


def _fields(c: Any) -> tuple[float, ...]:
    return (c.time_s, c.forward_s, c.bwd_weight_s, c.act_mem_bytes, c.param_count,
            c.grad_param_count, c.expert_param_count, c.output_bytes, getattr(c, "work_mem_bytes", 0),
            getattr(c, "host_s", 0.0), getattr(c, "fresh_grad_saving_s", 0.0), c.cp_comm_s)


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
    engine `cost` is bound to (autoplan.cost.with_engine; the plain module means autoplan's executor).
    Candidates are assembled per pipeline shape, in chunks of at most CHUNK rows of whole layer-table keys
    (arrays that stay in cache; each candidate's estimate depends on its own row only), those equal but for
    the schedule once (search/schedules.py)."""
    engine = getattr(cost, "engine", None) or Engine()
    key_of, table = layer_table(graph, cluster, space, cost)
    c = space.columns
    step, peak, act_out = np.zeros(len(space)), np.zeros(len(space)), np.zeros(len(space))
    cum = np.empty((table.shape[0], table.shape[1] + 1, len(SUMMED)))  # [keys, layers + 1, summed F], in place:
    cum[:, 0] = 0.0  # deepseek-v3's table is 224 MB, and a concatenate would copy it once more
    for j, name in enumerate(SUMMED):
        np.cumsum(table[:, :, FIELDS.index(name)], axis=1, out=cum[:, 1:, j])
    v_shape = ((c["schedule"] == SCHEDULES.index(Schedule.ZERO_BUBBLE)) & (c["virtual_stages"] == 2)).astype(int)
    max_numel = max_param_numel(graph, table, key_of, c["tp"],
                                (FIELDS.index("dense_params"), FIELDS.index("expert_params")))
    prices: dict = {}  # every collective priced once per quick estimate (search/pricing.py)
    constants = {"tied": graph.tied_embedding_params, "seq_len": graph.seq_len, "hidden": block_hidden(graph.layers),
                 "ds_block_weights": block_weights(graph)}  # the graph's, the same for every row
    for idx in _pipeline_shapes(c["pp"], c["virtual_stages"], v_shape):
        pp, v = int(c["pp"][idx[0]]), int(c["virtual_stages"][idx[0]])
        keys, inverse = np.unique(key_of[idx], return_inverse=True)
        shape = _shape_tables(graph, space.config(int(idx[0])), table, cum, keys, cost,
                              chunks=engine.grad_sync_per_chunk or engine.param_gather_per_chunk,
                              roots=uses_roots(engine, v))
        order = np.argsort(inverse.reshape(-1), kind="stable")  # the rows of each key together
        per_step = (_deepspeed_step_terms(graph, cluster, c, idx, cost, engine)
                    if engine.zero3 == "deepspeed" and (engine.zero3_regather_persistent or engine.zero3_small_grad_hooks
                                                        or engine.zero3_serial_grad_checks) else None)
        for part in _chunks(inverse.reshape(-1)[order], max(CHUNK // pp, 64)):
            rows, key = idx[order[part]], inverse.reshape(-1)[order[part]]
            cols = {k: col[rows] for k, col in c.items()}
            first, of = _unique_but_schedule(cols)  # the rows to assemble: one of each equal but for the schedule
            chunked = {k: shape[k] if k == "chunk_layers" else shape[k][key[first]]
                       for k in shape if k.startswith("chunk_")}
            extra = {**chunked, "hops": np.broadcast_to(shape["hops"], (len(first), pp)),
                     "out_bytes": shape["out_bytes"][key[first]], "act_sends": shape["act_sends"],
                     "act_recvs": shape["act_recvs"], "last_rank": shape["last_rank"],
                     "max_numel": max_numel[rows[first]], "max_params": shape["max_params"][key[first]],
                     "work": shape["work"][key[first]], **constants,
                     **{k: shape[k][key[first]] for k in ROOT_PER_KEY if k in shape},
                     **{k: shape[k] for k in ROOT_SHARED}}
            if per_step is not None:
                extra.update({k: a[order[part]][first] for k, a in per_step.items()})
            f = {name: shape["per_rank"][:, :, i][key[first]] for i, name in enumerate(SUMMED) if name != "act"}
            # candidates of one layer-table key share their per-rank fields, hence (mostly) their collectives
            m = microbatches(cols, global_batch)
            shared = assemble_shared(f, shape["layers_per_rank"], extra, {k: col[first] for k, col in cols.items()},
                                     pp, v, cluster, engine, Pricing(prices, key[first]), m=m[first])
            act, work = shape["per_rank"][:, :, SUMMED.index("act")][key], shape["work"][key]
            step[rows], peak[rows], act_out[rows] = by_schedule(shared, of, cols["schedule"], m, act, work, pp, v)
    return Quick(step_time_s=step, peak_mem_bytes=peak, act_mem_bytes=act_out)


def _unique_but_schedule(cols: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
    """(a row of each distinct combination of the columns other than the schedule, each row's index among
    those; None when every row is its own): the rows search/schedules.py's Shared is assembled for."""
    code = int_codes(*(col for name, col in cols.items() if name != "schedule"))
    _, first, of = np.unique(code, return_index=True, return_inverse=True)
    if len(first) == len(code):
        return np.arange(len(code)), None
    return first, of.reshape(-1)


CHUNK = 65536  # candidates x pipeline ranks assembled at once: arrays of about 512 kB, which stay in cache


def _chunks(sorted_keys: np.ndarray, rows: int) -> list[slice]:
    """Consecutive slices of about `rows` rows of `sorted_keys` (sorted), each cut at a change of key (a key
    longer than that gets a slice of its own)."""
    out, start, n = [], 0, len(sorted_keys)
    while start < n:
        end = min(start + rows, n)
        if end < n:
            cut = int(np.searchsorted(sorted_keys, sorted_keys[end], side="left"))
            end = cut if cut > start else int(np.searchsorted(sorted_keys, sorted_keys[end], side="right"))
        out.append(slice(start, end))
        start = end
    return out


def _shape_tables(graph: LayerGraph, config: ParallelConfig, table: np.ndarray, cum: np.ndarray, keys: np.ndarray,
                  cost: Any, *, chunks: bool = False, roots: bool = True) -> dict[str, np.ndarray]:
    """For one pipeline shape (the config's pp, virtual stages and schedule: the schedule decides the placement,
    plan.layout.stage_ranks) and the layer-table keys `keys`: the per-rank sums of the SUMMED fields [keys, p, F]
    (from `cum`, their cumulative sums over the layers), the per-rank maxima of params and work [keys, p],
    layers per rank, p2p hops, what a pipeline cut sends and FSDP2's root groups (search/rootunit.rank_roots: its
    per-key tables only with `roots`, rootunit.uses_roots);
    with `chunks` (Engine.grad_sync_per_chunk, param_gather_per_chunk) each rank's chunks' backward, forward,
    dense and expert parameters and fresh-gradient saving [keys, v, p] and layers [v, p] (cost.chunksync)."""
    pp, v = config.pp, config.virtual_stages
    names = {layer.name: i for i, layer in enumerate(graph.layers)}
    stages = cost.balanced_stages(graph, config)
    bounds = np.array([names[s[0]] for s in stages] + [len(names)])  # stages are contiguous, in order
    ranks = stage_ranks(config)
    held = rank_stages(ranks, pp)
    placement = np.zeros((pp * v, pp))
    placement[np.arange(pp * v), ranks] = 1.0  # [stage, rank]
    sub = cum[keys[:, None], bounds[None, :]]  # [keys, S + 1, F]: the cumulative sums at the cuts
    per_stage = sub[:, 1:] - sub[:, :-1]  # [keys, S, F]
    block = next((i for i, layer in enumerate(graph.layers) if layer.role is LayerRole.BLOCK), 0)
    sides = _cut_sides(ranks, pp)
    out = {"per_rank": _per_rank(per_stage, placement, held), "layers_per_rank": np.diff(bounds) @ placement,
           "hops": sides["act_sends"] + sides["act_recvs"], "out_bytes": table[keys, block, FIELDS.index("out_bytes")],
           "last_rank": ranks[-1], **sides}
    out["max_params"], out["work"] = _rank_maxima(graph, table, keys, bounds, held)
    cols = {"dense": FIELDS.index("dense_params"), "fwd": FIELDS.index("fwd"), "time": FIELDS.index("time")}
    out.update(rank_roots(graph, table, keys, bounds, ranks, pp, cols, tables=roots))
    if not chunks:
        return out
    # each rank's chunks [v, p] (rank r's c-th stage) for cost.chunksync: their backward and gradients
    chunk_of = np.array(held).T
    time, fwd, dense, expert, fresh = (per_stage[:, :, SUMMED.index(n)][:, chunk_of]  # [keys, v, p]
                                       for n in ("time", "fwd", "dense_params", "expert_params", "fresh"))
    out.update(chunk_bwd=time - fwd, chunk_fwd=fwd, chunk_dense=dense, chunk_expert=expert, chunk_fresh=fresh,
               chunk_layers=np.diff(bounds)[chunk_of].astype(float))
    return out


def rank_stages(ranks: tuple[int, ...], pp: int) -> tuple[tuple[int, ...], ...]:
    """The stages each pipeline rank holds, in stage order (stage s runs on rank ranks[s]: plan.layout.stage_ranks)."""
    return tuple(tuple(s for s, r in enumerate(ranks) if r == k) for k in range(pp))


def _rank_maxima(graph: LayerGraph, table: np.ndarray, keys: np.ndarray, bounds: np.ndarray,
                 held: tuple[tuple[int, ...], ...]) -> tuple[np.ndarray, np.ndarray]:
    """The per-rank maxima of params and work over the rank's layers [keys, p] (rank r holds stages held[r]:
    rank_stages). Every layer of a kind has
    its kind's values (layer_table), so the maximum over a rank's layers is the maximum over the kinds it
    holds: a few columns of the table, not all of its layers (max is exact, so the figures are the same);
    a shape with an empty stage takes numpy's reduceat over the layers, as before."""
    fields = [FIELDS.index("params"), FIELDS.index("work")]
    if (np.diff(bounds) == 0).any():
        stage_max = [np.maximum.reduceat(table[keys, :, f], bounds[:-1], axis=1) for f in fields]
        return tuple(np.stack([m[:, list(stages)].max(axis=1) for stages in held], axis=1) for m in stage_max)
    names: dict[str, int] = {}
    kind_of = np.array([names.setdefault(layer.kind, len(names)) for layer in graph.layers])
    _, rep = np.unique(kind_of, return_index=True)  # a layer of each kind
    kinds = np.zeros((len(held), len(rep)), dtype=bool)  # [rank, kind]: whether the rank holds a layer of the kind
    for r, stages in enumerate(held):
        for s in stages:
            kinds[r, kind_of[bounds[s]:bounds[s + 1]]] = True
    sets, set_of = np.unique(kinds, axis=0, return_inverse=True)  # the few distinct sets of kinds a rank holds
    values = table[keys[:, None], rep[None, :]]  # [keys, kinds, F]
    return tuple(np.stack([values[:, held_kinds, f].max(axis=1) for held_kinds in sets], axis=1)[:, set_of.reshape(-1)]
                 for f in fields)


def _pipeline_shapes(pp: np.ndarray, v: np.ndarray, v_shape: np.ndarray) -> list[np.ndarray]:
    """The candidate rows of each (pp, virtual stages, V-shape), rows ascending, in the order of the sorted
    triples (one sort for all, instead of a scan of every row per triple)."""
    code = int_codes(pp, v, v_shape)
    if not len(code):
        return []
    order = np.argsort(code, kind="stable")
    starts = np.flatnonzero(np.diff(code[order], prepend=-1))
    return np.split(order, starts[1:])


def _per_rank(per_stage: np.ndarray, placement: np.ndarray, held: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """Each rank's sum of its stages' fields [keys, p, F]: einsum("ksf,sr->krf", per_stage, placement), which
    adds each rank's stages to zero in stage order; so does this, one stage per rank at a time, when every
    rank holds as many stages (held[r]: rank r's, rank_stages; test_search_surrogate checks it against
    einsum), in O(stages) not O(stages x ranks)."""
    pp = placement.shape[1]
    if len({len(h) for h in held}) != 1:
        return np.einsum("ksf,sr->krf", per_stage, placement)
    out = np.zeros((per_stage.shape[0], pp, per_stage.shape[2]))
    for j in range(len(held[0])):
        out += per_stage[:, [h[j] for h in held], :]
    return out


def _cut_sides(placement: tuple[int, ...], pp: int) -> dict[str, np.ndarray]:
    """Per rank, the cuts between stages on different ranks where it sends the activation (and receives its
    gradient) and where it receives it (p2p.add_hop's a and b sides); their sum is the rank's point-to-point
    transfers per microbatch ("hops": each cut counted on both sides, as estimate_config)."""
    sends, recvs = np.zeros(pp), np.zeros(pp)
    for a, b in itertools.pairwise(placement):
        if a != b:
            sends[a] += 1.0
            recvs[b] += 1.0
    return {"act_sends": sends, "act_recvs": recvs}


def inflight(schedule: np.ndarray, p: int, v: int, m: np.ndarray) -> np.ndarray:
    """Microbatches of activations held by each rank [n, p]: cost.pipeline.in_flight_microbatches in
    numpy (search.assemble.inflight)."""
    return _inflight(schedule, p, v, m)
