"""DeepSpeed's stage 3 in the quick estimate: its inputs per candidate, read off one block of the graph
(search/surrogate.py: the once-per-step host work and re-gathered elements, _deepspeed_step_terms, that is
cost.deepspeedrank.deepspeed_step_s per candidate; the largest single weight matrix a device gathers,
max_param_numel, for stage 3's working set), and its times over [candidates, pipeline ranks] arrays
(search/assemble.py: the per-microbatch gathers and reductions of equal layers, _deepspeed, and the
once-per-step host work, _deepspeed_step: cost/deepspeed.py's timeline in closed form).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from autoplan.cluster.types import ClusterSpec
from autoplan.cost import deepspeed as ds
from autoplan.cost.deepspeedrank import (
    fetch_norm_bytes,
    gather_host_s,
    gather_pass_bytes,
    layer_numels,
    layer_small_numels,
    weight_count,
    weight_numels,
)
from autoplan.cost.kernels import memory_time_s
from autoplan.graph.types import LayerGraph, LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig, Recompute
from autoplan.search.collectives import DENSE_DP, collective_s, dense_dp_degree
from autoplan.search.exposed import uniform_exposed
from autoplan.search.space import RECOMPUTES


def _deepspeed_step_terms(graph: LayerGraph, cluster: ClusterSpec, c: dict[str, np.ndarray], idx: np.ndarray,
                          cost: Any, engine: Engine) -> dict[str, np.ndarray]:
    """cost.deepspeedrank.deepspeed_step_s per candidate, as host ops once per step (ds_fixed_ops) and per
    layer (ds_layer_ops) and the elements the persistent re-gather gathers per layer (ds_layer_elements),
    from one block (cost.deepspeedrank.layer_numels, layer_small_numels): with zero3_serial_grad_checks
    cost.deepspeed.serial_grad_checks over its parameter tensors, with zero3_regather_persistent
    cost.deepspeed.persistent_regather over its small parameters (its list gather's
    regather_list_ops once per step); with zero3_small_grad_hooks the share of the gradient elements whose
    bucket is flushed just before a fetch (ds_fetch_wait_share: cost.zero3_grads.fetch_wait_share). Each
    distinct (tp, data-parallel size) priced once."""
    from autoplan.cost.zero3_grads import fetch_wait_share

    block = next((layer for layer in graph.layers if layer.role is LayerRole.BLOCK), None)
    out = {k: np.zeros(len(idx)) for k in ("ds_fixed_ops", "ds_layer_ops", "ds_layer_elements", "ds_fetch_wait_share")}
    if block is None:
        return out
    tp, n = c["tp"][idx], dense_dp_degree(c)[idx]
    for t, size in set(zip(tp.tolist(), n.tolist())):
        config, rows = ParallelConfig(tp=t), (tp == t) & (n == size)
        layer_cost = cost.estimate_layer(block, cluster, config, "none", seq_len=graph.seq_len)
        numels, small = (layer_numels(block, layer_cost, graph, config),
                         layer_small_numels(block, layer_cost, graph, config))
        if engine.zero3_small_grad_hooks:
            out["ds_fetch_wait_share"][rows] = fetch_wait_share(numels, small, engine.zero3_reduce_bucket_numel)
        if engine.zero3_serial_grad_checks and size > 1:
            tensors = sum(1 for k in (*numels, *small) if k > 0)
            out["ds_layer_ops"][rows] += ds.GRAD_CHECK_OPS_PER_PARAM * tensors
            out["ds_fixed_ops"][rows] += ds.GRAD_CHECK_READS
        if engine.zero3_regather_persistent and size > 1:
            ops, elements = ds.persistent_regather([x for x in small if x < engine.zero3_persistence_numel], size)
            fixed = ds.regather_list_ops(size) if ops else 0.0
            out["ds_layer_ops"][rows] += ops - fixed
            out["ds_fixed_ops"][rows] += fixed
            out["ds_layer_elements"][rows] += elements
    return out


def max_param_numel(graph: LayerGraph, table: np.ndarray, key_of: np.ndarray, tp: np.ndarray,
                    cols: tuple[int, int]) -> np.ndarray:
    """Per candidate, the largest single parameter tensor a device gathers (the exact model's
    rank.max_param_numel over the graph's layers: cost.deepspeedrank.weight_numels of each kind of layer's
    dense + expert elements, layer-table columns `cols`, at the candidate's tp), from the layer table
    [keys, layers, fields] and each candidate's key `key_of`."""
    key_tp = np.ones(table.shape[0])
    key_tp[key_of] = tp
    best = np.zeros(table.shape[0])
    seen: set[str] = set()
    for i, layer in enumerate(graph.layers):
        if layer.kind not in seen:  # every layer of a kind has its kind's table values (layer_table)
            seen.add(layer.kind)
            params = table[:, i, cols[0]] + table[:, i, cols[1]]
            best = np.maximum.reduce([best, *np.broadcast_arrays(*weight_numels(layer, graph, key_tp, params))])
    return best[key_of]


def block_weights(graph: LayerGraph) -> float:
    """The parameter tensors DeepSpeed gathers per block (cost.deepspeedrank.weight_count of the first
    block: a GPT block's 4, a SwiGLU block's 5); 1 without blocks."""
    block = next((layer for layer in graph.layers if layer.role is LayerRole.BLOCK), None)
    return float(weight_count(block, graph)) if block is not None else 1.0


def _deepspeed_step(extra, layers, sizes, dense_axes, w, cluster, engine) -> np.ndarray:
    """DeepSpeed stage 3's once-per-step host work (deepspeed_terms._deepspeed_step_terms) on the most loaded
    rank: its host ops, the persistent re-gather's all-gather and, with zero3_serial_grad_checks, the two
    one-element all-reduces (cost.deepspeed.GRAD_CHECK_MESSAGES)."""
    ops = extra["ds_fixed_ops"][:, None] + extra["ds_layer_ops"][:, None] * layers
    gather = collective_s("ag", sizes, dense_axes, extra["ds_layer_elements"][:, None] * layers * w, cluster)
    out = (ops * cluster.device.op_overhead_s + gather).max(axis=1)
    if engine.zero3_serial_grad_checks:
        for nbytes in ds.GRAD_CHECK_MESSAGES:
            out = out + np.where(extra["ds_fixed_ops"] > 0, collective_s(
                "ar", sizes, dense_axes, np.full(len(out), nbytes), cluster), 0.0)
    return out


def _deepspeed(dp_f, dp_b, mask, f, layers, sizes, c, cluster, engine, w, wire, frac, extra):
    """DeepSpeed stage 3 (cost/deepspeed.py) for equal layers: each layer's parameters gathered in forward,
    again for a full recompute, again in backward, the buckets reduced as they fill; the host launches of
    the copy-out delay the compute. With prefetch (param_gather_overlap and zero3_trace_aligned) one sub-
    module ahead; without, each gather is waited for and each bucket's reduction hides behind the next
    backward sub-module's compute (_deepspeed_serial), but for the share extra["ds_fetch_wait_share"] that a
    small gradient's hook flushes just before a fetch (cost.zero3_grads.fetch_wait_share), reduced beside
    nothing. The sub-modules of a rank: its blocks' weight tensors (extra["ds_block_weights"], block_weights)
    and one per other layer (cost.deepspeedrank.weight_numels), priced as equal; each gather's zero fill and
    copy-out (cost.deepspeedrank.gather_pass_bytes) and each fetch's norm (fetch_norm_bytes) as the exact model's."""
    if not mask.any():
        return dp_f, dp_b
    dense = f["dense_params"] + f["expert_params"]
    flushed = np.asarray(extra.get("ds_fetch_wait_share", 0.0), dtype=float).reshape(-1, 1)
    blocks = np.asarray(extra["rank_blocks"], dtype=float)
    modules = blocks * extra["ds_block_weights"] + (layers - blocks)
    gathers = np.where(c["recompute"][:, None] == RECOMPUTES.index(Recompute.FULL), 3.0, 2.0)
    fill, copy = gather_pass_bytes(engine, dense / modules, w)  # the zero fill before, the copy-out after
    one = collective_s("ag", sizes, DENSE_DP, dense / modules * w, cluster) + memory_time_s(cluster.device,
                                                                                                      copy)
    n = dense_dp_degree(c).astype(float)[:, None]
    before, after, blocked = gather_host_s(engine, n, cluster.device.op_overhead_s)
    before = before + memory_time_s(cluster.device, fill)
    red_fn = "ar" if engine.zero3_grad_reduction == "all_reduce" else "rs"
    buckets = np.maximum(np.ceil(dense / engine.zero3_reduce_bucket_numel), 1.0)
    red = collective_s(red_fn, sizes, DENSE_DP, dense / buckets * wire, cluster) * buckets
    # a device sync before each sub-module: its host time adds to its kernels (deepspeed._step)
    full = (c["recompute"] == RECOMPUTES.index(Recompute.FULL))[:, None]
    host_f, host_r, host_b = ds.host_shares(f["host"] if ds.sync_adds_host(engine) else 0.0 * one, full)
    # the recomputed forward runs in the backward; each fetch's norm (fetch_norm_bytes) joins the compute
    norm = memory_time_s(cluster.device, fetch_norm_bytes(engine, dense, w))
    host_f, host_b = host_f + norm, host_r + host_b + norm * (1.0 + full)
    if not (engine.param_gather_overlap and engine.zero3_trace_aligned):
        exp_f, exp_b, hidden = _deepspeed_serial(f["time"] - f["fwd"] + host_b, one, before,
                                                 np.maximum(after, one + blocked), red, buckets, modules, gathers,
                                                 flushed)
        exp_f, exp_b = exp_f + host_f, exp_b + host_b
        return np.where(mask[:, None], exp_f, dp_f), np.where(mask[:, None], exp_b + frac * hidden, dp_b)
    comm_f, comm_b = one * modules, one * modules * (gathers - 1.0) + red
    exp_f = uniform_exposed(f["fwd"] + host_f, comm_f, None, modules) + (before + after) * modules + host_f
    exp_b = (uniform_exposed(f["time"] - f["fwd"] + host_b, comm_b, None, modules)
             + (before + after) * modules * (gathers - 1) + host_b)
    pen = frac * np.maximum(comm_f + comm_b - exp_f - exp_b + host_f + host_b, 0.0)
    return np.where(mask[:, None], exp_f, dp_f), np.where(mask[:, None], exp_b + pen, dp_b)


def _deepspeed_serial(bwd, one, before, after, red, buckets, modules, gathers, share=0.0):
    """(forward, backward exposed, hidden) seconds of stage 3 without prefetch, for equal sub-modules: every
    gather waited for (the views built before it, the copy-out launches while it runs), each bucket's
    reduction beside the next backward sub-module's compute (its share of `bwd`), but for `share` of them
    (flushed before a fetch: exposed), the last after it."""
    gather = before + np.maximum(one, after)  # after: the launches (those past the stream's queue follow the gather)
    per_red = red / buckets
    beside = bwd / (modules * (gathers - 1.0))
    hidden = (1.0 - share) * (buckets - 1.0) * np.minimum(per_red, beside)
    exposed_red = (buckets - 1.0) * ((1.0 - share) * np.maximum(per_red - beside, 0.0) + share * per_red) + per_red
    return gather * modules, gather * modules * (gathers - 1.0) + exposed_red, hidden
