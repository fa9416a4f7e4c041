"""Memory-bound passes over the local gradients around the data-parallel reduction, as each engine makes
them on the compute stream (the reduce dtype: grad_wire_bytes): FSDP2's reduce-scatter copy-in, the DDP's
flatten / divide / copy-back, Megatron-Core's gradient-buffer fill and scale. Used by cost/dataparallel.py
(the exact model) and search/assemble.py (the quick estimate's per-byte terms).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from autoplan.cluster.types import ClusterSpec
from autoplan.cost.broadcast import scalar
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


def dp_wire_bytes(dtype: str, engine: Engine) -> float:
    """Bytes per gradient element on the wire of the data-parallel gradient reduction: the training dtype's
    where the engine casts BF16_Optimizer's fp32 gradients down for it (Engine.bf16_comm: DeepSpeed engine.py
    allreduce_bucket `tensor.to(self.communication_data_type)`, bf16 by default for a bf16 model; sources in
    engines/megatron-deepspeed.yaml bf16_grad_comm), else grad_wire_bytes. The gradient buffers themselves
    (memory, FSDP2's copy-in) and the tied head's all-reduce (DeepSpeed _exec_reduce_tied_grads reduces
    weight._hp_grad, fp32, directly) stay at grad_wire_bytes."""
    return float(dtype_bytes(dtype)) if engine.bf16_comm(dtype) else grad_wire_bytes(dtype, engine)


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
    return memory_time_s(cluster.device, ddp_grad_pass_bytes(cluster.dtype, engine, numel) * numel)


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


def ddp_grad_pass_bytes(dtype: str, engine: Engine, numel: Any) -> Any:
    """Bytes per local gradient element of ddp_grad_passes_s's passes over a rank's `numel` gradients (a
    scalar or an array of candidates): bf16_comm_pass_bytes under Engine.bf16_comm, else the engine's passes,
    a read and a write each in the reduce dtype."""
    if engine.bf16_comm(dtype):
        return bf16_comm_pass_bytes(dtype, engine, numel)
    passes = engine.dp_overlap_grad_passes if engine.dp_comm_overlap else engine.dp_grad_passes
    return passes * 2.0 * grad_wire_bytes(dtype, engine)


def self_copy_passes(engine: Engine) -> float:
    """Read + write passes of torch's copy_ of a view onto the very data it reads (a one-tensor bucket's flatten
    is that view, torch/csrc/utils/tensor_flatten.h): none where the engine's torch short-circuits it
    (Engine.self_copy_skipped: aten/src/ATen/native/Copy.cpp copy_impl "Exit early if self and src are views of
    the same data", pytorch/pytorch PR #88884, 2022-11, torch 2.0; in the torch 2.13 installed here a 50M-element
    self copy takes 0.1 ms against 20 ms for a copy), one before (copy_impl returned early only for
    `self.is_same(src)`, which a narrow view is not)."""
    return 0.0 if engine.self_copy_skipped else 1.0


def bf16_comm_pass_bytes(dtype: str, engine: Engine, numel: Any) -> Any:
    """Bytes per local gradient element that DeepSpeed's once-per-step all-reduce of BF16_Optimizer's fp32
    gradient buffer makes on the compute stream when it travels in the training dtype (Engine.bf16_comm).
    v0.6.2-v0.11.1 pipe/engine.py _bf16_reduce_grads -> engine.py buffered_allreduce_fallback(grads=
    optimizer.get_grads_for_reduction(): bf16_optimizer.py fp32_groups_gradients_flat, one flat fp32 buffer per
    param group, Megatron's weight-decay group first) -> allreduce_no_retain (a bucket closes once it holds more
    than dp_bucket_numel elements) -> allreduce_and_copy -> allreduce_bucket:
      `tensor = self.flatten(bucket)`: torch flatten_dense_tensors, a view for a one-tensor bucket, else a cat
          (a read and a write of the buffer, b = grad_wire_bytes);
      `tensor.to(self.communication_data_type)`: the cast, b read + w written (w = the dtype's bytes);
      `tensor_to_allreduce.mul_(gradient_predivide_factor / world_size)` after the all-reduce (postscale, the
          default): w + w (skipped with one rank: not modelled, as dp_grad_passes);
      `tensor.copy_(tensor_to_allreduce)`: the copy back, w + b;
      then `buf.copy_(synced)` per buffer: b + b from the cat's result, a copy onto itself for a one-tensor
          bucket (self_copy_passes).
    A rank whose gradients exceed dp_bucket_numel has its weight-decay buffer (nearly all of them; the no-decay
    group holds the norms and biases) in a bucket of its own: counted so when `numel` exceeds it."""
    b, w = grad_wire_bytes(dtype, engine), float(dtype_bytes(dtype))
    alone = (np.asarray(numel) > engine.dp_bucket_numel) & (engine.dp_bucket_numel > 0)
    out = (b + w) + 2.0 * w + (w + b) + np.where(alone, 2.0 * b * self_copy_passes(engine), 4.0 * b)
    return scalar(out)
