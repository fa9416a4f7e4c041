"""The quick estimate's step assembly over [candidates, pipeline ranks] arrays, built from the exact cost
model's own functions: the ZeRO layout (plan.layout.zero_layout), bytes per parameter and on the wire
(cost.memory.state_bytes_per_param, cost.gradpasses.grad_wire_bytes), the collectives (cost.comm, called
on the actual message sizes), SM contention, FSDP2's copy-out, Adam's traffic, NCCL's buffers, ZeRO-3's
working set and the in-flight microbatches. Memory is the exact model's sum term by term; time replaces
the two-stream simulation of identical layers by its closed form (overlap.overlapped_s with L equal layers
of compute c, a prefetched collective g and a trailing one q: g + c + (L - 1) max(c, g + q) + q), the L
units being a rank's blocks where FSDP2's root group holds its other layers (cost.fsdpunits.root_terms,
whose collectives come whole: search/rootunit.py). The collectives are priced per candidate by
search/collectives.py, DeepSpeed's stage 3 by search/deepspeed_terms.py.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

from autoplan.cluster.types import ClusterSpec
from autoplan.cost import comm
from autoplan.cost.estimate import fresh_grad_share, optimizer_bytes
from autoplan.cost.experts import expert_dp_placement
from autoplan.cost.gradpasses import (
    ddp_grad_pass_bytes,
    dp_wire_bytes,
    grad_buffer_pass_bytes,
    grad_wire_bytes,
)
from autoplan.cost.kernels import memory_time_s
from autoplan.cost.layer import dtype_bytes
from autoplan.cost.memory import nccl_buffer_bytes, state_bytes_per_param
from autoplan.cost.overlap import contention_fraction
from autoplan.cost.reserve import runtime_buffer_bytes
from autoplan.plan.engine import Engine
from autoplan.plan.layout import zero_layout
from autoplan.plan.types import ParallelConfig
from autoplan.search.chunks import chunk_terms
from autoplan.search.collectives import (
    DENSE_DP,
    EXPERT_DP,
    _bucket_count,
    _bucketed_reduce,
    by_layout,
    collective_s,
    dense_dp_degree,
    expert_dp_degree,
    mesh_sizes,
    reduce_s,
    scatters,
)
from autoplan.search.deepspeed_terms import _deepspeed, _deepspeed_step
from autoplan.search.exposed import exposed
from autoplan.search.pipeline_terms import cut_p2p, nic_shared, pipeline_hops, tied_reduce, tied_tail
from autoplan.search.pricing import Mesh, Pricing, int_codes, per_mesh
from autoplan.search.rootunit import quick_root, root_seconds
from autoplan.search.schedules import Shared, shared_pipeline

_LAYOUT_FIELDS = ("shards_weights", "shards_gradients", "shards_optimizer", "reduce_every_microbatch",
                  "weight_gathers_per_microbatch", "weight_gathers_per_step")


def layouts(c: dict[str, np.ndarray], engine: Engine, dtype: str) -> dict[str, np.ndarray]:
    """zero_layout's fields per candidate (computed once per distinct (zero, pp, dp, ep, cp)) for a `dtype` plan
    (Engine.zero1_all_reduces), plus whether gradients are reduce-scattered."""
    keys = np.stack([c["zero"], c["pp"], c["dp"], c["ep"], c["cp"]], axis=1)
    _, first, inverse = np.unique(int_codes(*keys.T), return_index=True, return_inverse=True)
    rows = [_layout_row(z, pp, dp, ep, cp, engine.zero3, engine.pipelined_fsdp_defers_sync, engine.zero1_all_reduces(dtype))
            for z, pp, dp, ep, cp in keys[first].tolist()]
    table = np.array(rows)[inverse.reshape(-1)]
    out = {f: table[:, i] for i, f in enumerate(_LAYOUT_FIELDS)}
    out["reduce_scatter"] = table[:, len(_LAYOUT_FIELDS)]
    return out


@lru_cache(maxsize=65536)
def _layout_row(zero: int, pp: int, dp: int, ep: int, cp: int, zero3: str, defers: bool,
                all_reduce: bool = False) -> tuple[float, ...]:
    """zero_layout's fields (and whether gradients are reduce-scattered) as floats, once per distinct input."""
    lay = zero_layout(ParallelConfig(zero=zero, pp=pp, dp=dp, ep=ep, cp=cp), 1, zero3=zero3,
                      pipelined_fsdp_defers_sync=defers, zero1_all_reduce=all_reduce)
    return tuple(float(getattr(lay, f)) for f in _LAYOUT_FIELDS) + (float(lay.grad_reduction == "reduce_scatter"),)


def fresh_share(lay: dict[str, np.ndarray], m: np.ndarray | None, engine: Engine, dtype: str) -> np.ndarray | None:
    """cost.estimate.fresh_grad_share per candidate [n, 1], where the engine frees or replaces the weight
    gradients (Engine.grad_freed_after_reduce, hp_grads: the fresh-gradient saving comes off the backward);
    None where it does not. `m`: each row's microbatches per step."""
    if not (engine.grad_freed_after_reduce or engine.hp_grads(dtype)):
        return None
    assert m is not None, "assemble_shared needs m (microbatches per row) under grad_freed_after_reduce"
    return fresh_grad_share(lay["reduce_every_microbatch"][:, None] > 0, m[:, None], engine, dtype)


def microbatches(c: dict[str, np.ndarray], global_batch: int) -> np.ndarray:
    """Microbatches per step of each candidate (ParallelConfig.num_microbatches), as floats."""
    return (global_batch // (c["dp"] * c["ep"] * c["microbatch"])).astype(float)


def assemble_shared(f: dict[str, np.ndarray], layers_per_rank: np.ndarray, extra: dict[str, np.ndarray],
                    c: dict[str, np.ndarray], pp: int, v: int, cluster: ClusterSpec, engine: Engine,
                    pricing: Pricing | None = None, *, m: np.ndarray | None = None) -> Shared:
    """The step's terms that do not depend on the schedule (search/schedules.py by_schedule adds those), per
    row of `c` (whose schedule column is not read: rows equal but for it give the same terms). `f` holds the
    per-rank sums [n, p] of the per-layer fields (time, fwd, bwd_weight, act, params, dense_params,
    expert_params); `extra` the per-rank maxima (max_params, work, max_numel), hops, out_bytes, seq_len,
    hidden; `pricing` what the collectives of one quick estimate share (search/pricing.py); `m` each row's
    microbatches per step (needed with Engine.grad_freed_after_reduce)."""
    lay = layouts(c, engine, cluster.dtype)
    share = fresh_share(lay, m, engine, cluster.dtype)  # the rank's and its chunks' (search/chunks.py) backward
    if share is not None and "fresh" in f:  # as estimate.with_fresh_grads
        cut = f["fresh"] * share
        f = {**f, "time": f["time"] - cut, "bwd_weight": f["bwd_weight"] - cut}
    sizes = mesh_sizes(c, pricing)
    w, g, o = state_bytes_per_param(cluster.dtype, engine)
    wire, dp_wire = grad_wire_bytes(cluster.dtype, engine), dp_wire_bytes(cluster.dtype, engine)
    layers = np.maximum(layers_per_rank, 1)[None, :].astype(float)
    fwd, bwd = f["fwd"], f["time"] - f["fwd"]
    dense, expert = f["dense_params"], f["expert_params"]
    p2p = cut_p2p(extra, c, sizes, cluster, engine, pp)  # a cut's transfers, for the hops and the NIC
    hops, steady = pipeline_hops(extra, c, cluster, sizes, engine, p2p, v)
    # FSDP2's root group (search/rootunit.py): the rank's own collectives over its blocks, the root's whole
    root = quick_root(extra, dense, layers, v, engine)
    units_l, own = (layers, dense) if root is None else (root.units, root.dense)
    fwd_u, bwd_u = (fwd, bwd) if root is None else (fwd - root.fwd, bwd - root.bwd)  # the units' compute
    col = _dp_collectives(root, units_l, own, expert, sizes, lay, cluster, engine, w, dp_wire)
    copy_out, copy_out_b, copy_in, ddp = _grad_passes(root, dense, expert, lay, c, cluster, engine, w, wire)
    z3_fwd, dp_b, units = _dp_backward(fwd_u, bwd_u, units_l, own + expert, col, root, lay, engine, copy_out,
                                       copy_out_b, copy_in)
    dp_b, async_tail, floor = _async_reduce(f, extra, p2p, fwd, bwd, dp_b, copy_in, col, lay, sizes, cluster, engine)
    deepspeed = (c["zero"] == 3) & (engine.zero3 == "deepspeed")
    dp_f, dp_b = _deepspeed(z3_fwd, dp_b, deepspeed, f, layers, sizes, c, cluster, engine, w, wire, col.dense_frac,
                            extra)
    x = f["time"] + hops + dp_f + dp_b
    peak, bubble, bubble_zb = shared_pipeline(x, f["bwd_weight"], steady, v)
    tied = tied_reduce(extra, c, cluster, sizes, wire, pp)
    chunked, step_gather = chunk_terms(extra, col.rs_or_ar, layers, sizes, lay, dp_wire, w, cluster, engine, share,
                                       col.frac, pp, v)
    once = [_step_tail(fwd, bwd + dp_b, col.reduce, col.gather, copy_out, units_l, units, lay, engine, col.frac,
                       sizes, dense, expert, dp_wire, w, cluster, copy_in + ddp, async_tail, tied,
                       int(extra.get("last_rank", pp - 1)),
                       None if root is None else (col.first, fwd_u, bwd_u + dp_b, col.root_fwd), chunked,
                       step_gather),
            _optimizer(f, c, lay, cluster, engine)]
    if "ds_layer_ops" in extra:  # cost.deepspeedrank.deepspeed_step_s, once per step
        once.append(np.where(deepspeed, _deepspeed_step(extra, layers, sizes, DENSE_DP, w, cluster, engine), 0.0))
    states, reserve = _memory(f, extra, c, lay, cluster, engine, w, g, o, wire, deepspeed, sizes)
    return Shared(peak=peak, bubble=bubble, bubble_zb=bubble_zb, once=tuple(once), states=states, reserve=reserve,
                  floor=floor)


class _Collectives(NamedTuple):
    """A rank's data-parallel collectives per [candidate, rank] (_dp_collectives)."""

    gather: np.ndarray  # its units' weight all-gathers, dense + expert
    rs_or_ar: np.ndarray  # their gradient reduce-scatters or all-reduces, by the layout
    first: Any  # None, or the FSDP2 root group's (forward gather, backward gather, reduction): RootSeconds
    frac: np.ndarray  # dp_fractions' mixed contention fraction
    dense_frac: np.ndarray  # ... and the dense group's own
    reduce: np.ndarray  # the bucketed reductions (_bucketed_reduce)
    reduce_all: np.ndarray  # ... with the root's after the rank's last backward
    root_fwd: Any  # the root's forward gather less what the layers before the first block hide (0.0: no root)


def _dp_collectives(root, units_l, own, expert, sizes, lay, cluster, engine, w, dp_wire) -> _Collectives:
    """A rank's layers' collectives: per class of the mesh when its candidates share their parameters (a class
    of quick_estimate's is a layer-table key), spread to the candidates, else per candidate; the root group's
    whole (rootunit.root_seconds) and the contention fractions they run under."""
    by_class = (own[sizes.reps], expert[sizes.reps]) if sizes.uniform(own, expert) else None

    def per_layer(kind: str, elem_bytes: float) -> tuple[np.ndarray, np.ndarray]:
        if by_class is None:
            return tuple(collective_s(kind, sizes, axes, params / units_l * elem_bytes, cluster) * units_l
                         for axes, params in ((DENSE_DP, own), (EXPERT_DP, expert)))
        return tuple((collective_s(kind, sizes, axes, params / units_l * elem_bytes, cluster, per_class=True)
                      * units_l)[sizes.inverse] for axes, params in zip((DENSE_DP, EXPERT_DP), by_class))

    gather_d, gather_e = per_layer("ag", w)
    red_d, red_e = (by_layout(lay, rs, ar) for rs, ar in zip(per_layer("rs", dp_wire), per_layer("ar", dp_wire)))
    gather, rs_or_ar = gather_d + gather_e, red_d + red_e
    first = None if root is None else root_seconds(  # the root's forward gather, backward gather, reduction
        root, lambda n: collective_s("ag", sizes, DENSE_DP, n * w, cluster),
        lambda n: reduce_s(sizes, DENSE_DP, n * dp_wire, cluster, lay))
    dense_s = gather_d + red_d
    dense_s = dense_s if first is None else dense_s + first.fwd + first.reduce
    frac, dense_frac = dp_fractions(sizes, cluster, dense_s, gather_e + red_e)
    reduce = _bucketed_reduce(rs_or_ar, own + expert, units_l, sizes, lay, dp_wire, cluster, engine)
    reduce_all = reduce if first is None else reduce + first.reduce  # the root's after the rank's last backward
    # the root's forward gather, less what of the first block's the root group's layers before it (the
    # embedding) hide
    root_fwd = 0.0 if root is None else first.fwd - root.first_hidden(gather, root.lead_fwd, frac,
                                                                       engine.param_gather_overlap)
    return _Collectives(gather, rs_or_ar, first, frac, dense_frac, reduce, reduce_all, root_fwd)


def _grad_passes(root, dense, expert, lay, c, cluster, engine, w, wire) -> tuple[Any, Any, Any, Any]:
    """The memory passes around the collectives: FSDP2's copy-out of the gathered weights (forward, and the
    backward's, the root group's own where it keeps them), its copy-in of the gradients, the DDP's passes."""
    copy_out = memory_time_s(cluster.device, 2.0 * w * (dense + expert)) if engine.gather_copy_out else 0.0 * dense
    copy_out_b = (copy_out if root is None or not engine.gather_copy_out
                  else memory_time_s(cluster.device, 2.0 * w * root.bwd_gathered(expert)))
    # gradpasses.reduce_copy_in_s: FSDP2's copy of the gradients into the reduce-scatter input
    copy_in = np.where(scatters(lay) if engine.reduce_scatter_copy_in else False,
                       memory_time_s(cluster.device, (dtype_bytes(cluster.dtype) + wire) * (dense + expert)), 0.0)
    # gradpasses.ddp_grad_passes_s: the DDP's flatten / divide / copy-back passes around a per-step all-reduce
    ddp = np.where(~scatters(lay),  # at any group size, as the exact model
                   memory_time_s(cluster.device, ddp_grad_pass_bytes(cluster.dtype, engine, dense + expert)
                                 * (dense + expert)), 0.0)
    if engine.grad_buffer_passes:  # gradpasses.grad_buffer_passes_s: the zero fill and the 1 / dp scale
        per = grad_buffer_pass_bytes(cluster.dtype, engine, (c["dp"] * c["ep"])[:, None])
        ddp = ddp + np.where(lay["reduce_every_microbatch"][:, None] == 0,
                             memory_time_s(cluster.device, per * (dense + expert)), 0.0)
    return copy_out, copy_out_b, copy_in, ddp


def _dp_backward(fwd_u, bwd_u, units_l, params, col, root, lay, engine, copy_out, copy_out_b, copy_in):
    """(ZeRO-3's exposed forward gathers, the exposed per-microbatch backward gathers and reductions, the
    reductions' unit count): the closed form over the rank's units (`params` their dense + expert parameters)."""
    gmb = lay["weight_gathers_per_microbatch"][:, None]
    every = lay["reduce_every_microbatch"][:, None] > 0
    z3_fwd = np.where(gmb >= 2, exposed(fwd_u, col.gather, None, units_l, engine.param_gather_overlap, True, col.frac)
                      + copy_out + col.root_fwd, 0.0)
    pre_b = np.where(gmb >= 1, col.gather, 0.0)
    post_b = np.where(every, col.reduce, 0.0)
    # reductions alone run one collective per filled bucket (at most one per layer, dataparallel._bucketed),
    # each hidden by the backward after it: the closed form over that many equal units; with per-layer
    # gathers beside them, over the layers
    units = np.minimum(_bucket_count(params, units_l, engine.dp_bucket_numel), units_l)
    dp_b = exposed(bwd_u, pre_b, post_b, np.where(gmb >= 1, units_l, units), engine.param_gather_overlap,
                   engine.dp_comm_overlap, col.frac)
    if root is not None:  # the kept block's gather (the one the closed form exposes) or the head's backward
        # hiding it, the root's collectives
        tail = root.first_hidden(pre_b, root.tail_bwd, col.frac, engine.param_gather_overlap)
        dp_b = (dp_b - root.kept * pre_b / units_l - (1.0 - root.kept) * tail + np.where(gmb >= 1, col.first.bwd, 0.0)
                + np.where(every, col.first.reduce, 0.0))
    dp_b = np.where((gmb >= 1) | every,
                    dp_b + np.where(gmb >= 1, copy_out_b, 0.0) + np.where(every, copy_in, 0.0), 0.0)
    return z3_fwd, dp_b, units


def _async_reduce(f, extra, p2p, fwd, bwd, dp_b, copy_in, col, lay, sizes, cluster, engine):
    """cost.dataparallel.async_reduce_s: ZeRO-2's reductions beside this and the next microbatches' compute:
    (the per-microbatch backward's dp seconds, the last microbatch's wait, the reduce stream floor's per-rank
    terms or None where no candidate reduces asynchronously)."""
    gmb = lay["weight_gathers_per_microbatch"][:, None]
    every = lay["reduce_every_microbatch"][:, None] > 0
    asyn = every & (gmb == 0) & engine.grad_reduce_async & engine.dp_comm_overlap
    per_mb = np.maximum(col.reduce_all - f["time"], 0.0) + col.frac * np.minimum(col.reduce_all, f["time"])
    shared, stream = (nic_shared(col.reduce_all, f, extra, p2p, cluster, sizes) if np.any(asyn)
                      else (0.0, 0.0))  # cost.pipeline.nic_shared_reduce_s
    async_tail = np.where(asyn, np.maximum(dp_b - copy_in - per_mb, 0.0), 0.0)  # the last one waits
    dp_b = np.where(asyn, per_mb + shared + copy_in, dp_b)
    # cost.pipeline.reduce_stream_floor_s's per-rank terms (layers' forward, backward, its weight part, the
    # asynchronous reductions), where any candidate reduces asynchronously
    floor = ((fwd, bwd, f["bwd_weight"], np.where(asyn, col.reduce_all + stream, 0.0)) if np.any(asyn) else None)
    return dp_b, async_tail, floor


def dp_fractions(sizes: Mesh, cluster: ClusterSpec, dense_s: np.ndarray, expert_s: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """cost.dataparallel.dp_fraction per [candidate, rank] (overlap.mixed_fraction's weighted mean of the
    dense and expert groups' contention_fraction, by their per-layer collective seconds `dense_s`,
    `expert_s`), and the dense group's own (DeepSpeed's stage 3 prices it alone)."""
    per_node = cluster.devices_per_node
    fd = per_mesh(sizes, lambda config: contention_fraction(
        cluster, comm.group_placement(config, DENSE_DP, per_node)), "dp-contention")[:, None]
    fe = per_mesh(sizes, lambda config: contention_fraction(cluster, expert_dp_placement(config, per_node)),
                  "edp-contention")[:, None]
    total = dense_s + expert_s
    mixed = (fd * dense_s + fe * expert_s) / np.where(total > 0, total, 1.0)
    return np.where(expert_s > 0, mixed, fd + 0.0 * total), fd


def _step_tail(fwd, bwd_all, reduce, gather, copy_out, layers, units, lay, engine, frac, sizes, dense, expert, wire,
               w, cluster, copy_in, async_tail, tied, last_rank, root=None, chunked=None,
               gathered=None) -> np.ndarray:
    """The once-per-step gradient reduction (overlapped with the last backward, rank r finishing
    sum_{k<r} B_k before rank 0), with its copy-in (FSDP2) or the DDP's own gradient passes (`copy_in`
    holds both), or the last microbatch's asynchronous reductions (`async_tail`,
    cost.dataparallel.async_reduce_s), the tied head's all-reduce between rank 0 and `last_rank` (tied_tail),
    and weight all-gather (ZeRO-1/2; overlapped with the next forward); `root` None, or the FSDP2 root
    group's (forward gather, backward gather, reduction) seconds (rootunit.RootSeconds: each before or after
    every layer of the rank, so exposed whole), the units' forward and backward compute the closed forms
    see, and the root's forward gather less what of the first block's the layers before it hide; `chunked`: (ranks, tail) of
    search.chunks.chunk_sync_tail where the engine launches the reduction per chunk; `gathered`: (rows, exposed
    all-gather) of search.chunks.chunk_gather_s where the engine gathers chunk by chunk."""
    once = lay["reduce_every_microbatch"][:, None] == 0
    first, fwd_u, bwd_u, root_fwd = (None, fwd, bwd_all, 0.0) if root is None else root
    if engine.dp_comm_overlap:
        tail = exposed(bwd_u, None, reduce, units, True, True, frac)  # per filled bucket, as dp_b
        tail = tail if first is None else tail + first.reduce
        tail = tail if chunked is None else np.where(chunked[0], chunked[1], tail)
    else:
        # one collective of all the rank's dense gradients and one of its experts', each reduce-scattered or
        # all-reduced by the layout (cost.dataparallel.rank_dp_times' whole(); the executor's FSDP2 wraps the
        # experts over the expert mesh with the dense blocks' wrapper: execute/fsdp.py apply_data_parallel)
        tail = (reduce_s(sizes, DENSE_DP, dense * wire, cluster, lay)
                + reduce_s(sizes, EXPERT_DP, expert * wire, cluster, lay))
    tail = tail + copy_in
    offsets = np.cumsum(bwd_all, axis=1) - bwd_all
    active = (once[:, 0] | (async_tail > 0).any(axis=1))[:, None]
    per_rank = np.where(active, np.where(once, tail, async_tail), 0.0)
    dp_tail = tied_tail(per_rank, offsets, tied, last_rank, engine.tied_reduce_before_dp)
    step_gather = lay["weight_gathers_per_step"][:, None] > 0
    if not engine.param_gather_overlap:
        pg = collective_s("ag", sizes, DENSE_DP, dense * w, cluster) + copy_out
        return dp_tail + np.where(step_gather, pg, 0.0).max(axis=1)
    # the overlapped gather on the candidates that gather once per step only (each row's figures are its own)
    rows, slowest = np.nonzero(step_gather[:, 0])[0], np.zeros(len(dp_tail))
    if len(rows):
        def pick(a: Any) -> Any:
            return a[rows] if np.ndim(a) == 2 and len(a) == len(dp_tail) else a
        shown = exposed(pick(fwd_u), pick(gather), None, layers, True, True, pick(frac))
        shown = shown if gathered is None else np.where(pick(gathered[0]), pick(gathered[1]), shown)
        slowest[rows] = (shown + pick(copy_out) + pick(root_fwd)).max(axis=1)
    return dp_tail + slowest


def _optimizer(f, c, lay, cluster, engine) -> np.ndarray:
    """estimate._optimizer_s: Adam over the local shard (estimate.optimizer_bytes) at streaming bandwidth."""
    dense_n = np.where(lay["shards_optimizer"] > 0, dense_dp_degree(c), 1)[:, None]
    expert_n = np.where(lay["shards_optimizer"] > 0, expert_dp_degree(c), 1)[:, None]
    shard = f["dense_params"] / dense_n + f["expert_params"] / expert_n
    local = f["dense_params"] + f["expert_params"]
    return memory_time_s(cluster.device, optimizer_bytes(cluster.dtype, engine, shard, local).max(axis=1))


def _memory(f, extra, c, lay, cluster, engine, w, g, o, wire, deepspeed, sizes):
    """cost.memory.rank_memory term by term but the activations (schedules.by_schedule adds them: x in-flight
    microbatches + the working set): (model states under the layout + ZeRO-3's working set and ZeRO-2's
    reduce buffers (cost.memory.zero2_reduce_bytes) [n, p], cost.memory.reserve_bytes [n])."""
    dense_n = dense_dp_degree(c)[:, None]
    expert_n = expert_dp_degree(c)[:, None]
    shard = f["dense_params"] / dense_n + f["expert_params"] / expert_n
    full = f["dense_params"] + f["expert_params"]

    def held(flag: str) -> np.ndarray:
        return np.where(lay[flag][:, None] > 0, shard, full)

    states = w * held("shards_weights") + g * held("shards_gradients") + o * held("shards_optimizer")
    fsdp = extra["max_params"] * (3.0 * w + (wire if wire != w else 0.0))
    working = np.where(lay["shards_weights"][:, None] > 0, fsdp, 0.0)
    if deepspeed.any():  # DeepSpeed's stage 3 working set instead (where it is none, np.where keeps `working`)
        ds = (3.0 * extra["max_numel"][:, None] + 2.0 * engine.zero3_reduce_bucket_numel) * w + 0.0 * fsdp
        working = np.where(deepspeed[:, None], ds, working)
    zero2 = ((lay["shards_gradients"] > 0) & (lay["shards_weights"] == 0) & (lay["reduce_every_microbatch"] > 0))
    working = working + np.where(zero2[:, None], extra["max_params"] * (w + (wire if wire != w else 0.0)), 0.0)
    nccl = per_mesh(sizes, lambda config: nccl_buffer_bytes(config, cluster), "nccl-buffers")
    buffers = runtime_buffer_bytes(cluster.device, engine, cluster.dtype, tp=c["tp"], sp=c["sp"], cp=c["cp"],
                                   microbatch=c["microbatch"], seq_len=extra.get("seq_len", 0), hidden=extra.get("hidden", 0))
    return states + working, cluster.device.runtime_reserve_bytes + nccl + buffers

