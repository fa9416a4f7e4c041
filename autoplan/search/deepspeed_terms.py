"""The quick estimate's DeepSpeed stage 3 inputs per candidate, read off one block of the graph: the
once-per-step host work and re-gathered elements (_deepspeed_step_terms, cost.deepspeedrank.deepspeed_step_s
per candidate) and the largest single weight matrix a device gathers (max_param_numel, for stage 3's
working set). search/surrogate.py passes them to search/assemble.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from autoplan.cluster.types import ClusterSpec
from autoplan.graph.types import LayerGraph, LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig


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
    from autoplan.cost import deepspeed as ds
    from autoplan.cost.deepspeedrank import layer_numels, layer_small_numels
    from autoplan.cost.zero3_grads import fetch_wait_share

    block = next((layer for layer in graph.layers if layer.role is LayerRole.BLOCK), None)
    out = {k: np.zeros(len(idx)) for k in ("ds_fixed_ops", "ds_layer_ops", "ds_layer_elements", "ds_fetch_wait_share")}
    if block is None:
        return out
    tp, n = c["tp"][idx], (c["dp"] * c["ep"] * c["cp"])[idx]
    for t, size in set(zip(tp.tolist(), n.tolist())):
        config, rows = ParallelConfig(tp=t), (tp == t) & (n == size)
        layer_cost = cost.estimate_layer(block, cluster, config, "none", seq_len=graph.seq_len)
        small = layer_small_numels(block, layer_cost, graph, config)
        if engine.zero3_small_grad_hooks:
            out["ds_fetch_wait_share"][rows] = fetch_wait_share(layer_numels(block, layer_cost, graph, config), small,
                                                                engine.zero3_reduce_bucket_numel)
        if engine.zero3_serial_grad_checks and size > 1:
            tensors = sum(1 for k in (*layer_numels(block, layer_cost, graph, config), *small) if k > 0)
            out["ds_layer_ops"][rows] += ds.GRAD_CHECK_OPS_PER_PARAM * tensors
            out["ds_fixed_ops"][rows] += ds.GRAD_CHECK_READS
        if engine.zero3_regather_persistent and size > 1:
            ops, elements = ds.persistent_regather([x for x in small if x < engine.zero3_persistence_numel], size)
            fixed = ds.regather_list_ops(size) if ops else 0.0
            out["ds_layer_ops"][rows] += ops - fixed
            out["ds_fixed_ops"][rows] += fixed
            out["ds_layer_elements"][rows] += elements
    return out


def max_param_numel(graph: Any, tp: np.ndarray) -> np.ndarray:
    """The largest single weight matrix a device holds (cost.deepspeedrank.layer_numels' rule: a block's
    QKV, projection or MLP matmul after tp; any other layer is one parameter, vocab-parallel over tp)."""
    from autoplan.cost.compute import block_shape

    out = np.zeros(len(tp))
    for t in np.unique(tp).tolist():
        best = 0.0
        for layer in graph.layers:
            shape = block_shape(layer, float(graph.microbatch * graph.seq_len))
            if shape is not None and layer.role is LayerRole.BLOCK:
                best = max(best, shape.h * max(shape.qkv_out_width, shape.h, shape.f) / t)
            else:
                best = max(best, layer.num_params / (t if layer.role in (LayerRole.EMBEDDING, LayerRole.HEAD) else 1))
        out[tp == t] = best
    return out
