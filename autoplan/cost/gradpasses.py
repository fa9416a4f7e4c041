"""Memory-bound passes over the local gradients around the data-parallel reduction, as each engine makes
them on the compute stream (the reduce dtype: grad_wire_bytes): FSDP2's reduce-scatter copy-in, the DDP's
flatten / divide / copy-back, Megatron-Core's gradient-buffer fill and scale. Used by cost/dataparallel.py
(the exact model) and search/assemble.py (the quick estimate's per-byte terms).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from autoplan.cluster.types import ClusterSpec
from autoplan.cost.kernels import memory_time_s
from autoplan.cost.layer import dtype_bytes
from autoplan.plan.engine import Engine
from autoplan.plan.layout import ZeroLayout
from autoplan.plan.types import ParallelConfig


def grad_wire_bytes(dtype: str, engine: Engine) -> float:
    """Bytes per gradient element in the data-parallel reduction: fp32 when the engine reduces bf16 /
    fp8 gradients in fp32 (estimate.GRAD_REDUCE_BYTES), fp32 for fp32 training, else the dtype's."""
    if dtype in ("fp32", "tf32") or (engine.grad_reduce_fp32 and dtype in ("bf16", "fp8")):
        return 4.0
    return float(dtype_bytes(dtype))


def reduce_copy_in_s(numel: float, cluster: ClusterSpec, layout: ZeroLayout, engine: Engine) -> float:
    """FSDP2's reduce-scatter copy-in (engine.reduce_scatter_copy_in): before each reduce-scatter,
    foreach_reduce_scatter_copy_in reads the unsharded gradients (training dtype) and writes them into
    the reduce-scatter input in the reduce dtype (grad_wire_bytes), and the compute stream waits for that
    copy before it goes on (torch 2.13 _fsdp_collectives.foreach_reduce runs it on the current stream;
    the spring-2024 version on the reduce-scatter stream, then `current_stream.wait_event(copy_in_event)`),
    so it adds to the backward as the all-gather copy-out does: a memory-bound pass over `numel`
    gradients. Zero when the layout all-reduces or the engine reduces its buffers in place."""
    if not engine.reduce_scatter_copy_in or layout.grad_reduction != "reduce_scatter":
        return 0.0
    per_element = dtype_bytes(cluster.dtype) + grad_wire_bytes(cluster.dtype, engine)
    return memory_time_s(cluster.device, per_element * numel)


def ddp_grad_passes_s(numel: float, cluster: ClusterSpec, layout: ZeroLayout, engine: Engine) -> float:
    """The DDP's own memory-bound passes around a once-per-step all-reduce of `numel` local gradients:
    engine.dp_overlap_grad_passes when it overlaps the backward (engine.dp_comm_overlap; PyTorch DDP's
    Reducer copies each gradient into its bucket, divided by the group size, then back after the
    all-reduce), else engine.dp_grad_passes (Megatron-LM 2021's local DDP: flatten, divide, copy back),
    each a read and a write of the gradients in the reduce dtype (grad_wire_bytes) on the compute stream:
    they add to the step, also with a data-parallel group of one (Megatron-LM a8d172b3 training.py
    train_step calls allreduce_gradients unconditionally; DeepSpeed v0.10.0 engine.py allreduce_gradients
    -> buffered_allreduce_fallback -> allreduce_and_copy has no group-size check). Sources in
    engines/megatron-lm.yaml and engines/megatron-deepspeed.yaml. Zero for a sharded or per-microbatch
    reduction (FSDP's copy-in is reduce_copy_in_s)."""
    if layout.grad_reduction != "all_reduce" or layout.reduce_every_microbatch:
        return 0.0
    return memory_time_s(cluster.device, ddp_grad_pass_bytes(cluster.dtype, engine) * numel)


def grad_buffer_passes_s(numel: float, cluster: ClusterSpec, config: ParallelConfig, layout: ZeroLayout,
                         engine: Engine) -> float:
    """Megatron-Core's passes over its contiguous gradient buffer (Engine.grad_buffer_passes; sources in
    engines/megatron-core.yaml), once per step on the compute stream, memory-bound over the `numel` local
    gradients in the buffer's dtype (grad_wire_bytes): zero_grad_buffer's fill (a write) and, when Megatron's
    data-parallel size (autoplan's dp x ep) exceeds one, Bucket.start_grad_sync's scale by 1 / dp (a read and a
    write; gradient_scaling_factor 1.0 skips it). Zero without the field or for a layout that reduces every
    microbatch (Megatron-FSDP's own buffers)."""
    if not engine.grad_buffer_passes or layout.reduce_every_microbatch:
        return 0.0
    return memory_time_s(cluster.device, grad_buffer_pass_bytes(cluster.dtype, engine, config.dp * config.ep) * numel)


def grad_buffer_pass_bytes(dtype: str, engine: Engine, dp: Any) -> Any:
    """Bytes per local gradient of grad_buffer_passes_s: the fill's write, plus a read and a write where the
    data-parallel size `dp` (a scalar or an array of candidates) exceeds one."""
    return grad_wire_bytes(dtype, engine) * (1.0 + 2.0 * (np.asarray(dp) > 1))


def ddp_grad_pass_bytes(dtype: str, engine: Engine) -> float:
    """Bytes per local gradient element of ddp_grad_passes_s's passes (read + write each, reduce dtype)."""
    passes = engine.dp_overlap_grad_passes if engine.dp_comm_overlap else engine.dp_grad_passes
    return passes * 2.0 * grad_wire_bytes(dtype, engine)
