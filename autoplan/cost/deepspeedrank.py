"""DeepSpeed's stage 3 on one pipeline rank (cost/deepspeed.py's timeline over the rank's layers): the
parameter tensors DeepSpeed gathers and reduces one by one (a block's weight matrices and its small
parameters), its per-microbatch forward and backward in place of the rank's, and its once-per-step host
work around the optimizer. The rank and its data-parallel groups are cost/dataparallel.py's.
"""

from __future__ import annotations

from typing import Any

from autoplan.cluster.types import ClusterSpec
from autoplan.cost import comm
from autoplan.cost import deepspeed as ds
from autoplan.cost.broadcast import nonnegative
from autoplan.cost.compute import BlockShape, block_shape
from autoplan.cost.dataparallel import DpGroups, Rank
from autoplan.cost.gradpasses import grad_wire_bytes, self_copy_passes
from autoplan.cost.kernels import memory_time_s
from autoplan.cost.memory import state_bytes_per_param
from autoplan.cost.overlap import contention_fraction, hidden_penalty_s
from autoplan.cost.types import LayerCost
from autoplan.graph.types import Layer, LayerGraph, LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig


def layer_numels(layer: Layer, cost: LayerCost, graph: LayerGraph, config: ParallelConfig) -> list[float]:
    """The weight matrices of a layer on this device (elements, after tp), in forward order (weight_numels
    of its dense and expert parameters)."""
    return weight_numels(layer, graph, config.tp, float(cost.grad_param_count + cost.expert_param_count))


def weight_numels(layer: Layer, graph: LayerGraph, tp: Any, params: Any) -> list[Any]:
    """The parameter tensors DeepSpeed gathers one by one for a layer holding `params` elements on a device
    (its LayerCost's grad_param_count + expert_param_count) at tensor-parallel degree `tp` (floats, or numpy
    arrays alike: the quick estimate's, search/deepspeed_terms.py): a block's QKV, projection and n_mlp MLP
    matmuls (the remaining parameters, norms and biases, ride with the projection; a block with routed
    experts lists them last); any other layer is one parameter. weight_count(...) of them."""
    shape = _block(layer, graph)
    if shape is None:
        return [params]
    t = tp
    qkv, proj = shape.h * shape.qkv_out_width / t, shape.h * shape.h / t
    mlp = [shape.h * shape.f / t] * (shape.n_mlp * shape.dense_mlps)
    rest = nonnegative(params - qkv - proj - sum(mlp))
    return [qkv, proj + rest, *mlp] if shape.num_experts == 0 else [qkv, proj, *mlp, rest]


def _block(layer: Layer, graph: LayerGraph) -> BlockShape | None:
    """The transformer-block shape weight_numels and layer_small_numels list a layer's tensors by (at the
    graph's captured tokens), or None for a layer that is not a block (one tensor, no small ones)."""
    shape = block_shape(layer, float(graph.microbatch * graph.seq_len))
    return None if shape is None or layer.role is not LayerRole.BLOCK else shape


def weight_count(layer: Layer, graph: LayerGraph) -> int:
    """How many tensors weight_numels lists for `layer`: DeepSpeed's sub-module gathers per use of it."""
    return len(weight_numels(layer, graph, 1, 0.0))


def layer_small_numels(layer: Layer, cost: LayerCost, graph: LayerGraph, config: ParallelConfig) -> list[float]:
    """A block's parameters besides its weight matrices (elements on this device), the ones DeepSpeed
    keeps persistent below stage3_param_persistence_threshold: a GPT block's two LayerNorms (weight and
    bias, h each), the QKV and first MLP biases (column-parallel: split over tp) and the projection and
    second MLP biases (row-parallel: h each), when those sum to the block's remaining parameters (Megatron
    GPT, Shoeybi et al. 2019); otherwise the remainder as norm-sized (h) parameters (a Llama block: two
    RMSNorm weights). Other layers: none."""
    shape = _block(layer, graph)
    if shape is None:
        return []
    t, h = config.tp, float(shape.h)
    weights = h * (shape.qkv_out_width + shape.h) / t + h * shape.f / t * shape.n_mlp * shape.dense_mlps
    rest = max(cost.grad_param_count + cost.expert_param_count - weights, 0.0)
    gpt = [h, h, shape.qkv_out_width / t, h, h, h, shape.f / t, h]
    if shape.num_experts == 0 and abs(sum(gpt) - rest) <= 0.01 * rest:
        return gpt
    count = round(rest / h)
    return [rest / count] * count if count else []


def gather_host_s(engine: Engine, n: Any, op_s: float) -> tuple[Any, Any, Any]:
    """The host seconds of one parameter's gather over n ranks with zero3_gather_copy_out (none without):
    (before it is enqueued: the n Python narrows, deepspeed.VIEW_OP each; while it runs: the n copy-out
    launches, CXX_COPY_OP each; of those, the ones past the stream's PENDING_LAUNCHES queue, which follow its
    end), at op_s (device.op_overhead_s) per eager op; n a number or a numpy array (the quick estimate's)."""
    op = op_s if engine.zero3_gather_copy_out else 0.0
    past = nonnegative(n - ds.PENDING_LAUNCHES)
    return ds.VIEW_OP * n * op, ds.CXX_COPY_OP * n * op, ds.CXX_COPY_OP * past * op


def gather_pass_bytes(engine: Engine, numel: Any, w: float) -> tuple[Any, Any]:
    """The device bytes of one gathered parameter of `numel` elements at w bytes each besides the collective,
    with zero3_gather_copy_out (none without; numel a number or a numpy array): (the zero fill of its output,
    torch.zeros(aligned_param_size), which the device synchronize before the gather waits for: one write;
    the copy of the flat result into the n outputs, on the communication stream after it: a read and a
    write), partition_parameters.py _allgather_param as cost/deepspeed.py's docstring reads it."""
    on = 1.0 if engine.zero3_gather_copy_out else 0.0
    return on * numel * w, on * 2.0 * numel * w


def fetch_norm_bytes(engine: Engine, numel: Any, w: float) -> Any:
    """With zero3_fetch_norm, the bytes each fetch of a layer's `numel` gathered elements reads once more
    (stage3.py fetch_sub_module's param.norm() in its debug print, evaluated whatever the log level); none
    without. numel a number or a numpy array."""
    return w * numel if engine.zero3_fetch_norm else 0.0 * numel


def deepspeed_rank(rank: Rank, graph: LayerGraph, cluster: ClusterSpec, config: ParallelConfig, engine: Engine,
                   groups: DpGroups) -> None:
    """Replace the rank's per-microbatch forward and backward by DeepSpeed stage 3's timeline
    (cost/deepspeed.py): per-parameter all-gathers over the data-parallel group (plus, with
    zero3_gather_copy_out, the zero fill of the output, waited for by the device synchronize before the
    gather, then torch's copy of the gathered list into each of the n outputs: two passes over the
    parameter on the communication stream and deepspeed.GATHER_OPS_PER_RANK x n ops at op_overhead_s on
    the host before the compute, the VIEW_OP share before the gather is enqueued and the CXX_COPY_OP share
    while it runs, past deepspeed.PENDING_LAUNCHES queued copies after it), bucketed gradient reductions of
    zero3_grad_reduction, one sub-module of prefetch; with zero3_regather_persistent, the per-step
    re-gather of the persistent parameters (deepspeed.persistent_regather) after the optimizer."""
    w, _, _ = state_bytes_per_param(cluster.dtype, engine)
    wire = grad_wire_bytes(cluster.dtype, engine)
    n = groups.dense.size
    reduce_fn = comm.all_reduce_s if engine.zero3_grad_reduction == "all_reduce" else comm.reduce_scatter_s

    def gather_s(numel: float) -> float:
        t = comm.all_gather_s(numel * w, groups.dense, cluster)
        if engine.zero3_gather_copy_out:  # the n copies out of the flat result read and write it once
            t += memory_time_s(cluster.device, gather_pass_bytes(engine, numel, w)[1])
        return t

    def fill_s(numel: float) -> float:
        # partition_parameters.py _allgather_param: torch.zeros(aligned_param_size) on the comm stream, then
        # torch.cuda.synchronize() before the all_gather: the fill is waited for, not overlapped
        return memory_time_s(cluster.device, gather_pass_bytes(engine, numel, w)[0]) \
            if engine.zero3_gather_copy_out else 0.0

    issue, launch, blocked = gather_host_s(engine, n, cluster.device.op_overhead_s)

    def reduce_s(numel: float, passes: float = 3.0) -> float:
        # all_reduce: stage3.py buffered_reduce_fallback -> allreduce_and_copy on the reduction stream:
        # flatten the bucket, divide by n, reduce, copy back into the gradients: three read + write passes
        fallback = engine.zero3_grad_reduction == "all_reduce"
        copies = memory_time_s(cluster.device, passes * 2.0 * numel * wire) if fallback else 0.0
        return reduce_fn(numel * wire, groups.dense, cluster) + copies

    def single_s(numel: float) -> float:
        # one gradient: util_ops.flatten -> torch::utils::flatten_dense_tensors returns a view of a single
        # tensor (torch/csrc/utils/tensor_flatten.h): no flatten pass; the divide, and the copy back onto that
        # same memory unless the engine's torch short-circuits it (gradpasses.self_copy_passes)
        return reduce_s(numel, 1.0 + self_copy_passes(engine))

    full = config.recompute.value == "full"
    layers, tensors = [], rank_tensors(rank, graph, config)
    for c, (numels, small_all) in zip(rank.costs, tensors):
        small = small_all if engine.zero3_small_grad_hooks else []
        rank.max_param_numel = max(rank.max_param_numel, max(numels))
        # zero3_fetch_norm: each fetch reads the layer's gathered weights once more (param.norm())
        norm = memory_time_s(cluster.device, fetch_norm_bytes(engine, sum(numels), w))
        layers.append(ds.block_modules(numels, c.forward_s + norm, c.time_s - c.fwd_s - c.fwd_comm_s
                                       - c.recompute_s + norm, c.recompute_s + (norm if full else 0.0), c.host_s, full,
                                       small))
    fwd, bwd, hidden = ds.microbatch_s(layers, engine, recompute=full, gather_s=gather_s, reduce_s=reduce_s,
                                       issue_s=issue, fill_s=fill_s, launch_s=launch,
                                       blocked_s=blocked, single_s=single_s)
    base_f = sum(c.forward_s for c in rank.costs)
    base_b = sum(c.time_s for c in rank.costs) - base_f
    exposed = max(fwd - base_f, 0.0) + max(bwd - base_b, 0.0)
    penalty = hidden_penalty_s(hidden, cluster, contention_fraction(cluster, groups.dense))
    rank.fwd += fwd - base_f
    rank.bwd += bwd - base_b + penalty
    rank.dp += exposed + penalty
    rank.param_gather += deepspeed_step_s(rank, graph, cluster, config, engine, groups, tensors=tensors)


def rank_tensors(rank: Rank, graph: LayerGraph, config: ParallelConfig) -> list[tuple[list[float], list[float]]]:
    """Per layer of the rank, (layer_numels, layer_small_numels): the parameter tensors DeepSpeed handles one
    by one, computed once for deepspeed_rank's timeline and deepspeed_step_s's once-per-step work."""
    return [(layer_numels(x, c, graph, config), layer_small_numels(x, c, graph, config))
            for c, x in zip(rank.costs, rank.layers)]


def deepspeed_step_s(rank: Rank, graph: LayerGraph, cluster: ClusterSpec, config: ParallelConfig, engine: Engine,
                     groups: DpGroups, *, tensors: list[tuple[list[float], list[float]]] | None = None) -> float:
    """DeepSpeed stage 3's once-per-step host work around the optimizer on this rank: with
    zero3_serial_grad_checks the overflow check and gradient norm one parameter tensor at a time
    (deepspeed.serial_grad_checks over the rank's weight matrices and small parameters, as layer_numels and
    layer_small_numels count them) and their two one-element all-reduces; with zero3_regather_persistent
    the re-gather of the persistent parameters (deepspeed.persistent_regather). `tensors`: rank_tensors(rank,
    ...) where the caller has them (deepspeed_rank), else computed here."""
    w, _, _ = state_bytes_per_param(cluster.dtype, engine)
    n, op, total = groups.dense.size, cluster.device.op_overhead_s, 0.0
    tensors = rank_tensors(rank, graph, config) if tensors is None else tensors
    if engine.zero3_serial_grad_checks:  # stage3.py step, before the optimizer
        count = sum(1 for numels, small in tensors for k in (*numels, *small) if k > 0)
        ops, messages = ds.serial_grad_checks(count)
        total += ops * op + sum(comm.all_reduce_s(b, groups.dense, cluster) for b in messages)
    if engine.zero3_regather_persistent:  # after the optimizer (stage3.py _post_step)
        small = [x for _, layer_small in tensors for x in layer_small if x < engine.zero3_persistence_numel]
        ops, elements = ds.persistent_regather(small, n)
        total += ops * op + comm.all_gather_s(elements * w, groups.dense, cluster)
    return total
