"""A block's weight GEMMs as the engine's code issues them, and the part of them each recompute re-runs.

compute._block_gemm_groups lists a block's matmuls on one device as (m, k, n, count) groups in a fixed
order: 0 the QKV projection, 1 the attention output projection, 2 the MLP matmuls (n_mlp of them per
dense MLP), then the routed experts if any. Two engine facts change that list or what a recompute runs:

- Engine.separate_qkv_projections: Q, K and V come from three linears (torchtitan/models/llama/model.py
  Attention.forward, `xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)`; autoplan's models/transformer.py
  the same), not one fused QKV GEMM (Megatron's query_key_value / linear_qkv): group 0 becomes the Q GEMM
  [T x h] @ [h x h / t] and a K / V group [T x h] @ [h x h g / (a t)], count 2, is appended last. With
  grouped-query attention the narrow K and V outputs fill fewer tiles per wave (kernels.gemm_efficiency);
  the backward sums the three input gradients (passes.extra_pass_bytes).
- Engine.recompute_early_stop: torch.utils.checkpoint's non-reentrant checkpoint stops the recomputation
  as soon as the last tensor the original forward saved is saved again (torch/utils/checkpoint.py
  _recomputation_hook.pack_hook raises _StopRecomputationError once recomp_counter reaches the number of
  saved tensors; on by default since pytorch/pytorch PR #96866, March 2023, `set_checkpoint_early_stop`).
  In a dense pre-norm block the last op that saves anything is the MLP's output projection (its mm saves
  its input and weight in autograd's VariableType wrapper, before the kernel runs); the residual add after
  it saves nothing. So a fully recomputed block re-runs its forward without that GEMM and that add (and,
  under tensor parallelism, without the row-parallel collective after it: layer._tp_comm_s). A routed-
  expert block's combine saves the experts' outputs after their last GEMM: nothing is skipped there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoplan.cluster.types import DeviceSpec
from autoplan.cost.kernels import gemm_pass_s, memory_time_s

if TYPE_CHECKING:
    from autoplan.cost.compute import BlockShape

Group = tuple[float, float, float, float]


def split_qkv(groups: list[Group], shape: BlockShape, tp: int) -> list[Group]:
    """The fused QKV group 0 as separate Q (count as group 0) and K / V GEMMs (twice that count, appended
    last): the same FLOPs, h / t and h g / (a t) wide outputs."""
    tokens, h, _, count = groups[0]
    kv_width = shape.h * shape.g / shape.a / tp
    return [(tokens, h, shape.h / tp, count), *groups[1:], (tokens, h, kv_width, 2.0 * count)]


def k_gemm_s(device: DeviceSpec, peak_flops: float, groups: list[Group], shape: BlockShape, dtype_bytes: int,
             separate_qkv: bool) -> float:
    """The forward K projection alone: its own GEMM when separate (one of the last group's two), else its
    share h g / a of the fused QKV GEMM's width."""
    if separate_qkv:
        m, k, n, count = groups[-1]
        return gemm_pass_s(device, peak_flops, m, k, n, count / 2.0, dtype_bytes)
    k_share = (shape.h * shape.g / shape.a) / shape.qkv_out_width
    return k_share * gemm_pass_s(device, peak_flops, *groups[0], dtype_bytes)


def op_selective_recompute_s(device: DeviceSpec, peak_flops: float, groups: list[Group], shape: BlockShape,
                             dtype_bytes: int, separate_qkv: bool) -> float:
    """torchtitan's per-op selective checkpointing recomputes every second matmul (K, the output
    projection, the second MLP input projection: memory.block_activation_bytes) and the elementwise ops:
    the K GEMM, the projection GEMM and one of the n_mlp MLP GEMMs."""
    proj, mlp = groups[1], groups[2]
    return (k_gemm_s(device, peak_flops, groups, shape, dtype_bytes, separate_qkv)
            + gemm_pass_s(device, peak_flops, *proj, dtype_bytes)
            + gemm_pass_s(device, peak_flops, *mlp, dtype_bytes) / max(shape.n_mlp, 1))


def early_stop_skip_s(device: DeviceSpec, peak_flops: float, groups: list[Group], shape: BlockShape,
                      residual_tokens: float, dtype_bytes: int) -> float:
    """What an early-stopping full recompute of a dense block does not re-run: one MLP GEMM (the output
    projection; the group's shape, as the forward prices it) and the second residual add (read 2 h, write
    h elements, plus its 1-byte mask when the block has dropout, on `residual_tokens`: T / t with sequence
    parallelism, else T). Zero for a routed-expert block."""
    if shape.num_experts:
        return 0.0
    m, k, n, _ = groups[2]
    add = residual_tokens * shape.h * (3.0 * dtype_bytes + (1.0 if shape.dropout else 0.0))
    return gemm_pass_s(device, peak_flops, m, k, n, 1.0, dtype_bytes) + memory_time_s(device, add)
